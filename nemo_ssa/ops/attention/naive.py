"""Readable torch reference for SSA and softmax attention (the correctness anchor).

Every attention here is a row-wise softmax over *transformed* scores::

    s = (q @ k^T) * softmax_scale                       # [B, Hq, Sq, Sk]
    z = s                                 (softmax)
    z = n * sgn(s) * log1p(b * |s|)       (ssa)       # == log of (1 + b|s|)^(n sgn s)
    z[masked] = -inf                                    # mask z, never s (see README)
    p = softmax(z, dim=-1)                              # fp32 (fp64 for fp64 inputs)
    p = dropout(p)                                      # on probabilities, before @V
    o = p @ v                                           # [B, Hq, Sq, D]

Layout is [B, H, S, D]; k and v may have fewer heads than q (GQA: query head ``h``
uses kv head ``h // (Hq // Hkv)``, i.e. ``repeat_interleave`` on dim 1).

Causal masking is bottom-right aligned (the flash-attn convention): query ``i`` may see
key ``j`` iff ``j <= i + (Sk - Sq)``. With ``Sq == Sk`` this is the usual lower triangle;
with ``Sq < Sk`` the queries are the *last* ``Sq`` positions of the key sequence (decode /
chunked prefill); with ``Sq > Sk`` the first ``Sq - Sk`` query rows see no key at all.
Rows with no visible key return 0 and get zero gradients, never NaN.

Runs on CPU; no fusion, no tricks beyond those needed for finite gradients. The math and
the gradient formulas are in ``README.md`` next to this file.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from nemo_ssa.ops.common.validate import TRANSFORMS, Capabilities, validate_attention_args

__all__ = [
    "ssa_transform",
    "visibility_mask",
    "attention_naive",
    "ssa_attention_naive",
    "softmax_attention_naive",
    "TRANSFORMS",
]

def ssa_transform(s: torch.Tensor, n: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SSA score transform ``z = n * sgn(s) * log1p(b * |s|)`` (elementwise).

    Written as ``sg * log1p(b * (s * sg))`` with ``sg = +1 if s >= 0 else -1`` a constant
    (no autograd edge). The value is identical to the ``sgn`` form (``log1p(0) = 0`` at
    ``s = 0``), but autograd now yields the true derivative ``dz/ds = n*b/(1+b|s|)``
    everywhere, including ``s = 0`` where ``torch.sign``/``torch.abs`` would give 0.
    ``n`` and ``b`` stay in the graph (tensors, never Python floats); ``b >= 0`` assumed.

    Args:
        s: scores, any shape.
        n, b: tensors broadcastable against ``s`` (typically shape ``[1]``).
    Returns:
        ``z`` with the promoted dtype of ``s``, ``n`` and ``b``.
    """
    sg = torch.where(s >= 0, 1.0, -1.0).to(s.dtype)  # constant sign, sgn(0) := +1
    return n * sg * torch.log1p(b * (s * sg))


def visibility_mask(sq: int, sk: int, causal: bool, device=None) -> Optional[torch.Tensor]:
    """Bottom-right-aligned causal mask ``[sq, sk]`` (True = may attend), or None.

    Query ``i`` sees key ``j`` iff ``j <= i + (sk - sq)`` (flash-attn convention).
    Returns None when ``causal`` is False (everything visible).
    """
    if not causal:
        return None
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)


# plain torch: any float dtype, any device (meta included), every option
REFERENCE_CAPS = Capabilities(name="attention_naive")


def _validate(q, k, v, *, transform, n, b, causal, keep_mask, dropout_p, softmax_scale,
              caps: Capabilities = REFERENCE_CAPS) -> None:
    """The shared argument check (``ops.common.validate``) with the reference's capabilities."""
    validate_attention_args(caps, q, k, v, n, b, transform=transform, causal=causal,
                            softmax_scale=softmax_scale, dropout_p=dropout_p, keep_mask=keep_mask)


