"""Probe (issue 28, NSA), call 10: the layer at D128 GQA16 64K with the importance tiles of
GQA 3 (64 blocks per chunk) against the wide ones (128, the default at GQA >= 16), alternated
in one process -- call 9's layer ran slower than call 5's although its selection is faster."""
import sys
sys.argv = [sys.argv[0], "--compress", "mean", "--hq", "64", "--hkv", "4", "--rep-ms", "100", "--warmup-ms", "30"]
import benchmarks.bench_nsa as BN  # noqa: E402
from nemo_ssa.ops.nsa import select as S  # noqa: E402
args = BN.parse_args(sys.argv[1:])
out = []
for name, ov in (("narrow (64)", {"importance": (64, 64, 128, 4)}), ("wide (128, default)", {}),
                 ("narrow (64)", {"importance": (64, 64, 128, 4)}), ("wide (128, default)", {})):
    S.TILE_OVERRIDE.clear(); S.TILE_OVERRIDE.update(ov)
    for r in BN.run_case(args, 128, 65536, {"sdpa_flash", "nsa_layer", "selection"}):
        out.append((name, r["what"], r["mode"], r["ms"], r["x_sdpa"]))
S.TILE_OVERRIDE.clear()
print("\n| importance tiles | row | mode | ms | x SDPA flash |\n|---|---|---|---|---|")
for o in out:
    print(f"| {o[0]} | {o[1]} | {o[2]} | {o[3]:.2f} | {o[4]:.2f} |")
