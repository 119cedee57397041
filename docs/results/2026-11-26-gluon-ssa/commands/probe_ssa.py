"""Issue 28: SSA through the warp-specialised Gluon single pass. Per shape: fwd+bwd of
ssa_triton with the Gluon kernels off (NEMO_SSA_GLUON=0), on (package tables), and at D64
with the Gluon backward patched into the table (stages 2 / 3); softmax_triton and SDPA cuDNN
in the same process. Gradients of every Gluon variant against the Triton path (rel. err)."""
import os
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.common.hopper_bwd as H
from nemo_ssa.ops.attention.flash import softmax_attention_triton, ssa_attention_triton

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


rows = []
for label, B, Hh, N, D in SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, Hh, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(B, Hh, N, D, device=dev, dtype=torch.bfloat16)
    n = torch.tensor([1.5], device=dev, requires_grad=True)
    b = torch.tensor([0.8], device=dev)
    leaves = [q, k, v, n]
    ssa = lambda: ssa_attention_triton(q, k, v, n, b, causal=True)  # noqa: E731
    res = {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["cudnn"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                             [q, k, v], go)
    res["softmax"] = bench(lambda: softmax_attention_triton(q, k, v, causal=True), [q, k, v], go)
    os.environ["NEMO_SSA_GLUON"] = "0"
    res["ssa_triton_only"] = bench(ssa, leaves, go)
    ref = grads(ssa, leaves, go)
    os.environ["NEMO_SSA_GLUON"] = "1"
    variants = [("ssa_pkg", None)]
    if D == 64:
        variants += [("ssa_gbwd64_s2", H.GluonBwdConfig(64, 8, 2, 168)), ("ssa_gbwd64_s3", H.GluonBwdConfig(64, 8, 3, 168))]
    for name, cfg in variants:
        if cfg is not None:
            H.GLUON_BWD[(64, "ssa")] = cfg
        try:
            res[name] = bench(ssa, leaves, go)
            g = grads(ssa, leaves, go)
            res[name + "_err"] = " ".join(f"{nm}{rel(x, y):.1e}" for nm, x, y in zip(("q", "k", "v", "n"), g, ref))
        except Exception as e:
            res[name] = float("nan")
            res[name + "_err"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            H.GLUON_BWD.pop((64, "ssa"), None)
    rows.append((label, res))
    print(label, res, flush=True)
    del q, k, v, go
    torch.cuda.empty_cache()

print("\n| shape | cudnn ms | softmax × | ssa Triton-only × | ssa package × | D64 Gluon bwd s2 × | s3 × |")
print("|---|---|---|---|---|---|---|")
for label, r in rows:
    c = r["cudnn"]
    f = lambda key: f"{r[key]:.3f} ({r[key] / c:.2f})" if key in r else "-"  # noqa: E731
    print(f"| {label} | {c:.3f} | {f('softmax')} | {f('ssa_triton_only')} | {f('ssa_pkg')} | {f('ssa_gbwd64_s2')} | {f('ssa_gbwd64_s3')} |")
for label, r in rows:
    print(label, {k: v for k, v in r.items() if k.endswith("_err")})
