"""Issue 28: the warp-specialised Gluon backward, software-pipelined consumers (a block's
score gradients computed while the previous block's dV, dK, dQ products run) against the
unpipelined kernel and the Triton backward; softmax and SSA (n learnable: the forward writes C
and the kernel the dn partials), D128 and D64. fwd+bwd ms, SDPA cuDNN in the same process;
gradients of each variant against the Triton backward (rel. err)."""
import os
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.common.bwd as B
import nemo_ssa.ops.common.hopper_bwd as H
from nemo_ssa.ops.attention.flash import softmax_attention_triton, ssa_attention_triton

NEW_LAUNCH = B.launch_gluon_bwd


G = H.GluonBwdConfig
SHAPES = [("D128", 2, 8, 8192, 128), ("D128 B8", 8, 8, 4096, 128), ("D64", 2, 16, 8192, 64), ("D64 B8", 8, 16, 4096, 64)]
dev = "cuda"


def bench(fn, leaves, go):
    def fb():
        fn().backward(go)
    fb()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fb, rep=200, grad_to_none=leaves, return_mode="median")


def grads(fn, leaves, go):
    for t in leaves:
        t.grad = None
    fn().backward(go)
    out = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


VARIANTS = {"ws": G(64, 8, 2, 168), "pp2": G(64, 8, 2, 168, 1), "pp3": G(64, 8, 3, 168, 1)}


def variant(tr, D, name):
    """Set the table for one variant."""
    H.GLUON_BWD.clear()
    if name != "triton":
        H.GLUON_BWD[(D, tr)] = VARIANTS[name]


SAVED = dict(H.GLUON_BWD)
table = []
for label, Bz, Hh, N, D in SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(Bz, Hh, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(Bz, Hh, N, D, device=dev, dtype=torch.bfloat16)
    n = torch.tensor([1.5], device=dev, requires_grad=True)
    b = torch.tensor([0.8], device=dev)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v], go)
    for tr in ("softmax", "ssa"):
        if tr == "ssa":
            fn, leaves = (lambda: ssa_attention_triton(q, k, v, n, b, causal=True)), [q, k, v, n]
        else:
            fn, leaves = (lambda: softmax_attention_triton(q, k, v, causal=True)), [q, k, v]
        row = dict(shape=label, tr=tr, cudnn=cudnn)
        names = ["triton", "ws", "pp2"] + (["pp3"] if D == 64 else [])
        ref = None
        for name in names:
            variant(tr, D, name)
            try:
                row[name] = bench(fn, leaves, go)
                g = grads(fn, leaves, go)
                if ref is None:
                    ref = g
                else:
                    row[name + "_err"] = " ".join(f"{x}{rel(a, r):.1e}" for x, a, r in zip("qkvn", g, ref))
            except Exception as e:
                row[name] = float("nan")
                row[name + "_err"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(row, flush=True)
        table.append(row)
    del q, k, v, go
    torch.cuda.empty_cache()
H.GLUON_BWD.clear()
H.GLUON_BWD.update(SAVED)

print("\n| shape | transform | cuDNN ms | Triton bwd | WS | WS pipelined, 2 stages | 3 stages |")
print("|---|---|---|---|---|---|---|")
for r in table:
    c = r["cudnn"]
    cell = lambda k: f"{r[k]:.3f} ({r[k] / c:.2f})" if k in r else "-"  # noqa: E731
    print(f"| {r['shape']} | {r['tr']} | {c:.3f} | {cell('triton')} | {cell('ws')} | {cell('pp2')} | {cell('pp3')} |")
for r in table:
    print(r["shape"], r["tr"], {k: v for k, v in r.items() if k.endswith("_err")})
