"""Issue 28: the warp-specialised Gluon backward at D64 with one consumer warpgroup per
program (64-key blocks, two programs per SM) against the Triton backward, SSA and softmax;
fwd+bwd ms with SDPA cuDNN in the same process, gradients of each variant against the
Triton path (rel. err)."""
import os

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.common.hopper_bwd as H
from nemo_ssa.ops.attention.flash import softmax_attention_triton, ssa_attention_triton

G = H.GluonBwdConfig
SHAPES = [("D64", 2, 16, 8192, 64), ("D64 B8", 8, 16, 4096, 64)]
CFGS = [("w8s2", G(64, 8, 2, 168)), ("w4s2", G(64, 4, 2, 168)), ("w4s3", G(64, 4, 3, 168)), ("w4s4", G(64, 4, 4, 168))]
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


table = []
for label, B, Hh, N, D in SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, Hh, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(B, Hh, N, D, device=dev, dtype=torch.bfloat16)
    n = torch.tensor([1.5], device=dev, requires_grad=True)
    b = torch.tensor([0.8], device=dev)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v], go)
    for tr in ("ssa", "softmax"):
        if tr == "ssa":
            fn, leaves = (lambda: ssa_attention_triton(q, k, v, n, b, causal=True)), [q, k, v, n]
        else:
            fn, leaves = (lambda: softmax_attention_triton(q, k, v, causal=True)), [q, k, v]
        base = bench(fn, leaves, go)
        ref = grads(fn, leaves, go)
        row = dict(shape=label, tr=tr, cudnn=cudnn, triton=base)
        for name, cfg in CFGS:
            H.GLUON_BWD[(64, tr)] = cfg
            try:
                row[name] = bench(fn, leaves, go)
                g = grads(fn, leaves, go)
                row[name + "_err"] = " ".join(f"{x}{rel(a, r):.1e}" for x, a, r in zip("qkvn", g, ref))
            except Exception as e:
                row[name] = float("nan")
                row[name + "_err"] = f"{type(e).__name__}: {str(e)[:160]}"
            finally:
                H.GLUON_BWD.pop((64, tr), None)
        print(row, flush=True)
        table.append(row)
    del q, k, v, go
    torch.cuda.empty_cache()

print("\n| shape | transform | cuDNN ms | Triton bwd (× cuDNN) | " + " | ".join(n for n, _ in CFGS) + " |")
print("|---|---|---|---|" + "---|" * len(CFGS))
for r in table:
    c = r["cudnn"]
    cells = [f"{r[n]:.3f} ({r[n] / c:.2f})" for n, _ in CFGS]
    print(f"| {r['shape']} | {r['tr']} | {c:.3f} | {r['triton']:.3f} ({r['triton'] / c:.2f}) | " + " | ".join(cells) + " |")
