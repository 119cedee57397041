"""Issue 28, item 1 on an H100: where NSA's layer spends its time at the paper's shape (D64,
Hq64/Hkv4, N=64K, mean-pooled compression, softmax) and whether the H200-tuned tiles are
also the H100's: the layer's fwd+bwd under each TILE_OVERRIDE variant, the baseline timed
first and last. Every variant is the same math (tiles only)."""
import torch
import triton.testing

from nemo_ssa.ops.nsa import NSAConfig, compress_kv, nsa_attention
from nemo_ssa.ops.nsa import range_attn as RA
from nemo_ssa.ops.nsa import select as SE
from nemo_ssa.ops.nsa import selected_attn as SA
from nemo_ssa.ops.nsa.range_attn import compressed_attention, window_attention
from nemo_ssa.ops.nsa.select import select_blocks_triton
from nemo_ssa.ops.nsa.selected_attn import selected_attention

B, HQ, HKV, N, D = 1, 64, 4, 65536, 64
dt = torch.bfloat16
cfg = NSAConfig(compress="mean")
g = torch.Generator(device="cuda").manual_seed(N + D)


def r(*s):
    return torch.randn(*s, device="cuda", dtype=dt, generator=g).requires_grad_()


q = r(B, HQ, N, D)
kv = [r(B, HKV, N, D) for _ in range(6)]
gates = r(B, HQ, N, 3)
do = torch.randn(B, HQ, N, D, device="cuda", dtype=dt, generator=g)
kw = dict(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5], transform="softmax")
leaves = [q, *kv, gates]


def fb(fn):
    def run():
        fn().backward(do)
    return run


def t(fn, rep=400):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=100, rep=rep, grad_to_none=leaves, return_mode="median")


layer = fb(lambda: nsa_attention(q, kv[0], kv[1], gates, cfg, impl="triton", **kw))
with torch.no_grad():
    kc0 = compress_kv(kv[0], cfg, None)
    _, lse0 = compressed_attention(q, kc0, kc0, cfg.block_len, cfg.stride, transform="softmax")
    idx0 = select_blocks_triton(q, kc0, lse0, cfg, transform="softmax")
parts = {
    "compressed fwd+bwd": fb(lambda: compressed_attention(q, compress_kv(kv[0], cfg, None), compress_kv(kv[1], cfg, None),
                                                          cfg.block_len, cfg.stride, transform="softmax")[0]),
    "selection (fwd only)": lambda: select_blocks_triton(q, kc0, lse0, cfg, transform="softmax"),
    "selected fwd+bwd": fb(lambda: selected_attention(q, kv[2], kv[3], idx0, cfg.select_block, transform="softmax")),
    "window fwd+bwd": fb(lambda: window_attention(q, kv[4], kv[5], cfg.window, transform="softmax")),
}
print("layer fwd+bwd", f"{t(layer):.2f} ms", flush=True)
for name, fn in parts.items():
    try:
        with torch.no_grad() if "selection" in name else torch.enable_grad():
            print(name, f"{t(fn, 200):.2f} ms", flush=True)
    except Exception as e:
        print(name, "failed:", type(e).__name__, str(e)[:200], flush=True)

VARIANTS = [
    ("base", {}),
    ("range fwd:compressed 64x64/4/3", {RA: {"fwd:compressed": (64, 64, 4, 3)}}),
    ("range fwd:compressed 128x64/8/3", {RA: {"fwd:compressed": (128, 64, 8, 3)}}),
    ("range fwd:compressed 128x128/8/2", {RA: {"fwd:compressed": (128, 128, 8, 2)}}),
    ("range fwd:window 128x64/4/3", {RA: {"fwd:window": (128, 64, 4, 3)}}),
    ("range fwd:window 64x64/4/4", {RA: {"fwd:window": (64, 64, 4, 4)}}),
    ("range bwd 64x64/4/2", {RA: {"bwd": (64, 64, 4, 2)}}),
    ("range bwd 64x64/4/4", {RA: {"bwd": (64, 64, 4, 4)}}),
    ("range bwd 64x128/8/3", {RA: {"bwd": (64, 128, 8, 3)}}),
    ("range bwd:window 64x64/4/2", {RA: {"bwd:window": (64, 64, 4, 2)}}),
    ("range dkv_split 2", {RA: {"dkv_split": 2}}),
    ("range dkv_split 8", {RA: {"dkv_split": 8}}),
    ("importance 64/64/128/8", {SE: {"importance": (64, 64, 128, 8)}}),
    ("importance 128/64/128/8", {SE: {"importance": (128, 64, 128, 8)}}),
    ("selected warps 8", {SA: {"num_warps": 8}}),
    ("selected stages 2", {SA: {"num_stages": 2}}),
    ("selected stages 4", {SA: {"num_stages": 4}}),
    ("qmajor warps 2", {SA: {"qmajor_warps": 2}}),
    ("qmajor stages 3", {SA: {"qmajor_stages": 3}}),
    ("base (again)", {}),
]
rows = []
for name, ov in VARIANTS:
    for mod, d in ov.items():
        mod.TILE_OVERRIDE.update(d)
    try:
        ms = t(layer)
    except Exception as e:
        ms = float("nan")
        print(name, "failed:", type(e).__name__, str(e)[:200], flush=True)
    finally:
        for mod in (RA, SE, SA):
            mod.TILE_OVERRIDE.clear()
    rows.append((name, ms))
    print(name, f"{ms:.2f}", flush=True)
base = (rows[0][1] + rows[-1][1]) / 2
print("\n| variant | layer fwd+bwd ms | × baseline |")
print("|---|---|---|")
for name, ms in rows:
    print(f"| {name} | {ms:.2f} | {ms / base:.3f} |")
