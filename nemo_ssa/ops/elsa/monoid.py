"""The (m, l, acc) softmax monoid in torch: merge, identity, finalisation.

A *partial* of attention over a set of keys ``J`` for one query row is the triple::

    m   = max_{j in J} z2_j                      # running max, log2 domain
    l   = sum_{j in J} 2^(z2_j - m)              # normaliser relative to m
    acc = sum_{j in J} 2^(z2_j - m) * v_j        # un-normalised output, [..., D]

with ``z2 = z * log2(e)`` the transformed score in the log2 domain (what the Triton
kernels compute; see ``nemo_ssa/ops/common/transforms.py``). The empty set is the
identity ``(-inf, 0, 0)``. Two partials over disjoint key sets merge with::

    m'   = max(m_a, m_b)
    l'   = l_a * 2^(m_a - m') + l_b * 2^(m_b - m')
    acc' = acc_a * 2^(m_a - m') + acc_b * 2^(m_b - m')

which is associative and commutative (up to rounding) with the identity as neutral
element; the factor ``2^(m_x - m')`` is taken as 0 when ``m_x = -inf`` so that merging two
identities (``-inf - -inf``) never produces NaN. The attention output and the per-row
log2 log-sum-exp saved for backward are ``o = acc / l`` and ``M = m + log2(l)``, with
``o = 0`` and ``M = +inf`` for rows that saw no key (``l = 0``), the convention of
``nemo_ssa.ops.common`` backward kernels (``p = 2^(z2 - M) = 0`` on such rows).

This is the merge that ELSA's phase 2, context-parallel attention (one partial per rank)
and split-K decode need; everything here is plain torch and runs anywhere. The GPU path
is ``nemo_ssa.ops.elsa.merge_finalize_partials(m, l, acc)`` (``scan.py``): ELSA's phase-2
Triton kernel on stacked ``[P, B, H, S(, D)]`` fp32 partials, returning
``finalize_partials(*merge_partials(m, l, acc, dim=0))`` in one pass.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["identity_partial", "combine", "merge_partials", "finalize_partials", "partial_of"]

Partial = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _factor(m_x: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """``2^(m_x - m_new)``, 0 where ``m_x = -inf`` (also when ``m_new = -inf``: no NaN)."""
    empty = m_x == float("-inf")
    diff = torch.where(empty, torch.zeros_like(m_x), m_x - m_new)
    return torch.where(empty, torch.zeros_like(m_x), torch.exp2(diff))


def identity_partial(shape, d: int, dtype=torch.float32, device=None) -> Partial:
    """The neutral element ``(-inf, 0, 0)`` with ``m, l`` of ``shape`` and ``acc`` of ``shape + (d,)``."""
    m = torch.full(tuple(shape), float("-inf"), dtype=dtype, device=device)
    return m, torch.zeros_like(m), torch.zeros(*shape, d, dtype=dtype, device=device)


def combine(a: Partial, b: Partial) -> Partial:
    """Merge two partials (elementwise over rows). ``acc`` has one trailing dim more than ``m``."""
    m_a, l_a, acc_a = a
    m_b, l_b, acc_b = b
    m = torch.maximum(m_a, m_b)
    fa, fb = _factor(m_a, m), _factor(m_b, m)
    return m, l_a * fa + l_b * fb, acc_a * fa.unsqueeze(-1) + acc_b * fb.unsqueeze(-1)


def merge_partials(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, dim: int = 0, keepdim: bool = False
) -> Partial:
    """Merge partials stacked along ``dim`` into one (the monoid product over that axis).

    Uses the closed form of the fold: with ``m* = max_p m_p`` every pairwise merge order
    gives ``l* = sum_p l_p 2^(m_p - m*)`` and ``acc* = sum_p acc_p 2^(m_p - m*)``, so no
    sequential rescaling is needed. Identities (``m_p = -inf``) contribute 0; if every
    partial is the identity the result is the identity, never NaN.

    Args:
        m, l: ``[..., P, ...]`` fp32/fp64, partition axis ``dim`` (an axis of ``m``).
        acc: ``m.shape + (D,)``.
        dim: the partition axis (negative values count from the end of ``m``'s shape).
        keepdim: keep the merged axis with size 1.

    Returns:
        ``(m, l, acc)`` with axis ``dim`` reduced.
    """
    if m.shape != l.shape or acc.shape[:-1] != m.shape:
        raise ValueError(
            f"merge_partials needs m, l of one shape and acc = that shape + (D,); got "
            f"m {tuple(m.shape)}, l {tuple(l.shape)}, acc {tuple(acc.shape)}"
        )
    dim = dim % m.dim()
    m_star = m.amax(dim=dim, keepdim=True)
    f = _factor(m, m_star)
    l_out = (l * f).sum(dim=dim, keepdim=keepdim)
    acc_out = (acc * f.unsqueeze(-1)).sum(dim=dim, keepdim=keepdim)
    return (m_star if keepdim else m_star.squeeze(dim)), l_out, acc_out


def finalize_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(o, M) = (acc / l, m + log2 l)``; rows with ``l = 0`` give ``o = 0`` and ``M = +inf``."""
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    o = acc / l_safe.unsqueeze(-1)
    lse2 = torch.where(empty, torch.full_like(m, float("inf")), m + torch.log2(l_safe))
    return o, lse2


def partial_of(z2: torch.Tensor, v: torch.Tensor) -> Partial:
    """Partial of one key set directly from scores (reference for tests).

    Args:
        z2: ``[..., Sq, J]`` log2-domain transformed scores, ``-inf`` = masked.
        v: ``[..., J, D]`` values.
    Returns:
        ``(m [..., Sq], l [..., Sq], acc [..., Sq, D])``; identity on rows with no key.
    """
    m = z2.amax(dim=-1)
    safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w = torch.exp2(z2 - safe.unsqueeze(-1))  # exp2(-inf) = 0 on masked keys
    return m, w.sum(-1), w @ v.to(w.dtype)
