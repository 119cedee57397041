"""Unfused torch reference of the fused RoPE + layout op (``rope_layout``).

Megatron-core's non-interleaved ``_apply_rotary_pos_emb_bshd`` on [s, b, h, d] views,
followed by the permute + copy into contiguous [b, h, s, d] that the fused kernels need:

    rot = freqs.shape[-1]                 # rot_dim <= d (rotary_percent < 1: rest passes)
    cos, sin = (cos(freqs) * mscale).to(dtype), (sin(freqs) * mscale).to(dtype)
    x_rot = x[..., :rot] * cos + rotate_half(x[..., :rot]) * sin
    rotate_half(x) = cat(-x[..., rot/2:rot], x[..., :rot/2])

The arithmetic happens in the input dtype, exactly as megatron does it, so this function
run on bf16 inputs *is* the eager baseline of the 2x-eager rule and run on fp64 inputs the
reference. No megatron import (ops/ stays megatron-free).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_sbhd(x: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """RoPE on ``x`` [s, b, h, d] with ``freqs`` [s, 1, 1, rot] (megatron's bshd path)."""
    rot = freqs.shape[-1]
    t, t_pass = x[..., :rot], x[..., rot:]
    cos = (torch.cos(freqs) * mscale).to(x.dtype)
    sin = (torch.sin(freqs) * mscale).to(x.dtype)
    t = t * cos + rotate_half(t) * sin
    return torch.cat((t, t_pass), dim=-1)


def rope_layout_naive(
    q: Tensor, k: Tensor, v: Tensor, freqs_q: Optional[Tensor], freqs_k: Optional[Tensor] = None,
    mscale: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """[s, b, h, d] q, k, v (any strides) -> RoPE'd contiguous [b, h, s, d] q, k, v.

    ``freqs_k`` defaults to ``freqs_q``; ``freqs_q=None`` applies no rotation (layout only).
    """
    if freqs_k is None:
        freqs_k = freqs_q
    if freqs_q is not None:
        q = apply_rope_sbhd(q, freqs_q, mscale)
    if freqs_k is not None:
        k = apply_rope_sbhd(k, freqs_k, mscale)
    return tuple(t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))


def rope_layout_qkv_naive(
    mixed_qkv: Tensor, heads_per_group: int, freqs_q: Optional[Tensor], freqs_k: Optional[Tensor] = None,
    mscale: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``rope_layout_naive`` of megatron's split of its QKV buffer [s, b, ng, (p + 2) * d]:
    q, k, v by ``torch.split`` along the last dim into (p * d, d, d), q reshaped to
    [s, b, ng * p, d] -- exactly ``get_query_key_value_tensors``."""
    s, b, ng, w = mixed_qkv.shape
    d = w // (heads_per_group + 2)
    q, k, v = torch.split(mixed_qkv, [heads_per_group * d, d, d], dim=3)
    return rope_layout_naive(q.reshape(s, b, ng * heads_per_group, d), k, v, freqs_q, freqs_k, mscale)
