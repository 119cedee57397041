"""The one table of attention implementations: ``(variant, impl) -> function``.

Library code looks functions up here; configs and recipes only choose the names. Add a
row when a new kernel lands; unknown names raise with the list of known pairs, so a typo
in a config fails at build time instead of silently falling back to another attention.

Calling conventions (layout [B, H, S, D], all keyword options as in ``attention_naive``):
    ssa:     fn(q, k, v, n, b, *, causal, softmax_scale, keep_mask, dropout_p)
    softmax: fn(q, k, v, *, causal, softmax_scale, keep_mask, dropout_p)
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from nemo_ssa.ops.softmax.sdpa import softmax_attention_sdpa
from nemo_ssa.ops.ssa.naive import softmax_attention_naive, ssa_attention_naive

__all__ = ["ATTENTION_FNS", "UnknownAttentionError", "available", "get_attention_fn"]

ATTENTION_FNS: Dict[Tuple[str, str], Callable] = {
    ("ssa", "reference"): ssa_attention_naive,
    ("softmax", "reference"): softmax_attention_naive,
    ("softmax", "sdpa"): softmax_attention_sdpa,
}


class UnknownAttentionError(KeyError, ValueError):
    """Unknown ``(variant, impl)``; catchable as either KeyError or ValueError."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def available() -> Tuple[Tuple[str, str], ...]:
    """All registered ``(variant, impl)`` pairs, sorted."""
    return tuple(sorted(ATTENTION_FNS))


def get_attention_fn(variant: str, impl: str = "reference") -> Callable:
    """Return the attention function registered for ``(variant, impl)``.

    Raises:
        UnknownAttentionError (a KeyError and a ValueError) listing the known pairs.
    """
    try:
        return ATTENTION_FNS[(variant, impl)]
    except KeyError:
        known = ", ".join(f"{v}/{i}" for v, i in available())
        raise UnknownAttentionError(
            f"unknown attention (variant={variant!r}, impl={impl!r}); known: {known}"
        ) from None
