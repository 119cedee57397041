"""Output allocation for every kernel launcher: ``torch.empty`` that can be NaN-poisoned.

With ``NEMO_SSA_POISON=1`` (``env.poison_outputs``, read at import) or ``POISON_OUTPUTS``
set by a test, every output is NaN-filled, so an element a kernel forgets to write shows up
as NaN instead of stale memory.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_ssa.ops.common import env

__all__ = ["POISON_OUTPUTS", "new_output", "new_output_like", "new_cstat"]

POISON_OUTPUTS: bool = env.poison_outputs()


def new_output_like(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.empty_like`` (same memory order for dense views), NaN-filled if poisoning."""
    out = torch.empty_like(t, dtype=dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, NaN-filled if poisoning."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def new_cstat(M: torch.Tensor) -> torch.Tensor:
    """The fp32 row statistic ``C`` a forward writes for the single-pass backward's ``dn``
    (``M``'s shape and layout)."""
    return new_output_like(M)

