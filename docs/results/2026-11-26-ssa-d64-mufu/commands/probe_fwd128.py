"""Issue 28, SSA D64: the Gluon forward (with C) at 128-key blocks against the table's 64-key
blocks, under the package's backward (fold_rcp, ds_smem); fwd+bwd ms x SDPA cuDNN, the variants
interleaved three times (cuDNN timed beside each round)."""
import statistics

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.attention.hopper as Hf
from nemo_ssa.ops.attention.flash import ssa_attention_triton

SAVED = dict(Hf.GLUON_FWD)
VAR = {"table (BN64, 3 stages)": SAVED[(64, "ssa")], "BN128, 2 stages": SAVED[(64, "ssa")]._replace(block_n=128, stages=2),
       "BN128, 3 stages": SAVED[(64, "ssa")]._replace(block_n=128, stages=3)}


def bench(f):
    f()
    torch.cuda.synchronize()
    return triton.testing.do_bench(f, rep=300, return_mode="median")


out = []
for label, Bz, Hh, N, D in [("D64 B2 N8192", 2, 16, 8192, 64), ("D64 B8 N4096", 8, 16, 4096, 64)]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16)
    n = torch.tensor([1.5], device="cuda", requires_grad=True)
    b = torch.tensor([0.8], device="cuda")
    sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    fn = lambda: torch.autograd.grad(ssa_attention_triton(q, k, v, n, b, causal=True), [q, k, v, n], go)  # noqa: E731
    res = {name: [] for name in VAR}
    cud = []
    for _ in range(3):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cud.append(bench(lambda: torch.autograd.grad(sd(), [q, k, v], go)))
        for name, cfg in VAR.items():
            Hf.GLUON_FWD[(64, "ssa")] = cfg
            res[name].append(bench(fn))
    Hf.GLUON_FWD.clear()
    Hf.GLUON_FWD.update(SAVED)
    c = statistics.median(cud)
    for name, ts in res.items():
        t = statistics.median(ts)
        out.append((label, name, t, t / c, " ".join(f"{x:.3f}" for x in ts), " ".join(f"{x:.3f}" for x in cud)))
        print(out[-1], flush=True)
    del q, k, v, go
    torch.cuda.empty_cache()
print("\n| shape | SSA forward tiles | fwd+bwd ms (median of 3) | x cuDNN | rounds | cuDNN rounds |")
print("|---|---|---|---|---|---|")
for r in out:
    print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]} | {r[5]} |")