def _combined_mask(causal, keep_mask, sq, sk, device) -> Optional[torch.Tensor]:
    """AND of the causal visibility and the user mask; None when nothing is masked."""
    mask = visibility_mask(sq, sk, causal, device)
    if keep_mask is not None:
        keep_mask = keep_mask.to(device)
        mask = keep_mask if mask is None else (mask & keep_mask)
    return mask


def attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    transform: str = "ssa",
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference attention: softmax over transformed scores (see module docstring).

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0``.
        transform: ``"ssa"`` or ``"softmax"``.
        n, b: SSA parameters, tensors of shape ``[1]`` (or 0-d), fp32 or fp64; they may
            require grad and stay in the graph. Required for ``"ssa"``, rejected otherwise.
        causal: bottom-right-aligned causal mask (``j <= i + Sk - Sq``).
        softmax_scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        keep_mask: optional bool tensor broadcastable to ``[B, Hq, Sq, Sk]``, True = may
            attend; AND-ed with the causal mask.
        dropout_p: dropout on the probabilities before ``@ v``; uses the current default
            RNG (callers fork Megatron's RNG tracker around the call).
        upcast: True (anchor): everything in fp32, or fp64 when q is fp64. False ("eager
            same-dtype", like Megatron's unfused DotProductAttention with
            ``attention_softmax_in_fp32``): ``q @ k^T`` in q's dtype, transform + softmax
            in fp32, ``p`` cast back to q's dtype, dropout and ``p @ v`` in q's dtype.

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype. Rows without a visible key are exactly 0.
    """
    _validate(q, k, v, transform=transform, n=n, b=b, causal=causal, keep_mask=keep_mask,
              dropout_p=dropout_p, softmax_scale=softmax_scale)
    out_dtype = q.dtype
    bsz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    # fp64 inputs keep fp64 end to end (gradcheck); everything else does softmax in fp32.
    stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if upcast:
        q, k, v = q.to(stat_dtype), k.to(stat_dtype), v.to(stat_dtype)
    if hq != hkv:
        group = hq // hkv
        k = k.repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]; head h -> kv head h // group
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)

    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, Hq, Sq, Sk], in q's (compute) dtype
    s = s.to(stat_dtype)
    if transform == "ssa":
        z = ssa_transform(s, n.to(stat_dtype), b.to(stat_dtype))
    else:
        z = s

    mask = _combined_mask(causal, keep_mask, sq, sk, q.device)
    row_empty = None
    if mask is not None:
        # Mask z, not s: -inf fed into log1p(b|s|) would give dz/dn = -inf and 0 * inf = NaN.
        z = z.masked_fill(~mask, float("-inf"))
        # softmax of an all -inf row is NaN: give rows that see no key finite logits and
        # zero their p below. (The masked_fills alone would already keep the NaN out of the
        # output and the gradients, but only because masked_fill's backward *selects* 0;
        # a multiply-by-mask refactor would leak it. No host sync, so graph friendly.)
        row_empty = ~mask.any(dim=-1, keepdim=True)  # [.., Sq, 1]
        z = z.masked_fill(row_empty, 0.0)
    p = torch.softmax(z, dim=-1)  # [B, Hq, Sq, Sk] in fp32 / fp64
    if row_empty is not None:
        p = p.masked_fill(row_empty, 0.0)

    if not upcast:
        p = p.to(out_dtype)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p, training=True)
    o = torch.matmul(p, v)  # [B, Hq, Sq, D]
    return o.to(out_dtype)


def ssa_attention_naive(q, k, v, n, b, **kw) -> torch.Tensor:
    """SSA reference: ``attention_naive(q, k, v, transform="ssa", n=n, b=b, **kw)``."""
    return attention_naive(q, k, v, transform="ssa", n=n, b=b, **kw)


def softmax_attention_naive(q, k, v, **kw) -> torch.Tensor:
    """Softmax reference: ``attention_naive(q, k, v, transform="softmax", **kw)``."""
    return attention_naive(q, k, v, transform="softmax", **kw)
