"""Probe (issue 28, NSA at GQA 3), call 12: the query-major selected forward and dq (the GQA 16
schedules, 3 of 16 tile rows used) against the KV-major ones at Hq24/Hkv8 -- bench_nsa's
selected and layer rows (fwd, fwd+bwd; x SDPA flash), D64/D128, 16K/64K, alternated."""
import sys
sys.argv = [sys.argv[0], "--compress", "mean", "--hq", "24", "--hkv", "8"]
import benchmarks.bench_nsa as BN  # noqa: E402
from nemo_ssa.ops.nsa import selected_attn as A  # noqa: E402
args = BN.parse_args(sys.argv[1:])
VARIANTS = (("KV-major (default)", {}), ("qmajor fwd, atomic dq", {"qmajor": True, "qmajor_dq": False}),
            ("qmajor fwd + qmajor dq", {"qmajor": True, "qmajor_dq": True}), ("KV-major (again)", {}))
out = []
for D in (64, 128):
    for N in (16384, 65536):
        for name, ov in VARIANTS:
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(ov)
            for r in BN.run_case(args, D, N, {"sdpa_flash", "nsa_layer", "selected"}):
                if r["what"] != "sdpa_flash":
                    out.append((D, N, name, r["what"], r["mode"], r["ms"], r["x_sdpa"]))
A.TILE_OVERRIDE.clear()
print("\n| D | N | schedule | row | mode | ms | x SDPA flash |\n|---|---|---|---|---|---|---|")
for o in out:
    print(f"| {o[0]} | {o[1]} | {o[2]} | {o[3]} | {o[4]} | {o[5]:.2f} | {o[6]:.2f} |")
