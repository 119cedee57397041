"""Fused RoPE + layout: megatron's [s, b, h, d] views in, contiguous [b, h, s, d] out.

One Triton launch per tensor reads q (k, v) through any strides (the views
``get_query_key_value_tensors`` makes of the QKV projection), applies the
non-interleaved RoPE of megatron-core (``naive.py``; rot_dim <= d, the tail passes through)
in fp32, and writes the layout the fused attention kernels want -- the seed-000
contiguous-q/k/v rule met in the same pass as RoPE, with no separate copies.

Backward is the same kernel run the other way: the grad [b, h, s, d] (any strides) is
rotated by the transpose (inverse) rotation and written as contiguous [s, b, h, d], i.e.
megatron's layout. With y_i = x_i cos_i + sgn_i x_p(i) sin_i (p(i) = i +- rot/2,
sgn = -1 on the first half), dx_i = g_i cos_i - sgn_i g_p(i) sin_p(i).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_layout_kernel(
    X, F, Y,
    sx_s, sx_b, sx_h, sx_d,
    sy_s, sy_b, sy_h, sy_d,
    sf_s, sf_d,
    S, H, D, mscale,
    ROT: tl.constexpr, HAS_ROPE: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    ib = pid_bh // H
    ih = pid_bh % H
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < S
    md = offs_d < D
    m2 = ms[:, None] & md[None, :]
    xbase = X + ib.to(tl.int64) * sx_b + ih.to(tl.int64) * sx_h
    xrow = xbase + offs_s[:, None].to(tl.int64) * sx_s
    x = tl.load(xrow + offs_d[None, :] * sx_d, mask=m2, other=0.0).to(tl.float32)
    if HAS_ROPE:
        HALF: tl.constexpr = ROT // 2
        in_rot = offs_d < ROT
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        mr = ms[:, None] & in_rot[None, :]
        xp = tl.load(xrow + partner[None, :] * sx_d, mask=mr, other=0.0).to(tl.float32)
        frow = F + offs_s[:, None].to(tl.int64) * sf_s
        f = tl.load(frow + offs_d[None, :] * sf_d, mask=mr, other=0.0).to(tl.float32)
        cos = tl.cos(f) * mscale
        if INVERSE:
            fp = tl.load(frow + partner[None, :] * sf_d, mask=mr, other=0.0).to(tl.float32)
            sin = tl.sin(fp) * mscale
            sgn = tl.where(first, 1.0, -1.0)
        else:
            sin = tl.sin(f) * mscale
            sgn = tl.where(first, -1.0, 1.0)
        rotated = x * cos + sgn[None, :] * xp * sin
        x = tl.where(in_rot[None, :], rotated, x)
    ybase = Y + ib.to(tl.int64) * sy_b + ih.to(tl.int64) * sy_h
    tl.store(ybase + offs_s[:, None].to(tl.int64) * sy_s + offs_d[None, :] * sy_d,
             x.to(Y.dtype.element_ty), mask=m2)


def _launch(x_sbhd: Tensor, y_sbhd: Tensor, freqs: Optional[Tensor], mscale: float, inverse: bool) -> None:
    """x, y given as [s, b, h, d] views (any strides); freqs [s, 1, 1, rot] or None."""
    S, B, H, D = x_sbhd.shape
    rot = 0 if freqs is None else int(freqs.shape[-1])
    f = x_sbhd if freqs is None else freqs
    sf_s, sf_d = (0, 0) if freqs is None else (freqs.stride(0), freqs.stride(-1))
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(triton.next_power_of_2(S), 4096 // block_d, 64))
    grid = (triton.cdiv(S, block_s), B * H)
    _rope_layout_kernel[grid](
        x_sbhd, f, y_sbhd, *x_sbhd.stride(), *y_sbhd.stride(), sf_s, sf_d, S, H, D, float(mscale),
        ROT=rot, HAS_ROPE=freqs is not None, INVERSE=inverse, BLOCK_S=block_s, BLOCK_D=block_d,
        num_warps=4,
    )


def _empty(shape, like: Tensor) -> Tensor:
    """Output allocation (one place, so tests can NaN-poison it)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


def _to_bhsd(x: Tensor, freqs: Optional[Tensor], mscale: float) -> Tensor:
    s, b, h, d = x.shape
    y = _empty((b, h, s, d), x)
    _launch(x, y.permute(2, 0, 1, 3), freqs, mscale, inverse=False)
    return y


def _to_sbhd(g: Tensor, freqs: Optional[Tensor], mscale: float) -> Tensor:
    b, h, s, d = g.shape
    y = _empty((s, b, h, d), g)
    _launch(g.permute(2, 0, 1, 3), y, freqs, mscale, inverse=True)
    return y


class _RopeLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, freqs_q, freqs_k, mscale):
        ctx.save_for_backward(freqs_q, freqs_k)
        ctx.mscale = mscale
        return _to_bhsd(q, freqs_q, mscale), _to_bhsd(k, freqs_k, mscale), _to_bhsd(v, None, mscale)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        freqs_q, freqs_k = ctx.saved_tensors
        gq = _to_sbhd(dq, freqs_q, ctx.mscale) if ctx.needs_input_grad[0] and dq is not None else None
        gk = _to_sbhd(dk, freqs_k, ctx.mscale) if ctx.needs_input_grad[1] and dk is not None else None
        # v only changed layout: its grad goes back as a view, megatron's split takes any strides
        gv = dv.permute(2, 0, 1, 3) if ctx.needs_input_grad[2] and dv is not None else None
        return gq, gk, gv, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, freqs: Optional[Tensor], name: str) -> None:
    for t, tn in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"rope_layout: {tn} must be [s, b, h, d], got shape {tuple(t.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"rope_layout: q, k, v must share s and b, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError("rope_layout: q, k, v must share the head dim")
    if freqs is None:
        return
    s, d = q.shape[0], q.shape[3]
    if freqs.dim() != 4 or freqs.shape[0] != s or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"rope_layout: {name} must be [s={s}, 1, 1, rot_dim], got {tuple(freqs.shape)}")
    rot = freqs.shape[-1]
    if rot % 2 or rot > d or rot == 0:
        raise ValueError(f"rope_layout: rot_dim={rot} must be even and in (0, head dim {d}]")
    if freqs.requires_grad:
        raise NotImplementedError("rope_layout: freqs must not require grad (megatron's do not)")


def rope_layout_triton(
    q: Tensor, k: Tensor, v: Tensor, freqs_q: Optional[Tensor], freqs_k: Optional[Tensor] = None,
    mscale: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Fused RoPE + [s, b, h, d] -> contiguous [b, h, s, d] for q, k, v (3 launches; bwd 2).

    Args:
        q, k, v: [s, b, h(q|kv), d] with any strides (megatron's views of the QKV output).
        freqs_q, freqs_k: megatron's rotary tensor [s, 1, 1, rot_dim] (fp32, already the
            local context-parallel slice); ``freqs_k`` defaults to ``freqs_q``; ``None``
            for both = layout only.
        mscale: multiplies cos and sin (YaRN's concentration factor; 1.0 otherwise).
    Returns:
        contiguous [b, h, s, d] q (rotated), k (rotated), v, in the input dtype.
    """
    if freqs_k is None:
        freqs_k = freqs_q
    _check(q, k, v, freqs_q, "freqs_q")
    _check(q, k, v, freqs_k, "freqs_k")
    return _RopeLayout.apply(q, k, v, freqs_q, freqs_k, float(mscale))
