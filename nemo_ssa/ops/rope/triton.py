"""Fused RoPE + layout: megatron's [s, b, h, d] views in, contiguous [b, h, s, d] out.

One Triton launch reads q, k and v through any strides (the views
``get_query_key_value_tensors`` makes of the QKV projection), applies the
non-interleaved RoPE of megatron-core (``naive.py``; rot_dim <= d, the tail passes through)
in fp32, and writes the layout the fused attention kernels want -- the seed-000
contiguous-q/k/v rule met in the same pass as RoPE, with no separate copies.

Backward is the same kernel run the other way, one launch for dq and dk: the grads
[b, h, s, d] (any strides) are rotated by the transpose (inverse) rotation and written as
contiguous [s, b, h, d], i.e. megatron's layout; dv goes back as a permuted view. With y_i = x_i cos_i + sgn_i x_p(i) sin_i (p(i) = i +- rot/2,
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
    X0, X1, X2, F0, F1, Y0, Y1, Y2,
    s0_s, s0_b, s0_h, s0_d, s1_s, s1_b, s1_h, s1_d, s2_s, s2_b, s2_h, s2_d,
    sf0_s, sf0_d, sf1_s, sf1_d,
    S, B, H0, H1, D, mscale,
    NT: tl.constexpr, ROT: tl.constexpr, INVERSE: tl.constexpr, OUT_BHSD: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_S rows of one (tensor, batch, head); tensors 0, 1 (q, k) rotated
    when ROT > 0, tensor 2 (v) only re-laid out. Outputs are dense: [b, h, s, d]
    (OUT_BHSD, the forward) or [s, b, h, d] (the backward)."""
    pid = tl.program_id(0)  # over B * (H0 + H1 + H2), tensor-major (axis 0: no 65535 limit)
    pid_s = tl.program_id(1)
    n0 = B * H0
    n1 = B * H1
    t = tl.where(pid < n0, 0, tl.where(pid < n0 + n1, 1, 2))
    r = pid - tl.where(t == 0, 0, tl.where(t == 1, n0, n0 + n1))
    H = tl.where(t == 0, H0, H1)  # H2 == H1 (k and v share the kv heads)
    ib = r // H
    ih = r % H
    X = tl.where(t == 0, X0, tl.where(t == 1, X1, X2))
    Y = tl.where(t == 0, Y0, tl.where(t == 1, Y1, Y2))
    sx_s = tl.where(t == 0, s0_s, tl.where(t == 1, s1_s, s2_s)).to(tl.int64)
    sx_b = tl.where(t == 0, s0_b, tl.where(t == 1, s1_b, s2_b)).to(tl.int64)
    sx_h = tl.where(t == 0, s0_h, tl.where(t == 1, s1_h, s2_h)).to(tl.int64)
    sx_d = tl.where(t == 0, s0_d, tl.where(t == 1, s1_d, s2_d)).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < S
    md = offs_d < D
    m2 = ms[:, None] & md[None, :]
    xrow = X + ib.to(tl.int64) * sx_b + ih.to(tl.int64) * sx_h + offs_s[:, None].to(tl.int64) * sx_s
    x = tl.load(xrow + offs_d[None, :] * sx_d, mask=m2, other=0.0).to(tl.float32)
    if ROT > 0:
        HALF: tl.constexpr = ROT // 2
        rope = t < 2
        in_rot = (offs_d < ROT) & rope
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        mr = ms[:, None] & in_rot[None, :]
        xp = tl.load(xrow + partner[None, :] * sx_d, mask=mr, other=0.0).to(tl.float32)
        F = tl.where(t == 0, F0, F1)
        sf_s = tl.where(t == 0, sf0_s, sf1_s).to(tl.int64)
        sf_d = tl.where(t == 0, sf0_d, sf1_d).to(tl.int64)
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
    if OUT_BHSD:
        yrow = Y + ((ib * H + ih).to(tl.int64) * S + offs_s[:, None].to(tl.int64)) * D
    else:
        yrow = Y + ((offs_s[:, None].to(tl.int64) * B + ib) * H + ih) * D
    tl.store(yrow + offs_d[None, :], x.to(Y.dtype.element_ty), mask=m2)


def _launch(xs, ys, freqs_q: Optional[Tensor], freqs_k: Optional[Tensor], mscale: float, inverse: bool,
            out_bhsd: bool) -> None:
    """xs: 2 or 3 tensors given as [s, b, h, d] views (any strides), ys: their dense outputs."""
    nt = len(xs)
    xs3 = list(xs) + [xs[-1]] * (3 - nt)
    ys3 = list(ys) + [ys[-1]] * (3 - nt)
    S, B, H0, D = xs3[0].shape
    H1 = xs3[1].shape[2]
    rot = 0 if freqs_q is None else int(freqs_q.shape[-1])
    f0 = xs3[0] if freqs_q is None else freqs_q
    f1 = xs3[0] if freqs_k is None else freqs_k
    sf = (0, 0, 0, 0) if freqs_q is None else (freqs_q.stride(0), freqs_q.stride(-1),
                                               freqs_k.stride(0), freqs_k.stride(-1))
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(triton.next_power_of_2(S), 4096 // block_d, 64))
    grid = (B * (H0 + H1 * (nt - 1)), triton.cdiv(S, block_s))
    _rope_layout_kernel[grid](
        *xs3, f0, f1, *ys3, *xs3[0].stride(), *xs3[1].stride(), *xs3[2].stride(), *sf,
        S, B, H0, H1, D, float(mscale),
        NT=nt, ROT=rot, INVERSE=inverse, OUT_BHSD=out_bhsd, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
    )


def _empty(shape, like: Tensor) -> Tensor:
    """Output allocation (one place, so tests can NaN-poison it)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


class _RopeLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, freqs_q, freqs_k, mscale):
        ctx.save_for_backward(freqs_q, freqs_k)
        ctx.mscale = mscale
        s, b, _, d = q.shape
        ys = [_empty((b, t.shape[2], s, d), q) for t in (q, k, v)]
        _launch((q, k, v), ys, freqs_q, freqs_k, mscale, inverse=False, out_bhsd=True)
        return tuple(ys)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        freqs_q, freqs_k = ctx.saved_tensors
        # one launch rotates dq and dk back (inverse rotation) into megatron's [s, b, h, d]
        # (autograd materialises unused outputs' grads as zeros: never None here)
        b, hq, s, d = dq.shape
        gq = _empty((s, b, hq, d), dq)
        gk = _empty((s, b, dk.shape[1], d), dk)
        _launch((dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3)), (gq, gk), freqs_q, freqs_k, ctx.mscale,
                inverse=True, out_bhsd=False)
        # v only changed layout: its grad goes back as a view, megatron's split takes any strides
        gv = dv.permute(2, 0, 1, 3)
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
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"rope_layout: k and v must have the same number of heads, got {k.shape[2]} and {v.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype) or q.device != k.device or q.device != v.device:
        raise ValueError("rope_layout: q, k, v must share dtype and device")
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
    """Fused RoPE + [s, b, h, d] -> contiguous [b, h, s, d] for q, k, v (one launch; bwd one).

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
    if (freqs_q is None) != (freqs_k is None) or (freqs_q is not None and freqs_q.shape != freqs_k.shape):
        raise ValueError("rope_layout: freqs_q and freqs_k must both be given with the same shape (or both None)")
    return _RopeLayout.apply(q, k, v, freqs_q, freqs_k, float(mscale))
