"""Probe (issue 28, NSA at D128 GQA16 64K), call 6: the two parts tuned only at D64 or on an
H200 -- A: the selection's importance tiles (bm, bc, bs, warps), selections compared with the
default's; B: the compressed branch's backward tiles (BLOCK_M, BLOCK_N, warps, stages),
gradients compared with the default's. Each row times the part alone (ms)."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as S
from nemo_ssa.ops.nsa.naive import compress_kv
part = sys.argv[1] if len(sys.argv) > 1 else "AB"
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")
D, N = 128, 65536
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
q, k, v = r(1, 64, N, D), r(1, 4, N, D), r(1, 4, N, D)
with torch.no_grad():
    kc, vc = compress_kv(k, cfg), compress_kv(v, cfg)
    _, lse = R.compressed_attention(q, kc, vc, 32, 16)
rows = []
if "A" in part:
    S.TILE_OVERRIDE.clear()
    ref = S.select_blocks_triton(q, kc, lse, cfg)
    for tiles in ((64, 64, 128, 4), (64, 64, 128, 8), (32, 64, 128, 4), (128, 64, 128, 8), (64, 128, 128, 8),
                  (64, 128, 128, 4), (32, 64, 128, 2), (64, 64, 128, 4)):
        S.TILE_OVERRIDE.clear(); S.TILE_OVERRIDE.update(importance=tiles)
        try:
            idx = S.select_blocks_triton(q, kc, lse, cfg)
            diff = (idx != ref).any(-1).sum().item()
            t_imp = do_bench(lambda: S.importance_scores(q, kc, lse, cfg, t0=0, t1=16384, fill_future=False), warmup=10, rep=60)
            t_sel = do_bench(lambda: S.select_blocks_triton(q, kc, lse, cfg), warmup=10, rep=60)
            rows.append(("selection", str(tiles), t_sel, f"importance of 16K rows {t_imp:.3f} ms; {diff} rows differ"))
        except Exception as ex:
            rows.append(("selection", str(tiles), float("nan"), f"FAIL {type(ex).__name__}: {str(ex)[:80]}"))
        print(rows[-1], flush=True)
    S.TILE_OVERRIDE.clear()
if "B" in part:
    do = r(1, 64, N, D)
    leaves = [t.detach().requires_grad_() for t in (q, kc, vc)]

    def fb():
        o, _ = R.compressed_attention(*leaves, 32, 16)
        return torch.autograd.grad(o, leaves, do)
    R.TILE_OVERRIDE.clear()
    ref = fb()
    for tiles in ((64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2),
                  (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2)):
        R.TILE_OVERRIDE.clear(); R.TILE_OVERRIDE.update({"bwd:compressed": tiles})
        try:
            out = fb()
            errs = " ".join(f"{nm} {((a.float() - b.float()).norm() / b.float().norm()).item():.1e}"
                            for nm, a, b in zip(("dq", "dk", "dv"), out, ref))
            t = do_bench(fb, warmup=10, rep=100)
            rows.append(("compressed fwd+bwd", str(tiles), t, errs))
        except Exception as ex:
            rows.append(("compressed fwd+bwd", str(tiles), float("nan"), f"FAIL {type(ex).__name__}: {str(ex)[:80]}"))
        print(rows[-1], flush=True)
    R.TILE_OVERRIDE.clear()
print("\n| part | tiles | ms | note |\n|---|---|---|---|")
for r_ in rows:
    print(f"| {r_[0]} | {r_[1]} | {r_[2]:.3f} | {r_[3]} |")
