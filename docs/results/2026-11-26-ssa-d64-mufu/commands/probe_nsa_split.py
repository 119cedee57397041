"""Issue 28, NSA: the compressed branch's backward through the Gluon single pass with each key
block's query range split over programs (chunk = iters // group query blocks, dK/dV added in
fp32), against the range kernels' backward; bench_nsa's layer and compressed rows (fwd+bwd ms,
x SDPA flash timed in the same process), D64 and D128, GQA 16, N = 16K and 64K."""
import sys

sys.argv = [sys.argv[0], "--compress", "mean", "--hq", "64", "--hkv", "4", "--rep-ms", "60", "--warmup-ms", "20"]
import benchmarks.bench_nsa as BN  # noqa: E402
from nemo_ssa.ops.nsa import range_attn as R  # noqa: E402

args = BN.parse_args(sys.argv[1:])
VARIANTS = [("range bwd", {"gluon": False}), ("gluon, 256 iters", {"gluon": True, "gluon_chunk_iters": 256}),
            ("gluon, 128 iters", {"gluon": True, "gluon_chunk_iters": 128}),
            ("gluon, 512 iters", {"gluon": True, "gluon_chunk_iters": 512}),
            ("range bwd (again)", {"gluon": False})]
out = []
for D in (64, 128):
    for N in (16384, 65536):
        for name, ov in VARIANTS:
            R.TILE_OVERRIDE.clear()
            R.TILE_OVERRIDE.update(ov)
            rows = BN.run_case(args, D, N, {"sdpa_flash", "nsa_layer", "compressed"})
            for r in rows:
                if r["mode"] == "fwd+bwd" and r["what"] in ("nsa_layer", "compressed"):
                    out.append((D, N, name, r["what"], r["ms"], r["x_sdpa"]))
                    print(out[-1], flush=True)
R.TILE_OVERRIDE.clear()
print("\n| D | N | backward | row | fwd+bwd ms | x SDPA flash |")
print("|---|---|---|---|---|---|")
for o in out:
    print(f"| {o[0]} | {o[1]} | {o[2]} | {o[3]} | {o[4]:.2f} | {o[5]:.2f} |")
