"""Probe (issue 28, NSA selection), call 7: the importance kernel's tiles (bm, bc, bs, warps) at
every head dim and grouping of the issue -- select_blocks_triton timed alone (ms), the rows whose
selection differs from the default tiles' counted."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as S
from nemo_ssa.ops.nsa.naive import compress_kv
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")
TILES = ((64, 64, 128, 4), (64, 128, 128, 4), (32, 128, 128, 4), (64, 128, 128, 8), (32, 64, 128, 4),
         (128, 128, 128, 8), (32, 128, 128, 2))
rows = []
for D, hq, hkv, N, tr in ((64, 64, 4, 65536, "softmax"), (128, 64, 4, 65536, "softmax"), (64, 24, 8, 65536, "softmax"),
                          (128, 24, 8, 65536, "softmax"), (64, 64, 4, 16384, "softmax"), (128, 64, 4, 16384, "softmax"),
                          (64, 64, 4, 65536, "ssa")):
    g = torch.Generator(device="cuda").manual_seed(D + hq)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k = r(1, hq, N, D), r(1, hkv, N, D)
    ssa = dict(n=torch.tensor([1.5], device="cuda"), b=torch.tensor([0.8], device="cuda")) if tr == "ssa" else {}
    with torch.no_grad():
        kc = compress_kv(k, cfg)
        _, lse = R.compressed_attention(q, kc, kc, 32, 16, transform=tr, **ssa)
    S.TILE_OVERRIDE.clear()
    ref = S.select_blocks_triton(q, kc, lse, cfg, transform=tr, **ssa)
    for tiles in TILES:
        S.TILE_OVERRIDE.clear(); S.TILE_OVERRIDE.update(importance=tiles)
        try:
            idx = S.select_blocks_triton(q, kc, lse, cfg, transform=tr, **ssa)
            diff = (idx != ref).any(-1).sum().item()
            t = do_bench(lambda: S.select_blocks_triton(q, kc, lse, cfg, transform=tr, **ssa), warmup=10, rep=60)
            rows.append((tr, D, f"{hq}/{hkv}", N, str(tiles), t, f"{diff} rows differ"))
        except Exception as ex:
            rows.append((tr, D, f"{hq}/{hkv}", N, str(tiles), float("nan"), f"FAIL {type(ex).__name__}: {str(ex)[:60]}"))
        print(rows[-1], flush=True)
    S.TILE_OVERRIDE.clear()
    del q, k, kc, lse, ref
    torch.cuda.empty_cache()
print("\n| transform | D | Hq/Hkv | N | tiles | selection ms | against the default tiles |\n|---|---|---|---|---|---|---|")
for r_ in rows:
    print(f"| {r_[0]} | {r_[1]} | {r_[2]} | {r_[3]} | {r_[4]} | {r_[5]:.3f} | {r_[6]} |")
