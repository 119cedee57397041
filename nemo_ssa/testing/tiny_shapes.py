"""Every public attention op at tiny sequence lengths (N = 1, 2, 3, 15, 17): one case runs
forward and backward and is compared against the fp32 (fp64 for fp32 inputs) reference.

A length-1 sequence is ordinary (a packed document of one token, a one-token prompt), and
Triton compiles a separate kernel for every int argument equal to 1 (and for multiples of
16), so these shapes reach compiler paths the usual sizes never do. Output and dq/dk/dv
must be finite and within 2x the eager same-dtype error (+1e-5). Used by
``benchmarks/checks/tiny_shapes.py`` (the sweep) and tests/ops/test_tiny_shapes_gpu.py.
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Tuple

import torch

from nemo_ssa.testing import rel_err

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ("flash", "varlen", "elsa", "nsa", "flex")


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def _check(got: List[torch.Tensor], eager: List[torch.Tensor], ref: List[torch.Tensor], names: List[str],
           floor: float = 1e-5) -> str:
    """'' when every tensor is finite and within 2x eager (+ ``floor``) of the reference."""
    for name, g, e, r in zip(names, got, eager, ref):
        if g.shape != r.shape:
            return f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        if not torch.isfinite(g).all():
            return f"{name}: non-finite"
        err, bound = rel_err(g, r), 2 * rel_err(e, r) + floor
        if err > bound:
            return f"{name}: rel err {err:.2e} > {bound:.2e}"
    return ""


def _fwd_bwd(fn: Callable, leaves: List[torch.Tensor], go: torch.Tensor) -> List[torch.Tensor]:
    o = fn(*leaves)
    return [o] + list(torch.autograd.grad(o, leaves[:3], go))


def cases(ops, lengths, dtypes, dims) -> List[Tuple]:
    out = []
    for op in ops:
        for dt in dtypes:
            if op in ("nsa", "flex") and dt == "fp32":
                continue
            for D in dims:
                for N in lengths:
                    for tr in ("ssa", "softmax"):
                        if op == "flex" and tr == "softmax":
                            continue
                        for causal in ((True,) if op == "nsa" else (True, False)):
                            for hq, hkv in ((8, 4), (4, 4)):
                                if op in ("varlen", "nsa", "flex") and hkv == hq:
                                    continue  # GQA only: the MHA path is the same kernel
                                out.append((op, dt, D, N, tr, causal, hq, hkv))
    return out


def run_case(op, dt, D, N, tr, causal, hq, hkv, dev) -> Tuple[str, str]:
    """(status, why): ``("ok", "")``, ``("WRONG", what)`` or ``("ERROR", exception line)``
    for one case (``N = 0`` with ``op="varlen"`` packs the lengths 1, 2, 3, 15, 17)."""
    from nemo_ssa.ops.attention.naive import attention_naive

    dtype = DTYPES[dt]
    B = 2
    n = torch.tensor([1.5], device=dev)
    b = torch.tensor([0.8], device=dev)
    kw_t = dict(transform=tr, n=n, b=b) if tr == "ssa" else dict(transform=tr)
    if op == "varlen":
        lens = [1, 2, 3, 15, 17] if N == 0 else [N, max(1, N - 1), N]
        T = sum(lens)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), device=dev, dtype=torch.int32)
        q = torch.randn(T, hq, D, device=dev).to(dtype)
        k = torch.randn(T, hkv, D, device=dev).to(dtype)
        v = torch.randn(T, hkv, D, device=dev).to(dtype)
        go = torch.randn(T, hq, D, device=dev).to(dtype)
        from nemo_ssa.ops.attention.flash import flash_attention_varlen

        def fused(q, k, v):
            return flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, **kw_t)

        def naive(q, k, v, upcast=True):
            outs = []
            for i in range(len(lens)):
                s = slice(int(cu[i]), int(cu[i + 1]))
                one = lambda t: t[s].transpose(0, 1)[None]  # noqa: E731
                outs.append(attention_naive(one(q), one(k), one(v), causal=causal, upcast=upcast,
                                            **kw_t)[0].transpose(0, 1))
            return torch.cat(outs, 0)
    else:
        q = torch.randn(B, hq, N, D, device=dev).to(dtype)
        k = torch.randn(B, hkv, N, D, device=dev).to(dtype)
        v = torch.randn(B, hkv, N, D, device=dev).to(dtype)
        go = torch.randn(B, hq, N, D, device=dev).to(dtype)

        def naive(q, k, v, upcast=True):
            return attention_naive(q, k, v, causal=causal, upcast=upcast, **kw_t)

        if op == "flash":
            from nemo_ssa.ops.attention.flash import flash_attention

            def fused(q, k, v):
                return flash_attention(q, k, v, causal=causal, **kw_t)
        elif op == "elsa":
            from nemo_ssa.ops.elsa import elsa_attention

            def fused(q, k, v):
                return elsa_attention(q, k, v, causal=causal, **kw_t)
        elif op == "flex":
            from nemo_ssa.ops.attention.flex import ssa_attention_flex

            def fused(q, k, v):
                return ssa_attention_flex(q, k, v, n, b, causal=causal)
        elif op == "nsa":
            from nemo_ssa.ops.nsa import NSAConfig, nsa_attention, nsa_attention_naive

            cfg = NSAConfig(compress="mean")
            gates = torch.randn(B, hq, N, 3, device=dev).to(dtype)
            # one selection for all three (the fp32 reference's): a bf16 near-tie must not
            # flip a block between the kernel and its references
            _, aux = nsa_attention_naive(q.float(), k.float(), v.float(), gates.float(), cfg, **kw_t,
                                         return_aux=True)
            idx = aux["block_idx"]

            def fused(q, k, v):
                return nsa_attention(q, k, v, gates, cfg, **kw_t, block_idx=idx)

            def naive(q, k, v, upcast=True):
                g = gates.to(q.dtype) if upcast else gates
                return nsa_attention_naive(q, k, v, g, cfg, **kw_t, upcast=upcast, block_idx=idx)
        else:
            raise ValueError(op)
    leaves = [_leaf(t) for t in (q, k, v)]
    try:
        got = _fwd_bwd(fused, leaves, go)
        torch.cuda.synchronize() if dev == "cuda" else None
    except Exception as e:  # noqa: BLE001 -- the report is the point
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return "ERROR", f"{type(e).__name__}: {first}"
    ref = _fwd_bwd(lambda *a: naive(*a, upcast=True), [_leaf(t, torch.float32) for t in (q, k, v)], go.float())
    if dtype == torch.float32:
        ref64 = _fwd_bwd(lambda *a: naive(*a, upcast=True), [_leaf(t, torch.float64) for t in (q, k, v)],
                         go.double()) if op != "nsa" else ref
        eager, ref = ref, ref64
    else:
        eager = _fwd_bwd(lambda *a: naive(*a, upcast=False), [_leaf(t) for t in (q, k, v)], go)
    # NSA's dq sums three branches' bf16-rounded gradients: the floor of its GPU tests
    msg = _check(got, eager, ref, ["o", "dq", "dk", "dv"], floor=1e-4 if op == "nsa" else 1e-5)
    return ("ok", "") if not msg else ("WRONG", msg)


