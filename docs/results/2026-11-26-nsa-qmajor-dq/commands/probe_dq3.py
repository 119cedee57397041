"""Probe (issue 28, NSA selected backward), call 3: the KV-major kernel without dq at 32 rows
and D128 gave dk 5x eager's error in call 2 (SSA, N=3001) and 8.5e-3 off the atomic path in
call 1 (softmax, 64K). Sweep rows x warps x stages at D128 (and D64 for contrast) against
fp32 from the same bf16 inputs, eager bf16's error beside (GQA16 Hq32/Hkv2, N=3001)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import selected_attn as A
from nemo_ssa.ops.nsa.naive import masked_attention, selection_keep_mask, select_blocks

cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


rows = []
for tr, d in (("softmax", 128), ("ssa", 128), ("ssa", 64)):
    n, hq, hkv = 3001, 32, 2
    g = torch.Generator(device="cpu").manual_seed(d)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv))
    do = torch.randn(1, hq, n, d, generator=g).to("cuda", torch.bfloat16)
    idx = select_blocks(torch.rand(1, hkv, n, -(-n // 64), generator=g).to("cuda"), cfg).int()
    ssa = dict(n=torch.tensor([1.5], device="cuda"), b=torch.tensor([0.8], device="cuda")) if tr == "ssa" else {}
    causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    keep = (selection_keep_mask(idx, n, cfg) & causal).repeat_interleave(hq // hkv, 1)

    def run(fn, dtype):
        ls = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = fn(*ls)
        return [o] + list(torch.autograd.grad(o, ls, do.to(dtype)))

    ref = run(lambda a, b, c: masked_attention(a, b, c, keep, transform=tr, **ssa)[0], torch.float32)
    eager = run(lambda a, b, c: masked_attention(a, b, c, keep, transform=tr, upcast=False, **ssa)[0], torch.bfloat16)
    rows.append((tr, d, "eager bf16", *[rel(x, y) for x, y in zip(eager, ref)]))
    variants = [("atomic dq bq32 w4 st3", dict(qmajor_dq=False, block_q=32, num_warps=4, num_stages=3))]
    variants += [(f"no-dq bq{bq} w{w} st{st}", dict(qmajor_dq=True, block_q=bq, num_warps=w, num_stages=st))
                 for bq, w, st in ((32, 4, 1), (32, 4, 2), (32, 4, 3), (32, 8, 2), (32, 8, 3), (64, 4, 3), (64, 8, 3),
                                   (128, 8, 2), (128, 8, 1), (16, 4, 3))]
    variants += [("defaults", {})]
    for name, ov in variants:
        A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(ov)
        try:
            out = run(lambda a, b, c: A.selected_attention(a, b, c, idx, 64, transform=tr, **ssa), torch.bfloat16)
            rows.append((tr, d, name, *[rel(x, y) for x, y in zip(out, ref)]))
        except Exception as ex:
            rows.append((tr, d, name + f" FAIL {type(ex).__name__}", *[float("nan")] * 4))
        print(rows[-1], flush=True)
    A.TILE_OVERRIDE.clear()
    del q, k, v, keep, ref, eager
    torch.cuda.empty_cache()
print("\n| transform | D | variant | o | dq | dk | dv | dk / eager dk |\n|---|---|---|---|---|---|---|---|")
eag = {}
for r_ in rows:
    if r_[2] == "eager bf16":
        eag[(r_[0], r_[1])] = r_[5]
    print(f"| {r_[0]} | {r_[1]} | {r_[2]} | " + " | ".join(f"{x:.2e}" for x in r_[3:]) + f" | {r_[5] / eag[(r_[0], r_[1])]:.2f} |")
