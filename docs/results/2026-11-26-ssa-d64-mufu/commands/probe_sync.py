"""Issue 28, SSA D64: what the pipelined backward's one barrier per block (both consumer
warpgroups, before the previous block's dq and slot are released) costs -- a patched copy
without it (a race: timing only), with fold_rcp and smem_ops 1; fwd+bwd ms x SDPA cuDNN."""
import importlib.util

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.common.bwd as B
import nemo_ssa.ops.common.hopper_bwd as H
from nemo_ssa.ops.attention.flash import ssa_attention_triton

SRC = open(H.__file__).read()
A = "        gl.thread_barrier()  # dS^T of block it from both warpgroups; block it - 1 done everywhere\n"
assert SRC.count(A) == 1
open("/tmp/hb_nobar.py", "w").write(SRC.replace(A, ""))
spec = importlib.util.spec_from_file_location("hb_nobar", "/tmp/hb_nobar.py")
NB = importlib.util.module_from_spec(spec)
spec.loader.exec_module(NB)
SAVED = dict(H.GLUON_BWD)
best = SAVED[(64, "ssa")]._replace(fold_rcp=1, smem_ops=1)


def bench(f):
    f()
    torch.cuda.synchronize()
    return triton.testing.do_bench(f, rep=300, return_mode="median")


rows = []
for label, Bz, Hh, N, D in [("D64 B2 N8192", 2, 16, 8192, 64), ("D64 B8 N4096", 8, 16, 4096, 64)]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16)
    n = torch.tensor([1.5], device="cuda", requires_grad=True)
    b = torch.tensor([0.8], device="cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        c_fb = bench(lambda: torch.autograd.grad(sd(), [q, k, v], go))
    fn = lambda: torch.autograd.grad(ssa_attention_triton(q, k, v, n, b, causal=True), [q, k, v, n], go)  # noqa: E731
    H.GLUON_BWD[(64, "ssa")] = best
    NB.GLUON_BWD[(64, "ssa")] = best
    rows.append((label, "fold + dS from smem", bench(fn), c_fb))
    B.launch_gluon_bwd = NB.launch_gluon_bwd
    rows.append((label, "same, no barrier per block (race)", bench(fn), c_fb))
    B.launch_gluon_bwd = H.launch_gluon_bwd
    rows.append((label, "fold + dS from smem (again)", bench(fn), c_fb))
    H.GLUON_BWD.clear()
    H.GLUON_BWD.update(SAVED)
    rows.append((label, "table", bench(fn), c_fb))
    del q, k, v, go
    torch.cuda.empty_cache()
print("\n| shape | variant | fwd+bwd ms | x cuDNN |")
print("|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[2] / r[3]:.3f} |")
