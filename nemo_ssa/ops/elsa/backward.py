"""ELSA backward: exact recompute from the saved per-row statistic, via the shared backward.

The forward saves only ``M = m + log2(l)`` per row (fp32 ``[B, Hq, Sq]``, log2 domain,
``+inf`` for rows that see no key). That is the contract of
``nemo_ssa.ops.common.bwd.attention_bwd``, the schedule-independent backward shared
with the flash kernels: it recomputes ``p = 2^(z2 - M)`` tile by tile (no attention
matrix, no online-softmax recurrence) and returns ``dq, dk, dv, dn, db``. ELSA adds
nothing of its own here: it calls the shared custom op ``nemo_ssa::attention_bwd`` (one
opaque node for ``torch.compile``, the same node the flash forward's backward uses) and
keeps forward and backward on the same ``lg2.approx`` choice (``target.use_fast_math``): ``p`` is
recomputed from ``z2``, so both passes must round ``z2`` identically.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from nemo_ssa.ops.common.bwd import attention_bwd_op  # noqa: F401 -- registers nemo_ssa::attention_bwd
from nemo_ssa.ops.common.dispatch import SINGLE, TWO_KERNEL, backward_plan, note
from nemo_ssa.ops.common.launch import default_input_precision
from nemo_ssa.ops.common.target import use_fast_math
from nemo_ssa.ops.common.transforms import log2_mode

__all__ = ["elsa_bwd"]


def elsa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, n: Optional[torch.Tensor], b: Optional[torch.Tensor], transform: str,
             causal: bool, scale: float, fp32_precision: str, deterministic: bool,
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dn, db)`` through the shared backward op ``nemo_ssa::attention_bwd``;
    ``dn``/``db`` fp32 ``[1]`` (zeros for softmax). ``deterministic``: the two-kernel
    backward (else ``dispatch.backward_plan``'s choice, the flash kernels' for the shape)."""
    fast = use_fast_math(q.device)
    if transform == "ssa" and not deterministic:
        # the single pass takes dn from the forward's row means C, which the scan does not write:
        # said as such, not as the flash kernels' "single-pass" that could not run
        key = ("attention.bwd", transform, f"D{q.shape[-1]}", q.dtype, "elsa", "causal" if causal else "full")
        det = note(key, "attention.bwd", TWO_KERNEL, "ELSA's forward writes no row means C, which the "
                                                    "single pass's dn needs").path != SINGLE
    else:  # the same decision as the flash kernels' for this shape (ops.common.dispatch)
        det = backward_plan(transform, q, k, v, varlen=False, dropout=False,
                            fast_log2=log2_mode(fast) if transform == "ssa" else 1,
                            scores=q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2], causal=causal,
                            deterministic=deterministic).path != SINGLE
    prec = fp32_precision if q.dtype == torch.float32 else default_input_precision(q.dtype)
    dq, dk, dv, dn, db = torch.ops.nemo_ssa.attention_bwd(
        do, q, k, v, o, lse, n, b, None, None, None, transform, causal, scale, 0.0,
        q.shape[2], k.shape[2], prec, fast, transform == "ssa", True, None, det)
    # match the forward's fake: dense, contiguous tensors
    dq, dk, dv = (t if t.is_contiguous() else t.contiguous() for t in (dq, dk, dv))
    return dq, dk, dv, dn, db
