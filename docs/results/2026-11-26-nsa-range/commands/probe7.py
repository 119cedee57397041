"""Probe: where the selection's 8.4 ms go (importance pass, top-n, final sort) and the
compressed branch's dK/dV split at D64 GQA16 N=64K."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as S
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")
n, d = 65536, 64
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
nk = (n - 32) // 16 + 1
q, kc, vc = r(1, 64, n, d), r(1, 4, nk, d), r(1, 4, nk, d)
_, lse = R.compressed_attention(q, kc, vc, 32, 16)
ns = S.num_select_blocks(n, cfg)
idx = torch.empty(1, 4, n, cfg.top_n, device="cuda", dtype=torch.int32)
imp = S.importance_scores(q, kc, lse, cfg, t0=0, t1=n, fill_future=False)
rows = [("selection (select_blocks_triton)", do_bench(lambda: S.select_blocks_triton(q, kc, lse, cfg), warmup=10, rep=60)),
        ("importance, one chunk", do_bench(lambda: S.importance_scores(q, kc, lse, cfg, t0=0, t1=n, fill_future=False), warmup=10, rep=60)),
        ("top-n, one chunk", do_bench(lambda: S.topn_blocks(imp, cfg, t0=0, out=idx), warmup=10, rep=60))]
def final_sort():
    key = torch.where(idx < 0, torch.full_like(idx, ns + 1), idx)
    return torch.gather(idx, -1, torch.sort(key, dim=-1).indices)
rows.append(("final sort + gather", do_bench(final_sort, warmup=10, rep=60)))
print("| selection part | ms |\n|---|---|")
for a, b in rows:
    print(f"| {a} | {b:.3f} |", flush=True)
print("\n| compressed dK/dV split | fwd+bwd ms |\n|---|---|")
def fb():
    xs = [t.detach().requires_grad_() for t in (q, kc, vc)]
    o = R.compressed_attention(*xs, 32, 16)[0]
    o.backward(torch.full_like(o, 0.01))
for sp in (0, 4, 8, 16, 24, 32, 48):
    R.TILE_OVERRIDE["dkv_split"] = sp
    print(f"| {sp or 'auto'} | {do_bench(fb, warmup=10, rep=60):.3f} |", flush=True)
