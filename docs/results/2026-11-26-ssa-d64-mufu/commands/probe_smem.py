"""Issue 28 (probe_fold.py's harness, SSA D64 only): the pipelined backward's previous-block
operands from shared memory (smem_ops 1: dS^T, 2: dS^T and P^T) instead of registers carried
across the loop (the MOVs), with the folded reciprocal. Below, probe_fold.py's description:
the Gluon backward with SSA's 1/t folded into the exp2 (fold_rcp: P/t = exp2(z - M
- log2 t), P = (P/t) t -- two MUFU operations per score instead of three) and with dq scaled in
the cast (dq_late), and the D64 SSA forward with 128-key blocks; fwd+bwd ms and x SDPA cuDNN in
the same process, gradients against the table's (relative L2)."""
import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.attention.hopper as Hf
import nemo_ssa.ops.common.hopper_bwd as H
from nemo_ssa.ops.attention.flash import softmax_attention_triton, ssa_attention_triton

F, G = Hf.GluonFwdConfig, H.GluonBwdConfig
SAVED_F, SAVED_B = dict(Hf.GLUON_FWD), dict(H.GLUON_BWD)
SHAPES = [("D64 B2 N8192", 2, 16, 8192, 64), ("D64 B8 N4096", 8, 16, 4096, 64)]


def bench(f):
    f()
    torch.cuda.synchronize()
    return triton.testing.do_bench(f, rep=300, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def variants(D, tr):
    base = SAVED_B[(D, tr)]
    f128 = SAVED_F[(64, "ssa")]._replace(block_n=128, stages=2)
    return {"table": (None, base), "fold": (None, base._replace(fold_rcp=1)),
            "fold, dS from smem": (None, base._replace(fold_rcp=1, smem_ops=1)),
            "fold, dS and P from smem": (None, base._replace(fold_rcp=1, smem_ops=2)),
            "dS from smem": (None, base._replace(smem_ops=1)),
            "fold, dS from smem, fwd BN128": (f128, base._replace(fold_rcp=1, smem_ops=1)),
            "table (again)": (None, base)}


rows = []
for label, Bz, Hh, N, D in SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16)
    n = torch.tensor([1.5], device="cuda", requires_grad=True)
    b = torch.tensor([0.8], device="cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        c_fb = bench(lambda: torch.autograd.grad(sd(), [q, k, v], go))
    for tr in ("ssa",):
        if tr == "ssa":
            leaves = [q, k, v, n]
            fn = lambda: torch.autograd.grad(ssa_attention_triton(q, k, v, n, b, causal=True), leaves, go)  # noqa: E731
        else:
            leaves = [q, k, v]
            fn = lambda: torch.autograd.grad(softmax_attention_triton(q, k, v, causal=True), leaves, go)  # noqa: E731
        ref = None
        for name, (fcfg, bcfg) in variants(D, tr).items():
            Hf.GLUON_FWD.clear()
            Hf.GLUON_FWD.update(SAVED_F)
            if fcfg is not None:
                Hf.GLUON_FWD[(D, tr)] = fcfg
            H.GLUON_BWD[(D, tr)] = bcfg
            g = fn()
            ref = g if ref is None else ref
            t = bench(fn)
            err = " ".join(f"{x}{rel(a, r):.1e}" for x, a, r in zip("qkvn", g, ref))
            rows.append((label, tr, name, t, t / c_fb, err))
            print(rows[-1], flush=True)
        H.GLUON_BWD.clear()
        H.GLUON_BWD.update(SAVED_B)
        Hf.GLUON_FWD.clear()
        Hf.GLUON_FWD.update(SAVED_F)
    rows.append((label, "cuDNN", "", c_fb, 1.0, ""))
    del q, k, v, go
    torch.cuda.empty_cache()

print("\n| shape | transform | variant | fwd+bwd ms | x cuDNN | grads vs the table's |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]} |")
