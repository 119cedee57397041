"""ELSA backward: exact recompute from the saved per-row statistic, via the shared backward.

The forward saves only ``M = m + log2(l)`` per row (fp32 ``[B, Hq, Sq]``, log2 domain,
``+inf`` for rows that see no key). That is the contract of
``nemo_ssa.ops.common.bwd.attention_bwd``, the schedule-independent backward shared
with the flash kernels: it recomputes ``p = 2^(z2 - M)`` tile by tile (no attention matrix,
no online-softmax recurrence) and returns ``dq, dk, dv, dn, db``. ELSA adds nothing of its
own here; this module only wraps that call in a ``torch.library`` custom op (so
``torch.compile`` sees one opaque node) and keeps forward and backward on the same
``lg2.approx`` choice (``fast_log2``): ``p`` is recomputed from ``z2``, so both passes must
round ``z2`` identically.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from nemo_ssa.ops.common.bwd import attention_bwd
from nemo_ssa.ops.common.launch import use_fast_math

__all__ = ["elsa_bwd_op", "fast_log2"]


def fast_log2(device) -> bool:
    """``lg2.approx`` in the SSA transform: the shared backward's default for ``device``."""
    return bool(use_fast_math(torch.device(device)))


@torch.library.custom_op("nemo_ssa::elsa_bwd", mutates_args=())
def elsa_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, n: Optional[torch.Tensor], b: Optional[torch.Tensor],
    transform: int, causal: bool, scale: float, fp32_precision: str, deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dn, db)``; ``dn``/``db`` fp32 ``[1]`` (zeros for softmax).
    ``deterministic``: the two-kernel backward (else the shared backward's own choice)."""
    dq, dk, dv, dn, db = attention_bwd(
        do, q, k, v, o, lse, transform=("softmax", "ssa")[transform], n=n, b=b, causal=causal,
        scale=scale, input_precision=fp32_precision if q.dtype == torch.float32 else None,
        fast_math=fast_log2(q.device), deterministic=True if deterministic else None)
    zero = torch.zeros(1, dtype=torch.float32, device=q.device)
    # match the fake below: dense, contiguous, fresh tensors
    dq, dk, dv = (t if t.is_contiguous() else t.contiguous() for t in (dq, dk, dv))
    return dq, dk, dv, zero if dn is None else dn, zero.clone() if db is None else db


@elsa_bwd_op.register_fake
def _(do, q, k, v, o, lse, n, b, transform, causal, scale, fp32_precision, deterministic):
    one = q.new_empty(1, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), one, one.clone()
