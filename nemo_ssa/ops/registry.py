"""The one table of attention implementations: ``(variant, impl) -> function``.

Library code looks functions up here; configs and recipes only choose the names. Add a
row when a new kernel lands; unknown names raise with the list of known pairs, so a typo
in a config fails at build time instead of silently falling back to another attention.

Calling conventions (layout [B, H, S, D], all keyword options as in ``attention_naive``):
    ssa:     fn(q, k, v, n, b, *, causal, softmax_scale, keep_mask, dropout_p)
    softmax: fn(q, k, v, *, causal, softmax_scale, keep_mask, dropout_p)
    nsa:     fn(q, k, v, gate_logits, config, *, k_slc, v_slc, k_win, v_win, phi_k, phi_v,
                transform, n, b, softmax_scale, block_idx, return_aux, ...)
             (``nsa_attention``; the score transform is an argument, not the variant)
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple, Union

__all__ = ["ATTENTION_FNS", "UnknownAttentionError", "available", "get_attention_fn"]

#: ``"module:function"`` strings are imported on first use, so picking the reference never
#: imports (or JIT-compiles) Triton kernels, and ``TRITON_INTERPRET`` set by a test
#: session before the first use still takes effect.
ATTENTION_FNS: Dict[Tuple[str, str], Union[str, Callable]] = {
    ("ssa", "reference"): "nemo_ssa.ops.attention.naive:ssa_attention_naive",
    ("softmax", "reference"): "nemo_ssa.ops.attention.naive:softmax_attention_naive",
    ("softmax", "sdpa"): "nemo_ssa.ops.softmax.sdpa:softmax_attention_sdpa",
    ("ssa", "triton"): "nemo_ssa.ops.attention.flash:ssa_attention_triton",
    ("softmax", "triton"): "nemo_ssa.ops.attention.flash:softmax_attention_triton",
    ("ssa", "triton_varlen"): "nemo_ssa.ops.attention.flash:ssa_attention_triton_varlen",
    ("softmax", "triton_varlen"): "nemo_ssa.ops.attention.flash:softmax_attention_triton_varlen",
    ("ssa", "flex"): "nemo_ssa.ops.attention.flex:ssa_attention_flex",
    ("softmax", "elsa"): "nemo_ssa.ops.elsa.scan:elsa_softmax_attention",
    ("ssa", "elsa"): "nemo_ssa.ops.elsa.scan:elsa_ssa_attention",
    # each stage Triton or torch, chosen by the function's own ``impl`` argument
    ("nsa", "staged"): "nemo_ssa.ops.nsa.layer:nsa_attention",
    ("nsa", "reference"): "nemo_ssa.ops.nsa.naive:nsa_attention_naive",
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
        fn = ATTENTION_FNS[(variant, impl)]
    except KeyError:
        known = ", ".join(f"{v}/{i}" for v, i in available())
        raise UnknownAttentionError(
            f"unknown attention (variant={variant!r}, impl={impl!r}); known: {known}"
        ) from None
    if isinstance(fn, str):
        module, name = fn.split(":")
        fn = getattr(importlib.import_module(module), name)
        ATTENTION_FNS[(variant, impl)] = fn
    return fn
