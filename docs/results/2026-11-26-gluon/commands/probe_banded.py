"""Device probe: the banded importance order (select.IMPORTANCE_BANDED) against the tile order
and an fp64 selection (kv head 0), at 64K and 16K; margins of the rows that differ."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from nemo_ssa.ops.nsa import NSAConfig, compress_kv
from nemo_ssa.ops.nsa import select as S
from nemo_ssa.ops.nsa.range_attn import compressed_attention
from nemo_ssa.ops.nsa.naive import compressed_visibility, overlap_matrix, select_blocks

def ref_importance(q, kc, cfg):
    n_tok, d = q.shape[2], q.shape[3]
    group = q.shape[1] // kc.shape[1]
    vis = compressed_visibility(n_tok, cfg, q.device)
    k64 = kc[0, 0].double()
    psum = torch.zeros(n_tok, k64.shape[0], dtype=torch.float64, device=q.device)
    for h in range(group):
        z = (q[0, h].double() @ k64.T) / d ** 0.5
        z = z.masked_fill(~vis, float("-inf"))
        psum += torch.nan_to_num(torch.softmax(z, dim=-1), nan=0.0)
        del z
    return psum @ overlap_matrix(n_tok, cfg, device=q.device, dtype=torch.float64)

def deficit(imp, ref_idx, got_idx, rows):
    """relative importance lost by got's set against ref's set on the given rows (forced blocks count 0)."""
    r = ref_idx[rows].long(); gi = got_idx[rows].long()
    ir = imp[rows]
    a = torch.where(r >= 0, ir.gather(1, r.clamp(min=0)), 0.0).sum(1)
    b = torch.where(gi >= 0, ir.gather(1, gi.clamp(min=0)), 0.0).sum(1)
    return ((a - b) / ir.max(1).values.clamp(min=1e-300)).max().item()

print(torch.cuda.get_device_name(), flush=True)
out = []
for D, HQ, HKV, N in [(64, 64, 4, 65536), (128, 64, 4, 65536), (64, 24, 8, 65536), (64, 64, 4, 16384), (128, 24, 8, 16384)]:
    cfg = NSAConfig(compress="mean")
    g = torch.Generator(device="cuda").manual_seed(N)
    q = torch.randn(1, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        kc = compress_kv(k, cfg, None)
        _, lse_c = compressed_attention(q, kc, kc, cfg.block_len, cfg.stride)
        S.TILE_OVERRIDE.clear(); S.TILE_OVERRIDE["banded"] = False
        tile = S.select_blocks_triton(q, kc, lse_c, cfg)
        S.TILE_OVERRIDE["banded"] = True
        band = S.select_blocks_triton(q, kc, lse_c, cfg)
        S.TILE_OVERRIDE.clear()
    imp = ref_importance(q, kc, cfg)
    ref = select_blocks(imp[None, None], cfg)[0, 0]
    t0, b0 = tile[0, 0].long(), band[0, 0].long()
    dt = (t0 != ref).any(-1); db = (b0 != ref).any(-1); dtb = (tile != band).any(-1)
    msg = (f"| D{D} H{HQ}/{HKV} N{N} | tile != fp64: {dt.float().mean().item():.2e} ({int(dt.sum())}) | "
           f"banded != fp64: {db.float().mean().item():.2e} ({int(db.sum())}) | banded != tile (all kv heads): "
           f"{dtb.float().mean().item():.2e} ({int(dtb.sum())}) | max rel. deficit tile {deficit(imp, ref, t0, dt.nonzero()[:, 0]) if dt.any() else 0:.1e} "
           f"banded {deficit(imp, ref, b0, db.nonzero()[:, 0]) if db.any() else 0:.1e} |")
    print(msg, flush=True); out.append(msg)
    del imp, q, k, kc
    torch.cuda.empty_cache()
print("| shape | tile order | banded | banded vs tile | importance lost (relative to row max) |\n|---|---|---|---|---|")
print("\n".join(out))
