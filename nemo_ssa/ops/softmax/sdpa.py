"""Softmax attention through ``torch.nn.functional.scaled_dot_product_attention``.

The baseline every SSA kernel is timed against: on GPU, SDPA dispatches to flash /
cuDNN / memory-efficient kernels; on CPU it runs the math backend. Same semantics as
``softmax_attention_naive`` (layout [B, H, S, D], GQA, bottom-right causal, keep_mask,
rows without a visible key -> 0), with two dispatch rules that keep flash usable:

* causal with ``Sq == Sk`` and no ``keep_mask`` -> ``is_causal=True`` (no mask tensor; for
  square shapes top-left and bottom-right alignment coincide);
* ``Sq != Sk`` causal, or any ``keep_mask`` -> an explicit boolean ``attn_mask`` built with
  the bottom-right convention (SDPA's own ``is_causal`` is top-left aligned for
  ``Sq != Sk``, which is why it is not used there).

On the explicit-mask path a row without any visible key would make SDPA return NaN (or
backend-dependent garbage), so such rows are unmasked before the call and their output is
zeroed afterwards: output 0, gradients 0, never NaN. GQA uses ``enable_gqa=True``.
Dropout uses SDPA's own RNG stream, so it matches the reference in distribution only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nemo_ssa.ops.common.validate import Capabilities
from nemo_ssa.ops.attention.naive import _combined_mask, _validate

__all__ = ["softmax_attention_sdpa"]

SDPA_CAPS = Capabilities(name="softmax_attention_sdpa", transforms=("softmax",))


def softmax_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention via SDPA.

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0``.
        causal: bottom-right-aligned causal mask (``j <= i + Sk - Sq``).
        softmax_scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        keep_mask: optional bool tensor broadcastable to ``[B, Hq, Sq, Sk]``, True = may
            attend; AND-ed with the causal mask.
        dropout_p: attention-probability dropout (SDPA's RNG).
        n, b: must be None (accepted only to refuse them with a ValueError, like every
            softmax attention of the registry: they are SSA parameters).

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype; rows without a visible key are 0.
    """
    _validate(q, k, v, transform="softmax", n=n, b=b, causal=causal, keep_mask=keep_mask,
              dropout_p=dropout_p, softmax_scale=softmax_scale, caps=SDPA_CAPS)
    hq, sq = q.shape[1], q.shape[2]
    hkv, sk = k.shape[1], k.shape[2]
    kw = dict(dropout_p=float(dropout_p), scale=softmax_scale)
    if hq != hkv:
        kw["enable_gqa"] = True  # only when needed: not every backend takes the flag

    if keep_mask is None and (not causal or sq == sk):
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), **kw)

    mask = _combined_mask(causal, keep_mask, sq, sk, q.device)  # bool, broadcastable
    row_empty = ~mask.any(dim=-1, keepdim=True)  # [.., Sq, 1]
    mask = mask | row_empty  # give empty rows something finite to average ...
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    return o.masked_fill(row_empty, 0.0)  # ... and drop it: output 0, gradient 0
