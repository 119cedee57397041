"""Fused RoPE + layout: megatron's [s, b, h, d] views in, contiguous [b, h, s, d] out.

One Triton launch reads q, k and v through any strides (the views
``get_query_key_value_tensors`` makes of the QKV projection), applies the
non-interleaved RoPE of megatron-core (``naive.py``; rot_dim <= d, the tail passes through)
in fp32, and writes the layout the fused attention kernels want -- the seed-000
contiguous-q/k/v rule met in the same pass as RoPE, with no separate copies.

Backward is the same kernel run the other way: the grads [b, h, s, d] (any strides) are
rotated by the transpose (inverse) rotation and written in megatron's layout. With
y_i = x_i cos_i + sgn_i x_p(i) sin_i (p(i) = i +- rot/2, sgn = -1 on the first half),
dx_i = g_i cos_i - sgn_i g_p(i) sin_p(i).

cos and sin are not evaluated in the kernel: ``_trig`` turns the rotary tensor into two
contiguous fp32 tables [s, rot], cos(freqs) * mscale and sin(freqs) * mscale (megatron's
fp32 arithmetic: mscale after cos / sin), and the kernel loads cos_i and sin_i (sin_p(i)
backward) from them. Evaluated per program, the ~rot/2 * s distinct values would be
recomputed by every one of the B * H programs of every launch; the tables are computed once
per rotary tensor and cached (keyed on the tensor object, its version counter and mscale),
since megatron hands the same rotary tensor to every layer.

Two entry points share the kernel:

* ``rope_layout_qkv_triton`` takes the QKV projection's output itself,
  [s, b, ng, (p + 2) * d] (per KV group, p query heads, then k, then v), and reads q, k, v
  from it; q's head h is addressed as (group h // p, place h % p), since a group's query heads
  are d apart but groups (p + 2) * d apart -- no single head stride, which is why megatron's
  split copies q into [s, b, np, d]. Backward writes dq, dk and dv in one launch into one
  dense buffer in the QKV layout: that buffer *is* the projection output's gradient, so
  neither the copy of q nor the concatenation of megatron's split runs, forward or backward.
* ``rope_layout_triton`` takes q, k, v as [s, b, h, d] views (e.g. after a q/k layer norm);
  backward writes dq, dk dense [s, b, h, d] in one launch and hands dv back as a permuted view.
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from nemo_ssa.ops.common.launch import cdiv, launch_kw, next_pow2


@triton.jit
def _rope_layout_kernel(
    X0, X1, X2, C0, N0, C1, N1, Y0, Y1, Y2,
    sx0_s, sx0_b, sx0_g, sx0_h, sx0_d, sx1_s, sx1_b, sx1_h, sx1_d, sx2_s, sx2_b, sx2_h, sx2_d,
    sy0_s, sy0_b, sy0_g, sy0_h, sy1_s, sy1_b, sy1_h, sy2_s, sy2_b, sy2_h,
    S, B, H0, H1, D, QPG,
    NT: tl.constexpr, ROT: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_S rows of one (tensor, batch, head); tensors 0, 1 (q, k) rotated
    when ROT > 0, tensor 2 (v) only re-laid out. Every tensor is an [s, b, h, d] view through
    its strides (outputs with unit d stride); q's head h sits at group h // QPG, place
    h % QPG in it, so q can be read from or written into megatron's QKV buffer, whose q heads
    are no single stride apart (a plain [s, b, h, d] q has sx0_g == QPG * sx0_h). C0, N0
    (q) and C1, N1 (k): the cos and sin tables [S, ROT], contiguous (``_trig``)."""
    pid = tl.program_id(0)  # over B * (H0 + H1 + H2), tensor-major (axis 0: no 65535 limit)
    pid_s = tl.program_id(1)
    n0 = B * H0
    n1 = B * H1
    t = tl.where(pid < n0, 0, tl.where(pid < n0 + n1, 1, 2))
    r = pid - tl.where(t == 0, 0, tl.where(t == 1, n0, n0 + n1))
    H = tl.where(t == 0, H0, H1)  # H2 == H1 (k and v share the kv heads)
    ib = r // H
    ih = r % H
    ig = (ih // QPG).to(tl.int64)  # q only: its group and its place in the group
    ip = (ih % QPG).to(tl.int64)
    X = tl.where(t == 0, X0, tl.where(t == 1, X1, X2))
    Y = tl.where(t == 0, Y0, tl.where(t == 1, Y1, Y2))
    sx_s = tl.where(t == 0, sx0_s, tl.where(t == 1, sx1_s, sx2_s)).to(tl.int64)
    sx_b = tl.where(t == 0, sx0_b, tl.where(t == 1, sx1_b, sx2_b)).to(tl.int64)
    sx_d = tl.where(t == 0, sx0_d, tl.where(t == 1, sx1_d, sx2_d)).to(tl.int64)
    x_head = tl.where(t == 0, ig * sx0_g + ip * sx0_h,
                      ih.to(tl.int64) * tl.where(t == 1, sx1_h, sx2_h))
    sy_s = tl.where(t == 0, sy0_s, tl.where(t == 1, sy1_s, sy2_s)).to(tl.int64)
    sy_b = tl.where(t == 0, sy0_b, tl.where(t == 1, sy1_b, sy2_b)).to(tl.int64)
    y_head = tl.where(t == 0, ig * sy0_g + ip * sy0_h,
                      ih.to(tl.int64) * tl.where(t == 1, sy1_h, sy2_h))
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < S
    md = offs_d < D
    m2 = ms[:, None] & md[None, :]
    xrow = X + ib.to(tl.int64) * sx_b + x_head + offs_s[:, None].to(tl.int64) * sx_s
    x = tl.load(xrow + offs_d[None, :] * sx_d, mask=m2, other=0.0).to(tl.float32)
    if ROT > 0:
        HALF: tl.constexpr = ROT // 2
        rope = t < 2
        in_rot = (offs_d < ROT) & rope
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        mr = ms[:, None] & in_rot[None, :]
        xp = tl.load(xrow + partner[None, :] * sx_d, mask=mr, other=0.0).to(tl.float32)
        trow = offs_s[:, None].to(tl.int64) * ROT  # [BLOCK_S, 1] into the [S, ROT] tables
        crow = tl.where(t == 0, C0, C1) + trow
        nrow = tl.where(t == 0, N0, N1) + trow
        cos = tl.load(crow + offs_d[None, :], mask=mr, other=0.0)
        if INVERSE:
            sin = tl.load(nrow + partner[None, :], mask=mr, other=0.0)  # sin_p(i): module docstring
            sgn = tl.where(first, 1.0, -1.0)
        else:
            sin = tl.load(nrow + offs_d[None, :], mask=mr, other=0.0)
            sgn = tl.where(first, -1.0, 1.0)
        rotated = x * cos + sgn[None, :] * xp * sin
        x = tl.where(in_rot[None, :], rotated, x)
    yrow = Y + ib.to(tl.int64) * sy_b + y_head + offs_s[:, None].to(tl.int64) * sy_s
    tl.store(yrow + offs_d[None, :], x.to(Y.dtype.element_ty), mask=m2)


# ---------------------------------------------------------------------------- host launcher
def _grouped(t: Tensor, qpg: int) -> Tensor:
    """q as [s, b, g, p, d]: a 4-D [s, b, h, d] view splits its heads (a view, no copy;
    ``view``, not ``unflatten``: a Python function with symbolic-shape checks, on every launch)."""
    if t.dim() == 5:
        return t
    s, b, h, d = t.shape
    return t.view(s, b, h // qpg, qpg, d)


_NAMES: dict = {}  # (prefix, axes) -> the kernel's stride parameter names


def _named(prefix: str, axes: str, strides) -> dict:
    names = _NAMES.get((prefix, axes))
    if names is None:
        names = _NAMES[(prefix, axes)] = tuple(prefix + a for a in axes)
    return dict(zip(names, strides))


#: (id(freqs), mscale) -> (weakref to freqs, facts, cos table, sin table), oldest first
_TRIG: dict = {}
_TRIG_MAX = 16


def _trig_facts(freqs: Tensor) -> tuple:
    """What must be unchanged for a cached table to still be freqs' table: the version
    counter (any in-place write bumps it) and the storage, shape and layout."""
    return (freqs._version, freqs.data_ptr(), freqs.shape, freqs.stride(), freqs.dtype, freqs.device)


def _forget(key, ref) -> None:
    """freqs died: drop its tables (unless the entry is already another tensor's)."""
    hit = _TRIG.get(key)
    if hit is not None and hit[0] is ref:
        del _TRIG[key]


def _trig_compute(freqs: Tensor, mscale: float) -> Tuple[Tensor, Tensor]:
    """``_trig``'s tables, uncached (new tensors: a table a backward holds is never rewritten)."""
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    return (torch.cos(f) * mscale).contiguous(), (torch.sin(f) * mscale).contiguous()


def _trig(freqs: Tensor, mscale: float) -> Tuple[Tensor, Tensor]:
    """The kernel's cos and sin tables of the rotary tensor ``freqs`` [s, 1, 1, rot]: two
    contiguous fp32 [s, rot] tensors, cos(freqs) * mscale and sin(freqs) * mscale, computed
    in fp32 as megatron computes them (mscale after cos / sin).

    Cached, because megatron builds the rotary tensor once per step (its
    ``RotaryEmbedding.forward`` is even lru_cached: the same object step after step) and
    hands that object to every layer: one pair of tables serves every layer's forward and
    backward launch (the recipe's 12 layers: 24 launches a step), instead of cos and sin
    evaluated in each of the kernel's B * H programs on every launch.
    The key holds the tensor weakly (its tables go when it does), its version counter (an
    in-place write to it recomputes), its storage, shape and layout, and mscale; at most
    ``_TRIG_MAX`` entries, the oldest evicted. Never cached while a CUDA graph is being
    captured: the graph must compute its own tables, from whatever its freqs holds at each
    replay."""
    mscale = float(mscale)
    if freqs.is_cuda and torch.cuda.is_current_stream_capturing():
        # a cached table would be read by every replay as it is now (or after it is freed)
        return _trig_compute(freqs, mscale)
    try:
        facts = _trig_facts(freqs)
    except RuntimeError:  # an inference tensor has no version counter: compute, never cache
        return _trig_compute(freqs, mscale)
    key = (id(freqs), mscale)
    hit = _TRIG.get(key)
    if hit is not None and hit[0]() is freqs and hit[1] == facts:
        return hit[2], hit[3]
    cos_t, sin_t = _trig_compute(freqs, mscale)
    _TRIG.pop(key, None)
    while len(_TRIG) >= _TRIG_MAX:
        _TRIG.pop(next(iter(_TRIG)), None)
    _TRIG[key] = (weakref.ref(freqs, lambda ref, key=key: _forget(key, ref)), facts, cos_t, sin_t)
    return cos_t, sin_t


def _tables(freqs_q: Optional[Tensor], freqs_k: Optional[Tensor], mscale: float):
    """``(cos_q, sin_q, cos_k, sin_k)`` for the kernel, or None for layout only; q and k
    sharing one rotary tensor (megatron's case) share its tables."""
    if freqs_q is None:
        return None
    tq = _trig(freqs_q, mscale)
    tk = tq if freqs_k is freqs_q else _trig(freqs_k, mscale)
    return tq + tk


def _launch(xs, ys, tables: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]], inverse: bool, qpg: int = 1) -> None:
    """xs, ys: 2 or 3 tensors as [s, b, h, d] views (any strides; ys with unit d stride); q
    (the first) may be given as [s, b, g, qpg, d] instead. ys[i] <- RoPE(xs[i]) for q and k
    (the inverse rotation with ``inverse``), ys[2] <- xs[2]. ``tables``: ``_tables``' cos
    and sin tables of q and k, or None for no rotation."""
    nt = len(xs)
    x0, y0 = _grouped(xs[0], qpg), _grouped(ys[0], qpg)
    xs3 = [x0] + list(xs[1:]) + [xs[-1]] * (3 - nt)
    ys3 = [y0] + list(ys[1:]) + [ys[-1]] * (3 - nt)
    S, B, G, P, D = x0.shape
    assert P == qpg and y0.shape == x0.shape and all(y.stride(-1) == 1 for y in ys3), "launcher misuse"
    if tables is None:
        rot, (c0, n0, c1, n1) = 0, (x0,) * 4  # placeholders, never read (ROT == 0)
    else:
        (c0, n0, c1, n1), rot = tables, int(tables[0].shape[1])  # [S, rot], contiguous by _trig
    block_d = next_pow2(D)
    block_s = max(1, min(next_pow2(S), 4096 // block_d, 64))
    grid = (B * (G * P + xs3[1].shape[2] * (nt - 1)), cdiv(S, block_s))
    # by name through launch_kw's cached binder and launch: two launches per layer and step
    # on a host-bound step, where JITFunction.run's per-call binding is most of their cost
    launch_kw(
        _rope_layout_kernel, grid,
        {"X0": xs3[0], "X1": xs3[1], "X2": xs3[2], "C0": c0, "N0": n0, "C1": c1, "N1": n1,
         "Y0": ys3[0], "Y1": ys3[1], "Y2": ys3[2]},
        {**_named("sx0_", "sbghd", x0.stride()), **_named("sx1_", "sbhd", xs3[1].stride()),
         **_named("sx2_", "sbhd", xs3[2].stride()),
         **_named("sy0_", "sbgh", y0.stride()), **_named("sy1_", "sbh", ys3[1].stride()),
         **_named("sy2_", "sbh", ys3[2].stride()),
         "S": S, "B": B, "H0": G * P, "H1": xs3[1].shape[2], "D": D, "QPG": qpg},
        {"NT": nt, "ROT": rot, "INVERSE": inverse, "BLOCK_S": block_s, "BLOCK_D": block_d, "num_warps": 4},
    )


def _empty(shape, like: Tensor) -> Tensor:
    """Output allocation (one place, so tests can NaN-poison it)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


def _split_qkv(mixed: Tensor, qpg: int, d: int):
    """Megatron's QKV buffer [s, b, ng, (qpg + 2) * d] as q [s, b, ng, qpg, d], k, v [s, b, ng, d]
    (views: per group, its query heads, then its key and its value head)."""
    s, b, ng, _ = mixed.shape
    return (mixed[..., : qpg * d].view(s, b, ng, qpg, d), mixed[..., qpg * d: (qpg + 1) * d],
            mixed[..., (qpg + 1) * d: (qpg + 2) * d])


# ---------------------------------------------------------------------------- autograd
class _RopeLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, freqs_q, freqs_k, mscale):
        tables = _tables(freqs_q, freqs_k, mscale)
        # backward takes forward's tables, not freqs: no second lookup, and an in-place change
        # of freqs between the two passes cannot make backward's rotation differ from forward's
        ctx.tables = tables
        s, b, _, d = q.shape
        ys = [_empty((b, t.shape[2], s, d), q) for t in (q, k, v)]
        _launch((q, k, v), [y.permute(2, 0, 1, 3) for y in ys], tables, inverse=False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        # one launch rotates dq and dk back (inverse rotation) into megatron's [s, b, h, d]
        # (autograd materialises unused outputs' grads as zeros: never None here)
        b, hq, s, d = dq.shape
        gq = _empty((s, b, hq, d), dq)
        gk = _empty((s, b, dk.shape[1], d), dk)
        _launch((dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3)), (gq, gk), ctx.tables, inverse=True)
        # v only changed layout: its grad goes back as a view, megatron's split takes any strides
        gv = dv.permute(2, 0, 1, 3)
        return gq, gk, gv, None, None, None


class _RopeLayoutQKV(torch.autograd.Function):
    """q, k, v as one function of megatron's QKV buffer: autograd records no split and no
    reshape, so backward concatenates nothing -- the kernel writes dq, dk and dv straight
    into one buffer laid out like the QKV projection's output."""

    @staticmethod
    def forward(ctx, mixed, qpg, freqs_q, freqs_k, mscale):
        tables = _tables(freqs_q, freqs_k, mscale)
        ctx.tables, ctx.qpg = tables, qpg  # the tables, not freqs: as in _RopeLayout
        s, b, ng, w = mixed.shape
        d = w // (qpg + 2)
        ys = [_empty((b, ng * qpg, s, d), mixed), _empty((b, ng, s, d), mixed), _empty((b, ng, s, d), mixed)]
        _launch(_split_qkv(mixed, qpg, d), [y.permute(2, 0, 1, 3) for y in ys], tables, inverse=False, qpg=qpg)
        return tuple(ys)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qpg = ctx.qpg
        b, _, s, d = dq.shape
        # dense and written whole by one launch: dq and dk rotated back, dv copied
        # (autograd materialises unused outputs' grads as zeros: never None here)
        g = _empty((s, b, dk.shape[1], (qpg + 2) * d), dq)
        _launch(tuple(t.permute(2, 0, 1, 3) for t in (dq, dk, dv)), _split_qkv(g, qpg, d), ctx.tables,
                inverse=True, qpg=qpg)
        return g, None, None, None, None


# ---------------------------------------------------------------------------- public functions
def _check_freqs(freqs_q: Optional[Tensor], freqs_k: Optional[Tensor], s: int, d: int) -> None:
    if (freqs_q is None) != (freqs_k is None) or (freqs_q is not None and freqs_q.shape != freqs_k.shape):
        raise ValueError("rope_layout: freqs_q and freqs_k must both be given with the same shape (or both None)")
    for freqs, name in ((freqs_q, "freqs_q"), (freqs_k, "freqs_k")):
        if freqs is None:
            continue
        if freqs.dim() != 4 or freqs.shape[0] != s or freqs.shape[1] != 1 or freqs.shape[2] != 1:
            raise ValueError(f"rope_layout: {name} must be [s={s}, 1, 1, rot_dim], got {tuple(freqs.shape)}")
        rot = freqs.shape[-1]
        if rot % 2 or rot > d or rot == 0:
            raise ValueError(f"rope_layout: rot_dim={rot} must be even and in (0, head dim {d}]")
        if freqs.requires_grad:
            raise NotImplementedError("rope_layout: freqs must not require grad (megatron's do not)")


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
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


def _check_qkv(mixed_qkv: Tensor, heads_per_group: int) -> int:
    """Validates megatron's QKV buffer [s, b, ng, (p + 2) * d]; returns the head dim d."""
    if mixed_qkv.dim() != 4:
        raise ValueError(f"rope_layout: mixed_qkv must be [s, b, ng, (heads_per_group + 2) * d], got shape "
                         f"{tuple(mixed_qkv.shape)}")
    if isinstance(heads_per_group, bool) or not isinstance(heads_per_group, int) or heads_per_group < 1:
        raise ValueError(f"rope_layout: heads_per_group must be an int >= 1, got {heads_per_group!r}")
    w = mixed_qkv.shape[-1]
    if w % (heads_per_group + 2) or w == 0:
        raise ValueError(f"rope_layout: mixed_qkv's last dim {w} is not (heads_per_group + 2) * d with "
                         f"heads_per_group={heads_per_group}")
    return w // (heads_per_group + 2)


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
    _check(q, k, v)
    _check_freqs(freqs_q, freqs_k, q.shape[0], q.shape[3])
    return _RopeLayout.apply(q, k, v, freqs_q, freqs_k, float(mscale))


def rope_layout_qkv_triton(
    mixed_qkv: Tensor, heads_per_group: int, freqs_q: Optional[Tensor], freqs_k: Optional[Tensor] = None,
    mscale: float = 1.0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``rope_layout_triton`` read straight from megatron's QKV buffer, its gradient one buffer.

    The q, k, v of ``get_query_key_value_tensors`` are a split of this buffer and a reshape
    of q (a copy: a group's query heads are d apart, groups (p + 2) * d apart); their
    gradients are concatenated back by the split's backward (a second copy). Here the kernel
    reads q, k, v from the buffer through a grouped head index and, backward, writes dq, dk
    and dv into one dense buffer in its layout (one launch each way, no copies).

    Args:
        mixed_qkv: [s, b, ng, (p + 2) * d], any strides: per KV group its p query heads,
            then its key head, then its value head (megatron's view of ``linear_qkv``'s output).
        heads_per_group: p, query heads per KV group (np / ng).
        freqs_q, freqs_k, mscale: as for ``rope_layout_triton``.
    Returns:
        contiguous [b, h, s, d] q (h = ng * p; head h is group h // p, place h % p: megatron's
        query order, rotated), k (rotated) and v (h = ng), in the input dtype.
    """
    if freqs_k is None:
        freqs_k = freqs_q
    d = _check_qkv(mixed_qkv, heads_per_group)
    _check_freqs(freqs_q, freqs_k, mixed_qkv.shape[0], d)
    return _RopeLayoutQKV.apply(mixed_qkv, heads_per_group, freqs_q, freqs_k, float(mscale))
