"""Tolerance helpers and input factories shared by tests and benchmarks (torch only).

The tolerance rule (flash-attention's): a kernel's error against an fp32/fp64 reference
may be at most twice the error of the *eager same-dtype* implementation against that same
reference (``attention_naive(..., upcast=False)``), plus a small absolute floor for the
case where eager happens to be exact. Errors are relative Frobenius norms in float64.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

__all__ = ["rel_err", "make_qkv", "case_id", "poison_", "assert_within_2x_eager", "DTYPE_NAMES"]

DTYPE_NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` computed in float64.

    When ``ref`` is exactly zero the absolute error ``||x||`` is returned instead (so
    two zero tensors give 0.0, and anything else is measured as-is). NaN/Inf anywhere in
    ``x`` gives NaN/Inf, which fails every ``<=`` comparison.
    """
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs ref {tuple(ref.shape)}")
    x64 = x.detach().to(torch.float64)
    r64 = ref.detach().to(torch.float64)
    num = torch.linalg.vector_norm(x64 - r64).item()
    den = torch.linalg.vector_norm(r64).item()
    return num if den == 0.0 else num / den


def make_qkv(
    B: int,
    Hq: int,
    Hkv: int,
    Sq: int,
    Sk: int,
    D: int,
    dtype: torch.dtype,
    device="cpu",
    seed: Optional[int] = None,
    requires_grad: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal ``q [B,Hq,Sq,D]``, ``k, v [B,Hkv,Sk,D]`` (leaf tensors).

    ``seed=None`` draws from the default RNG (fresh inputs per call); an int uses a private
    generator so the global RNG is untouched. Sampled in fp32, then cast to ``dtype``.
    """
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(int(seed))

    def one(h: int, s: int) -> torch.Tensor:
        t = torch.randn(B, h, s, D, generator=gen, dtype=torch.float32)
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    return one(Hq, Sq), one(Hkv, Sk), one(Hkv, Sk)


def case_id(B, Sq, Hq, Hkv, D, causal, dtype, Sk: Optional[int] = None) -> str:
    """Readable pytest id, e.g. ``B2-T63-HQ6-HKV2-D32-causal-fp32``.

    ``Sk`` (optional) is shown as ``-TK{Sk}`` after ``T{Sq}`` when it differs from ``Sq``.
    """
    t = f"T{Sq}" if Sk is None or Sk == Sq else f"T{Sq}-TK{Sk}"
    dname = DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    return f"B{B}-{t}-HQ{Hq}-HKV{Hkv}-D{D}-{'causal' if causal else 'full'}-{dname}"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a floating tensor with NaN in place (catches outputs a kernel never writes)."""
    if not t.is_floating_point():
        raise ValueError(f"poison_ needs a floating tensor, got {t.dtype}")
    with torch.no_grad():
        t.fill_(math.nan)
    return t


def assert_within_2x_eager(
    out: torch.Tensor,
    eager: torch.Tensor,
    ref: torch.Tensor,
    name: str = "out",
    floor: float = 1e-5,
    factor: float = 2.0,
) -> Dict[str, float]:
    """Assert ``rel_err(out, ref) <= factor * rel_err(eager, ref) + floor``.

    Args:
        out: the implementation under test (e.g. a fused kernel's output or a gradient).
        eager: the eager same-dtype implementation's result for the same inputs.
        ref: the fp32/fp64 anchor.
        name: what is compared (shows up in the failure message).
        floor: absolute slack on the relative error (eager can be exact by luck).
        factor: 2.0 is the rule; benchmarks may report with other factors.

    Returns:
        ``{"err": ..., "eager_err": ..., "bound": ...}`` for logging.
    """
    err = rel_err(out, ref)
    eager_err = rel_err(eager, ref)
    bound = factor * eager_err + floor
    ok = math.isfinite(err) and err <= bound
    if not ok:
        raise AssertionError(
            f"{name}: rel err {err:.3e} > {factor:g} x eager rel err {eager_err:.3e} "
            f"+ floor {floor:.1e} (= {bound:.3e})"
        )
    return {"err": err, "eager_err": eager_err, "bound": bound}
