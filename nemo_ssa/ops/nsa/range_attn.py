"""Banded causal attention in Triton: NSA's sliding-window and compressed branches.

Both branches are one schedule. Key ``j`` has a *position* -- the index of the last
token it summarises -- ``pos(j) = j * KSTRIDE + KOFF``, and query ``t`` sees it iff

    pos(j) <= t                          (causal: the key has ended)
    t - pos(j) < WINDOW                  (only when HAS_WINDOW)

* window branch: ``KSTRIDE = 1, KOFF = 0, WINDOW = w`` -> keys ``t-w+1 .. t``;
* compressed branch: ``KSTRIDE = d, KOFF = l - 1``, no window -> compressed blocks
  that have ended (NSA's visibility rule).

Every query row therefore sees a contiguous key range whose ends grow with ``t``, so a
query tile iterates a block-aligned key range ``[lo, hi)`` (seed 001's "block-aligned
window bounds"); a key tile in the dK/dV kernel iterates the matching query range. The
loops run in stages, as the dense flash kernels do: the tiles every row of the tile sees
whole (``_full_key_range`` / ``_full_query_range``) without any mask, only the edge tiles
(the causal diagonal, the window's far end, ragged tails) with the visibility mask. The
score transform (softmax / SSA) is the ``TRANSFORM`` constexpr from
``nemo_ssa.ops.common.transforms``.

Hopper path (``TMA`` constexpr; ``RANGE_TMA``, ``TMA_MAX_HEAD_DIM``): on sm_90+ the tiles
the loops stream -- K/V in the forward and dQ kernels, Q/dO in the dK/dV kernel -- come
through rank-4 tensor descriptors (``ops.common.tma``), which zero-fill rows past the
sequence and columns past D. Same kernels, same math; the pointer path stays for other
GPUs, odd layouts, short calls and ``NEMO_SSA_TMA=0``.

Layouts ``q [B, Hq, N, D]``, ``k, v [B, Hkv, NK, D]`` (any strides), GQA by head index
(``h // GROUP``). Outputs ``o [B, Hq, N, D]`` in q's dtype and the per-row log-sum-exp
``lse [B, Hq, N]`` in fp32, log2 domain (``+inf`` for rows that see no key; their
output is 0 and any probability recomputed from it is 0). The compressed branch's
``lse`` feeds the selection scores (``select.py``).

Backward: FA2-style, ``dq`` per query tile and ``dk, dv`` per key tile; the dK/dV program
owns its key tile and loops over the GROUP query heads that read it, so there are no
atomics and the result is deterministic. A key tile of the compressed branch is read by
every later query (up to all N), so one program per key tile would leave few, long and
unequal programs at long N; the dK/dV grid therefore has a third axis that cuts each key
tile's visible query range into ``SPLIT`` equal BLOCK_M-aligned chunks (``_dkv_split``
picks it from the problem). With ``SPLIT > 1`` each program writes fp32 partial
``dk, dv`` to its own slot of a ``[SPLIT, B, Hkv, NK, D]`` buffer, summed over the split
axis in a fixed order on the host (still no atomics, still deterministic); with
``SPLIT == 1`` (the window branch, small problems) they go straight to ``dk, dv``. SSA's
``dn, db`` are per-program fp32 partials summed on the host in fp64.

Differences from the reference (``naive.masked_attention``): online softmax in fp32
(statistics never in half precision), ``p`` cast to the value dtype before ``p @ v``
for half inputs (as flash attention does); no dropout.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from nemo_ssa.ops.common.device import online_softmax_step, tma_tile
from nemo_ssa.ops.common.dispatch import note
from nemo_ssa.ops.common.launch import is_interpreter
from nemo_ssa.ops.common.target import target
from nemo_ssa.ops.common.tma import descriptor, use_tma
from nemo_ssa.ops.common.transforms import grad_consts, score_bwd_parts, score_fwd, transform_consts
from nemo_ssa.ops.nsa._common import (
    MAX_HEAD_DIM,
    block_d,
    check_kernel_tensors,
    dot_precision,
    fast_log2,
    row_delta,
    ssa_scalars,
)

__all__ = ["banded_attention", "window_attention", "compressed_attention"]


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _key_range(m_first, m_last, NK, KSTRIDE, KOFF, WINDOW,
               HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block-aligned ``[lo, hi)`` of the keys some query in ``[m_first, m_last]`` sees."""
    hi = tl.where(m_last >= KOFF, tl.maximum(m_last - KOFF, 0) // KSTRIDE + 1, 0)
    hi = tl.minimum(hi, NK)
    if HAS_WINDOW:
        # first key with m_first - pos(j) < WINDOW  <=>  j*KSTRIDE > m_first - WINDOW - KOFF
        x = m_first - WINDOW - KOFF
        lo = tl.where(x >= 0, tl.maximum(x, 0) // KSTRIDE + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = hi * 0
    return lo, hi


@triton.jit
def _visible(offs_m, offs_n, N, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` visibility of key ``offs_n`` to query ``offs_m``."""
    pos = offs_n * KSTRIDE + KOFF  # [BLOCK_N]
    ok = (pos[None, :] <= offs_m[:, None]) & (offs_n[None, :] < NK) & (offs_m[:, None] < N)
    if HAS_WINDOW:
        ok = ok & (offs_m[:, None] - pos[None, :] < WINDOW)
    return ok


@triton.jit
def _q_block_setup(pid_m, pid_bh, NP, BP, Hq, N, D, GROUP, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Batch / query head / kv head (int64), the SSA scalars and the row/dim offsets and
    masks of query block ``pid_m`` of program ``pid_bh`` (over ``B * Hq``)."""
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    hk = h // GROUP
    n_ssa = tl.load(NP).to(tl.float32)
    b_ssa = tl.load(BP).to(tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = offs_m < N
    return b, h, hk, n_ssa, b_ssa, offs_m, offs_d, d_ok, m_ok


@triton.jit
def _load_kv_block(k_base, v_base, start_n, offs_n, NK, offs_d, d_ok, skn, skd, svn, svd, MASKED: tl.constexpr = True,
                   TMA: tl.constexpr = 0, tb=0, th=0, BLOCK_N: tl.constexpr = 16, BLOCK_D: tl.constexpr = 16):
    """Key and value rows ``offs_n`` as ``[BLOCK_N, BLOCK_D]`` tiles; rows ``>= NK`` are
    masked only when ``MASKED`` (unmasked tiles lie inside ``[0, NK)``). ``TMA``:
    ``k_base``/``v_base`` are rank-4 tensor descriptors and ``tb``/``th`` the batch and
    kv head; the tensor-memory accelerator zero-fills rows ``>= NK`` and columns ``>= D``."""
    if TMA:
        k = tma_tile(k_base, tb, th, start_n, BLOCK_N, BLOCK_D)
        v = tma_tile(v_base, tb, th, start_n, BLOCK_N, BLOCK_D)
    else:
        kv_mask = d_ok[None, :]
        if MASKED:
            kv_mask = (offs_n < NK)[:, None] & kv_mask
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _full_key_range(m_first, m_last, lo, hi, NK, KSTRIDE, KOFF, WINDOW,
                    HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split of a query tile's key range ``[lo, hi)`` into ``[lo, a)`` masked, ``[a, b)``
    unmasked, ``[b, hi)`` masked: ``[a, b)`` are the whole BLOCK_N tiles every query in
    ``[m_first, m_last]`` sees (``pos(j) <= m_first`` and, with a window,
    ``m_last - pos(j) < WINDOW``), so they need neither the visibility nor the bounds mask.
    ``a`` and ``b`` are multiples of BLOCK_N (or ``hi``, where the unmasked stage is empty)."""
    # keys ended for the first row: pos(j) <= m_first, whole tiles only (in [0, NK))
    c = tl.where(m_first >= KOFF, tl.maximum(m_first - KOFF, 0) // KSTRIDE + 1, 0)
    f_hi = (tl.minimum(c, NK) // BLOCK_N) * BLOCK_N
    f_lo = lo
    if HAS_WINDOW:
        # first key the last row still sees: j*KSTRIDE > m_last - WINDOW - KOFF, rounded up
        x = m_last - WINDOW - KOFF
        first = tl.where(x >= 0, tl.maximum(x, 0) // KSTRIDE + 1, 0)
        f_lo = tl.maximum(((first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    a = tl.minimum(f_lo, hi)
    b = tl.maximum(a, f_hi)
    return a, b


@triton.jit
def _full_query_range(n_first, n_last, NK, N, KSTRIDE, KOFF, WINDOW,
                      HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[r_lo, r_hi)``: the whole BLOCK_M query blocks (inside ``[0, N)``) that see every
    key of the tile ``[n_first, n_last]`` -- ``t >= pos(n_last)`` and, with a window,
    ``t < pos(n_first) + WINDOW``. A ragged last key tile has none (its keys past NK
    must weigh 0, so it always takes the masked path). Both ends are multiples of
    BLOCK_M; ``r_hi <= r_lo`` means none."""
    r_lo = ((n_last * KSTRIDE + KOFF + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    r_hi = (N // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        r_hi = tl.minimum(r_hi, ((n_first * KSTRIDE + KOFF + WINDOW) // BLOCK_M) * BLOCK_M)
    r_hi = tl.where(n_first + BLOCK_N > NK, r_lo, r_hi)
    return r_lo, r_hi


@triton.jit
def _fwd_stage(acc, l_i, m_i, start, end, q, k_base, v_base, offs_m, offs_d, d_ok, skn, skd, svn, svd, N, NK,
               scale, n_ssa, b_ssa, KSTRIDE, KOFF, WINDOW, tb, th,
               TRANSFORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr,
               FAST_LOG2: tl.constexpr = 0):
    """Online-softmax update over the key tiles ``[start, end)``; ``MASKED``: apply the
    visibility rule (edge tiles), else every score counts (whole visible tiles)."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv_block(k_base, v_base, start_n, offs_n, NK, offs_d, d_ok, skn, skd, svn, svd, MASKED,
                              TMA, tb, th, BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_M, BLOCK_N] fp32
        z2 = score_fwd(qk, scale, n_ssa, b_ssa, TRANSFORM, FAST_LOG2)
        if MASKED:
            ok = _visible(offs_m, offs_n, N, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW)
            z2 = tl.where(ok, z2, float("-inf"))
        # unmasked tiles: every row sees every key, m_new is finite
        p, alpha, m_new, l_i = online_softmax_step(z2, m_i, l_i, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dq_stage(dq, start, end, q, do, lse, delta, k_base, v_base, offs_m, offs_d, d_ok, skn, skd, svn, svd, N, NK,
              scale, n_ssa, b_ssa, KSTRIDE, KOFF, WINDOW, tb, th,
              TRANSFORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
              MASKED: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr,
              FAST_LOG2: tl.constexpr = 0):
    """``dq`` over the key tiles ``[start, end)`` (``MASKED`` as in ``_fwd_stage``), without
    the factor ``g_s`` of ``grad_consts`` (the kernel applies it once, after its loops)."""
    c0, c1 = transform_consts(scale, n_ssa, b_ssa, TRANSFORM)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv_block(k_base, v_base, start_n, offs_n, NK, offs_d, d_ok, skn, skd, svn, svd, MASKED,
                              TMA, tb, th, BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        z2, _smag, rinv = score_bwd_parts(qk, c0, c1, TRANSFORM, FAST_LOG2)  # one log2, one reciprocal (SSA)
        if MASKED:
            ok = _visible(offs_m, offs_n, N, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW)
            p = tl.exp2(tl.where(ok, z2 - lse[:, None], float("-inf")))  # masked exponent
        else:  # rows past N carry lse = +inf: p = 0
            p = tl.exp2(z2 - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        dz = p * (dp - delta[:, None])
        ds = dz  # dL/dqk / g_s
        if TRANSFORM == 1:
            ds = dz * rinv
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _dkv_stage(dk, dv, dn_acc, db_acc, start, end, k, v, q_base, do_base, bh_q, LSE, DELTA, offs_n, offs_d, d_ok,
               sqn, sqd, sdon, sdod, N, NK, scale, n_ssa, b_ssa, KSTRIDE, KOFF, WINDOW, tb, th,
               TRANSFORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
               MASKED: tl.constexpr, BLOCK_M: tl.constexpr, TMA: tl.constexpr, BLOCK_D: tl.constexpr,
               FAST_LOG2: tl.constexpr = 0):
    """``dk, dv`` (and SSA's dn, db partials) over the query blocks ``[start, end)`` of one
    query head; unmasked blocks (``not MASKED``) lie inside ``[0, N)`` and see every key.
    ``TMA``: ``q_base``/``do_base`` are tensor descriptors (``tb``/``th``: batch, query head).
    ``dk``, ``dn_acc``, ``db_acc`` leave without the factors of ``grad_consts``."""
    c0, c1 = transform_consts(scale, n_ssa, b_ssa, TRANSFORM)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m.to(tl.int64)[:, None]
        if TMA:  # rows >= N read as 0 (and carry lse = +inf below)
            q = tma_tile(q_base, tb, th, start_m, BLOCK_M, BLOCK_D)
            do = tma_tile(do_base, tb, th, start_m, BLOCK_M, BLOCK_D)
            if MASKED:
                m_ok = offs_m < N
                lse = tl.load(LSE + bh_q * N + offs_m, mask=m_ok, other=float("inf"))
                delta = tl.load(DELTA + bh_q * N + offs_m, mask=m_ok, other=0.0)
            else:
                lse = tl.load(LSE + bh_q * N + offs_m)
                delta = tl.load(DELTA + bh_q * N + offs_m)
        elif MASKED:
            m_ok = offs_m < N
            row_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + rows * sqn + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
            do = tl.load(do_base + rows * sdon + offs_d[None, :] * sdod, mask=row_mask, other=0.0)
            lse = tl.load(LSE + bh_q * N + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(DELTA + bh_q * N + offs_m, mask=m_ok, other=0.0)
        else:
            q = tl.load(q_base + rows * sqn + offs_d[None, :] * sqd, mask=d_ok[None, :], other=0.0)
            do = tl.load(do_base + rows * sdon + offs_d[None, :] * sdod, mask=d_ok[None, :], other=0.0)
            lse = tl.load(LSE + bh_q * N + offs_m)
            delta = tl.load(DELTA + bh_q * N + offs_m)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_M, BLOCK_N]
        z2, smag, rinv = score_bwd_parts(qk, c0, c1, TRANSFORM, FAST_LOG2)
        if MASKED:
            ok = _visible(offs_m, offs_n, N, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW)
            p = tl.exp2(tl.where(ok, z2 - lse[:, None], float("-inf")))  # masked exponent: no inf
        else:
            p = tl.exp2(z2 - lse[:, None])
        dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        dz = p * (dp - delta[:, None])
        ds = dz  # dL/dqk / g_s
        if TRANSFORM == 1:
            ds = dz * rinv
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PREC)
        if TRANSFORM == 1:  # dn / g_n and db / g_b terms (grad_consts)
            dn_e = dz * smag
            db_e = ds * qk
            if MASKED:
                dn_acc += tl.sum(tl.where(ok, dn_e, 0.0), 0)
                db_acc += tl.sum(tl.where(ok, db_e, 0.0), 0)
            else:
                dn_acc += tl.sum(dn_e, 0)
                db_acc += tl.sum(db_e, 0)
    return dk, dv, dn_acc, db_acc


@triton.jit
def _range_fwd_kernel(
    Q, K, V, O, LSE, NP, BP,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, son, sod,
    Hq, N, NK, D, GROUP,
    scale, KSTRIDE, KOFF, WINDOW,
    TRANSFORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr = 0,
    FAST_LOG2: tl.constexpr = 0,
):
    """``TMA``: ``K``, ``V`` are rank-4 tensor descriptors (``ops.common.tma``)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # later rows see more keys: longest first
    pid_bh = tl.program_id(1)
    b, h, hk, n_ssa, b_ssa, offs_m, offs_d, d_ok, m_ok = _q_block_setup(
        pid_m, pid_bh, NP, BP, Hq, N, D, GROUP, BLOCK_M, BLOCK_D)
    q_ptrs = Q + b * sqb + h * sqh + offs_m.to(tl.int64)[:, None] * sqn + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    tb = pid_bh // Hq
    th = (pid_bh % Hq) // GROUP
    if TMA:
        k_base = K
        v_base = V
    else:
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_first = pid_m * BLOCK_M
    m_last = tl.minimum(m_first + BLOCK_M, N) - 1
    lo, hi = _key_range(m_first, m_last, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW, BLOCK_N)
    a, bb = _full_key_range(m_first, m_last, lo, hi, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW, BLOCK_N)
    args = (q, k_base, v_base, offs_m, offs_d, d_ok, skn, skd, svn, svd, N, NK,
            scale, n_ssa, b_ssa, KSTRIDE, KOFF, WINDOW, tb, th)
    acc, l_i, m_i = _fwd_stage(acc, l_i, m_i, lo, a, *args, TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_N, TMA, BLOCK_D, FAST_LOG2)
    acc, l_i, m_i = _fwd_stage(acc, l_i, m_i, a, bb, *args, TRANSFORM, HAS_WINDOW, PREC, False, BLOCK_N, TMA, BLOCK_D, FAST_LOG2)
    acc, l_i, m_i = _fwd_stage(acc, l_i, m_i, bb, hi, *args, TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_N, TMA, BLOCK_D, FAST_LOG2)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_ptrs = O + b * sob + h * soh + offs_m.to(tl.int64)[:, None] * son + offs_d[None, :] * sod
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * N + offs_m, lse, mask=m_ok)


@triton.jit
def _range_bwd_kernel_dq(
    Q, K, V, DO, DQ, LSE, DELTA, NP, BP,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod,
    sdqb, sdqh, sdqn, sdqd,
    Hq, N, NK, D, GROUP,
    scale, KSTRIDE, KOFF, WINDOW,
    TRANSFORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr = 0,
    FAST_LOG2: tl.constexpr = 0,
):
    """``TMA``: ``K``, ``V`` are rank-4 tensor descriptors (``ops.common.tma``)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest first
    pid_bh = tl.program_id(1)
    b, h, hk, n_ssa, b_ssa, offs_m, offs_d, d_ok, m_ok = _q_block_setup(
        pid_m, pid_bh, NP, BP, Hq, N, D, GROUP, BLOCK_M, BLOCK_D)
    row_mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    q = tl.load(Q + b * sqb + h * sqh + rows * sqn + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows * sdon + offs_d[None, :] * sdod, mask=row_mask, other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * N + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * N + offs_m, mask=m_ok, other=0.0)
    tb = pid_bh // Hq
    th = (pid_bh % Hq) // GROUP
    if TMA:
        k_base = K
        v_base = V
    else:
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_first = pid_m * BLOCK_M
    m_last = tl.minimum(m_first + BLOCK_M, N) - 1
    lo, hi = _key_range(m_first, m_last, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW, BLOCK_N)
    a, bb = _full_key_range(m_first, m_last, lo, hi, NK, KSTRIDE, KOFF, WINDOW, HAS_WINDOW, BLOCK_N)
    args = (q, do, lse, delta, k_base, v_base, offs_m, offs_d, d_ok, skn, skd, svn, svd, N, NK,
            scale, n_ssa, b_ssa, KSTRIDE, KOFF, WINDOW, tb, th)
    dq = _dq_stage(dq, lo, a, *args, TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_N, TMA, BLOCK_D, FAST_LOG2)
    dq = _dq_stage(dq, a, bb, *args, TRANSFORM, HAS_WINDOW, PREC, False, BLOCK_N, TMA, BLOCK_D, FAST_LOG2)
    dq = _dq_stage(dq, bb, hi, *args, TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_N, TMA, BLOCK_D, FAST_LOG2)
    g_s, _g_n, _g_b = grad_consts(scale, n_ssa, b_ssa, TRANSFORM)
    tl.store(DQ + b * sdqb + h * sdqh + rows * sdqn + offs_d[None, :] * sdqd,
             (dq * g_s).to(DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _range_bwd_kernel_dkv(
    Q, K, V, DO, DK, DV, LSE, DELTA, NP, BP, DNB,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod,
    sdks, sdkb, sdkh, sdkn, sdkd,
    sdvs, sdvb, sdvh, sdvn, sdvd,
    Hq, Hkv, N, NK, D, GROUP,
    scale, KSTRIDE, KOFF, WINDOW,
    TRANSFORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr = 0,
    FAST_LOG2: tl.constexpr = 0,
):
    """``TMA``: ``Q``, ``DO`` are rank-4 tensor descriptors (``ops.common.tma``)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)  # over B * Hkv
    pid_s = tl.program_id(2)  # query chunk; DK/DV are then this chunk's partial (split stride sdks/sdvs)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    n_ssa = tl.load(NP).to(tl.float32)
    b_ssa = tl.load(BP).to(tl.float32)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = (offs_n < NK)[:, None] & d_ok[None, :]
    cols = offs_n.to(tl.int64)[:, None]
    k = tl.load(K + b * skb + hk * skh + cols * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # SSA's dn, db partials, summed over each tile's rows as they come (a [BLOCK_M, BLOCK_N]
    # accumulator pair costs 64 registers a thread at 64x64 and spilled on sm_90)
    dn_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    # queries that see some key of this tile: [pos(first), pos(last) + WINDOW)
    n_last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, NK) - 1
    q_lo = ((pid_n * BLOCK_N * KSTRIDE + KOFF) // BLOCK_M) * BLOCK_M
    q_hi = N
    if HAS_WINDOW:
        q_hi = tl.minimum(N, n_last * KSTRIDE + KOFF + WINDOW)
    # this program's chunk: blocks [s*nb // SPLIT, (s+1)*nb // SPLIT) of the range's nb
    # BLOCK_M blocks, so every key tile's work is divided evenly, whatever its length
    # (SPLIT = 1: all of [q_lo, q_hi), the unsplit schedule)
    n_split = tl.num_programs(2)
    nb = tl.maximum(q_hi - q_lo + BLOCK_M - 1, 0) // BLOCK_M
    c_lo = q_lo + (pid_s * nb // n_split) * BLOCK_M
    c_hi = tl.minimum(q_hi, q_lo + ((pid_s + 1) * nb // n_split) * BLOCK_M)
    # inside the chunk: [c_lo, ca) masked, [ca, cb) unmasked, [cb, c_hi) masked
    r_lo, r_hi = _full_query_range(pid_n * BLOCK_N, n_last, NK, N, KSTRIDE, KOFF, WINDOW,
                                   HAS_WINDOW, BLOCK_M, BLOCK_N)
    ca = tl.minimum(tl.maximum(r_lo, c_lo), c_hi)
    cb = tl.maximum(ca, tl.minimum(r_hi, c_hi))
    for g in range(GROUP):
        h = hk * GROUP + g
        bh_q = b * Hq + h
        if TMA:
            q_base = Q
            do_base = DO
        else:
            q_base = Q + b * sqb + h * sqh
            do_base = DO + b * sdob + h * sdoh
        args = (k, v, q_base, do_base, bh_q, LSE, DELTA, offs_n, offs_d, d_ok, sqn, sqd, sdon, sdod, N, NK,
                scale, n_ssa, b_ssa, KSTRIDE, KOFF, WINDOW, pid_bh // Hkv, (hk * GROUP + g).to(tl.int32))
        if TMA:
            dk, dv, dn_acc, db_acc = _dkv_stage(dk, dv, dn_acc, db_acc, c_lo, ca, *args,
                                                TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_M, TMA, BLOCK_D, FAST_LOG2)
            dk, dv, dn_acc, db_acc = _dkv_stage(dk, dv, dn_acc, db_acc, ca, cb, *args,
                                                TRANSFORM, HAS_WINDOW, PREC, False, BLOCK_M, TMA, BLOCK_D, FAST_LOG2)
            dk, dv, dn_acc, db_acc = _dkv_stage(dk, dv, dn_acc, db_acc, cb, c_hi, *args,
                                                TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_M, TMA, BLOCK_D, FAST_LOG2)
        else:  # pointers: one masked loop (three loops of pointer tiles spill, sm_90 compile)
            dk, dv, dn_acc, db_acc = _dkv_stage(dk, dv, dn_acc, db_acc, c_lo, c_hi, *args,
                                                TRANSFORM, HAS_WINDOW, PREC, True, BLOCK_M, TMA, BLOCK_D, FAST_LOG2)

    # stored even for an empty chunk (zeros): the partial buffer is never cleared
    s64 = pid_s.to(tl.int64)
    g_s, g_n, g_b = grad_consts(scale, n_ssa, b_ssa, TRANSFORM)
    tl.store(DK + s64 * sdks + b * sdkb + hk * sdkh + cols * sdkn + offs_d[None, :] * sdkd,
             (dk * g_s).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + s64 * sdvs + b * sdvb + hk * sdvh + cols * sdvn + offs_d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)
    if TRANSFORM == 1:
        pid = (s64 * tl.num_programs(1) + pid_bh) * tl.num_programs(0) + pid_n
        tl.store(DNB + 2 * pid, tl.sum(dn_acc, 0) * g_n)
        tl.store(DNB + 2 * pid + 1, tl.sum(db_acc, 0) * g_b)


# ----------------------------------------------------------------------------- launchers
#: tuning hook: ``{"fwd" | "bwd": (BLOCK_M, BLOCK_N, num_warps, num_stages)}`` overrides
#: the defaults below for both branches, ``"fwd:compressed"``, ``"bwd:window"`` etc. for
#: one (BLOCK_* must be powers of two >= 16; "bwd" is the dQ and the dK/dV kernel),
#: ``{"dkv_split": S}`` (S >= 1; 0 or absent: automatic) forces the dK/dV query split and
#: ``{"tma": 0 | 1}`` forces the tensor-descriptor path off or on (where the layout allows)
TILE_OVERRIDE: dict = {}

#: the Hopper path (tensor descriptors for the tiles the loops stream: K/V in the forward
#: and dQ kernels, Q/dO in the dK/dV kernel), taken on sm_90+ for calls of at least
#: ``tma.MIN_SCORES`` scores whose tensors the TMA can address, by kernel up to these head
#: dims; ``NEMO_SSA_TMA=0`` or ``TILE_OVERRIDE["tma"] = 0`` turns it off
RANGE_TMA = 1
#: the dQ kernel's descriptor build faults at D128 on an H200 under Triton 3.6 ("unspecified
#: launch failure"; D64 and the other two kernels at D128 run and match the pointer path),
#: so above D64 it keeps pointers -- a hard limit that ``TILE_OVERRIDE["tma"]`` cannot lift
TMA_MAX_HEAD_DIM = {"fwd": MAX_HEAD_DIM, "dq": 64, "dkv": MAX_HEAD_DIM}


def _tma(kind: str, d: int, *tensors: torch.Tensor, scores: int) -> int:
    """The ``TMA`` constexpr of kernel ``kind`` ("fwd" | "dq" | "dkv") for one call, noted
    through ``ops.common.dispatch`` once per distinct call."""
    forced = TILE_OVERRIDE.get("tma")
    if d > TMA_MAX_HEAD_DIM[kind]:
        tma, why = 0, f"D{d} is above the {kind} kernel's TMA limit (D{TMA_MAX_HEAD_DIM[kind]})"
    elif forced is not None:
        tma, why = use_tma(int(forced), False, *tensors), f"TILE_OVERRIDE['tma'] = {forced}"
    else:
        tma = use_tma(RANGE_TMA, False, *tensors, scores=scores)
        why = ("sm_90+, enough scores, addressable tensors" if tma else
               "the device, the call's size or its layout cannot take tensor descriptors")
    op = f"nsa.range.{kind}"
    note((op, f"D{d}", tensors[0].dtype), op, "triton-tma" if tma else "triton-pointers", why)
    return tma

# dK/dV split heuristic (``_dkv_split``); the numbers are starting points for a sweep
# (``benchmarks/bench_nsa.py --dkv-split``), not measured optima
DKV_PROGRAMS_PER_SM = 4          # programs to aim for per SM (no window): waves hide the causal imbalance
DKV_MAX_ITERS = 1024             # query-block iterations (over the GROUP heads) one program may run
DKV_MIN_CHUNK_BLOCKS = 4         # BLOCK_M blocks a chunk of the longest range keeps at least
DKV_MAX_SPLIT = 16
DKV_PARTIAL_BYTES = 512 << 20    # fp32 dk + dv partials of all chunks together


def _blocks(d: int, kind: str, branch: Optional[str] = None, tma: bool = True,
            ssa: bool = False) -> Tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kind`` ("fwd" | "bwd") for ``branch``
    ("compressed" | "window"; None: the compressed row) on the Hopper path (``tma``) or the
    pointer kernels, for the SSA transform (``ssa``) or softmax. Small tiles in the interpreter."""
    for key in (f"{kind}:{branch}", kind):
        if key in TILE_OVERRIDE:
            return TILE_OVERRIDE[key]
    if is_interpreter():
        return 16, 16, 1, 1
    # measured winners at the NSA paper's shape (D64 / D128, GQA 16, N = 64K; H200) with the
    # masked / unmasked tile split: docs/results/2026-11-26-nsa-range. The compressed forward
    # wants wide query tiles (every query tile sees many whole key tiles); 64 x 64 tiles
    # with 3 stages win both backwards; the pointer kernels keep the window forward narrow
    if kind == "fwd":
        if d > 64:
            return (64, 64, 4, 3) if tma else (64, 32, 4, 2)
        if branch == "window":
            return (64, 64, 4, 3) if tma else (64, 32, 4, 3)
        return (128, 64, 4, 3)
    if ssa and d <= 64:
        # SSA's backward tile holds z2, smag, rinv, p, dz besides softmax's: 64 x 64 spilled
        # (84.8 against 131.5 ms for the compressed branch at 64K, same record)
        return (32, 64, 4, 3)
    return (64, 64, 4, 3) if d <= 64 else (64, 64, 4, 2)


def _dkv_split(n_tok: int, nk: int, bsz: int, hkv: int, group: int, d: int, block_m: int, block_n: int,
               kstride: int, window: Optional[int], n_sm: int = 132, override: int = 0) -> int:
    """Number of query chunks ``SPLIT`` the dK/dV kernel cuts each key tile's work into.

    Without a split the grid is ``cdiv(nk, block_n) * bsz * hkv`` programs, and the program of
    key tile ``i`` runs ``group`` x (query blocks that see tile ``i``) iterations: for the
    compressed branch at 64K (nk = 4095, block_n = 64, B*Hkv = 4, group 16, block_m 128)
    that is 256 programs, the first running 16 x 512 iterations and the last a few -- too
    few programs for 132 SMs, and a tail of long ones. ``SPLIT`` is the largest of

    * bounded work: ``ceil(group * longest / DKV_MAX_ITERS)``, ``longest`` = the query
      blocks of the longest key tile's range (all ``cdiv(n_tok, block_m)`` without a
      window; about ``(block_n * kstride + window) / block_m`` with one);
    * without a window only, enough programs: ``ceil(DKV_PROGRAMS_PER_SM * n_sm / programs)``.
      There the ranges shrink from all queries to a few across the key tiles, so a grid
      of a wave or two ends on its longest programs; a window gives every key tile the
      same short range, and a grid of a wave or so of them gains nothing from partials;

    then capped by ``DKV_MAX_SPLIT``, by ``longest // DKV_MIN_CHUNK_BLOCKS`` (a chunk of
    a few blocks at least: each program reloads its key tile and stores its partials) and
    by memory (the fp32 dk + dv partials, ``SPLIT * 2 * bsz*hkv*nk*d * 4`` bytes, within
    ``DKV_PARTIAL_BYTES``). The window branch at NSA's sizes and small problems get 1,
    i.e. no partial buffer. ``override > 0`` forces ``SPLIT`` (clamped to
    ``[1, cdiv(n_tok, block_m)]``: never more chunks than query blocks).
    """
    q_blocks = max(1, -(-n_tok // block_m))
    if override > 0:
        return max(1, min(int(override), q_blocks))
    if nk <= 0:
        return 1
    if window:
        longest = min(q_blocks, -(-(block_n * kstride + window) // block_m) + 1)
    else:
        longest = q_blocks
    split = -(-group * longest // DKV_MAX_ITERS)
    if not window:
        programs = -(-nk // block_n) * bsz * hkv
        split = max(split, -(-DKV_PROGRAMS_PER_SM * n_sm // programs))
    per_split_bytes = 2 * bsz * hkv * nk * d * 4
    split = min(split, DKV_MAX_SPLIT, longest // DKV_MIN_CHUNK_BLOCKS, DKV_PARTIAL_BYTES // per_split_bytes)
    return max(1, split)


def _range_fwd(q, k, v, n_t, b_t, tid, scale, kstride, koff, window):
    bsz, hq, n_tok, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(bsz, hq, n_tok, device=q.device, dtype=torch.float32)
    if nk == 0:  # no key at all (compressed branch with N < l): zero output, empty rows
        o.zero_()
        lse.fill_(math.inf)
        return o, lse
    tma = _tma("fwd", d, k, v, scores=bsz * hq * n_tok * nk)
    bm, bn, warps, stages = _blocks(d, "fwd", "window" if window else "compressed", bool(tma))
    grid = (triton.cdiv(n_tok, bm), bsz * hq)
    kk, vv = (descriptor(k, bn, block_d(d)), descriptor(v, bn, block_d(d))) if tma else (k, v)
    _range_fwd_kernel[grid](
        q, kk, vv, o, lse, n_t, b_t,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        hq, n_tok, nk, d, hq // hkv,
        scale, kstride, koff, window if window else 0,
        TRANSFORM=tid, HAS_WINDOW=bool(window), PREC=dot_precision(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d(d), num_warps=warps, num_stages=stages, TMA=tma,
        FAST_LOG2=fast_log2(tid, q.device),
    )
    return o, lse


def _range_bwd(q, k, v, o, lse, do, n_t, b_t, tid, scale, kstride, koff, window):
    bsz, hq, n_tok, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dq = torch.empty_like(q)
    if nk == 0:
        dnb = torch.zeros(2, device=q.device, dtype=torch.float32)
        return dq.zero_(), torch.empty_like(k), torch.empty_like(v), dnb
    delta = row_delta(o, do)  # [B, Hq, N] fp32
    bm, bn, warps, stages = _blocks(d, "bwd", "window" if window else "compressed", ssa=tid == 1)
    tma = _tma("dq", d, k, v, scores=bsz * hq * n_tok * nk)
    common = dict(TRANSFORM=tid, HAS_WINDOW=bool(window), PREC=dot_precision(q.dtype),
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d(d), num_warps=warps, num_stages=stages, TMA=tma,
                  FAST_LOG2=fast_log2(tid, q.device))
    kk, vv = (descriptor(k, bn, block_d(d)), descriptor(v, bn, block_d(d))) if tma else (k, v)
    _range_bwd_kernel_dq[(triton.cdiv(n_tok, bm), bsz * hq)](
        q, kk, vv, do, dq, lse, delta, n_t, b_t,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        hq, n_tok, nk, d, hq // hkv, scale, kstride, koff, window if window else 0, **common,
    )
    split = _dkv_split(n_tok, nk, bsz, hkv, hq // hkv, d, bm, bn, kstride, window,
                       n_sm=target(q.device).sms or 132,
                       override=int(TILE_OVERRIDE.get("dkv_split", 0)))
    common["TMA"] = _tma("dkv", d, q, do, scores=bsz * hq * n_tok * nk)
    dk, dv, dnb = _range_bwd_dkv(q, k, v, do, lse, delta, n_t, b_t, scale, kstride, koff, window, split, common)
    if split > 1:  # fixed-order fp32 sum over the chunks (deterministic), then k's dtype
        dk = dk.sum(0).to(k.dtype)
        dv = dv.sum(0).to(v.dtype)
    return dq, dk, dv, dnb.sum(0, dtype=torch.float64)


def _range_bwd_dkv(q, k, v, do, lse, delta, n_t, b_t, scale, kstride, koff, window, split, common):
    """The dK/dV kernel on the grid ``(cdiv(NK, BLOCK_N), B*Hkv, split)``: ``(dk, dv, dnb)``.

    ``split == 1``: ``dk, dv`` in k's dtype; ``split > 1``: their fp32 partials
    ``[split, B, Hkv, NK, D]``, one slot per query chunk, for the caller to sum.
    ``dnb [programs, 2]``: SSA's per-program dn, db partials (zeros for softmax).
    """
    bsz, hq, n_tok, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(nk, common["BLOCK_N"]), bsz * hkv, split)
    if split == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        sk, sv = (0, *dk.stride()), (0, *dv.stride())
    else:  # every slot is written (zeros for an empty chunk), so no clearing
        dk = torch.empty(split, *k.shape, device=k.device, dtype=torch.float32)
        dv = torch.empty(split, *v.shape, device=v.device, dtype=torch.float32)
        sk, sv = dk.stride(), dv.stride()
    dnb = torch.zeros(grid[0] * grid[1] * grid[2], 2, device=q.device, dtype=torch.float32)
    qq, dd = q, do
    if common["TMA"]:
        qq, dd = descriptor(q, common["BLOCK_M"], common["BLOCK_D"]), descriptor(do, common["BLOCK_M"], common["BLOCK_D"])
    _range_bwd_kernel_dkv[grid](
        qq, k, v, dd, dk, dv, lse, delta, n_t, b_t, dnb,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *sk, *sv,
        hq, hkv, n_tok, nk, d, hq // hkv, scale, kstride, koff, window if window else 0, **common,
    )
    return dk, dv, dnb


class _BandedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n, b, transform, scale, kstride, koff, window):
        tid, n_t, b_t = ssa_scalars(transform, n, b, q.device)
        o, lse = _range_fwd(q, k, v, n_t, b_t, tid, scale, kstride, koff, window)
        ctx.save_for_backward(q, k, v, o, lse, n_t, b_t)
        ctx.args = (tid, scale, kstride, koff, window)
        ctx.n_meta = None if n is None else (n.shape, n.dtype)
        ctx.b_meta = None if b is None else (b.shape, b.dtype)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, n_t, b_t = ctx.saved_tensors
        tid, scale, kstride, koff, window = ctx.args
        dq, dk, dv, dnb = _range_bwd(q, k, v, o, lse, do.contiguous(), n_t, b_t, tid, scale, kstride, koff, window)
        dn = db = None
        if ctx.n_meta is not None:
            dn = dnb[0].reshape(ctx.n_meta[0]).to(ctx.n_meta[1])
            db = dnb[1].reshape(ctx.b_meta[0]).to(ctx.b_meta[1])
        return dq, dk, dv, dn, db, None, None, None, None, None


def banded_attention(q, k, v, *, kstride: int, koff: int, window: Optional[int], transform="softmax",
                     n=None, b=None, softmax_scale=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention where query ``t`` sees key ``j`` iff ``j*kstride + koff <= t`` and, with a
    window, ``t - (j*kstride + koff) < window``. Returns ``(o, lse)`` (lse: fp32, log2
    domain, ``+inf`` on rows that see nothing; not differentiable).

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, NK, D]`` with ``Hq % Hkv == 0``.
        kstride, koff, window: the visibility rule above (``window=None``: none).
        transform, n, b: ``"softmax"`` or ``"ssa"`` with its ``[1]`` scalars (differentiable).
        softmax_scale: default ``1/sqrt(D)``.
    """
    check_kernel_tensors({"q": q, "k": k, "v": v})
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B,Hq,N,D] and k, v [B,Hkv,NK,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"incompatible q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head dim must match "
                         f"and Hq must be a multiple of Hkv")
    if kstride < 1 or koff < 0 or (window is not None and window < 1):
        raise ValueError(f"need kstride >= 1, koff >= 0, window >= 1 or None; got {kstride}, {koff}, {window}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return _BandedAttention.apply(q, k, v, n, b, transform, scale, int(kstride), int(koff),
                                  None if window is None else int(window))


def window_attention(q, k, v, window: int, *, transform="softmax", n=None, b=None,
                     softmax_scale=None) -> torch.Tensor:
    """Sliding-window causal attention: query ``t`` sees keys ``t-window+1 .. t``."""
    return banded_attention(q, k, v, kstride=1, koff=0, window=window, transform=transform,
                            n=n, b=b, softmax_scale=softmax_scale)[0]


def compressed_attention(q, k_cmp, v_cmp, block_len: int, stride: int, *, transform="softmax",
                         n=None, b=None, softmax_scale=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over compressed blocks; block ``i`` is visible once ``i*stride + block_len - 1 <= t``.

    Returns ``(o, lse)``; ``lse`` (fp32, log2) is what the selection scores need.
    """
    return banded_attention(q, k_cmp, v_cmp, kstride=stride, koff=block_len - 1, window=None,
                            transform=transform, n=n, b=b, softmax_scale=softmax_scale)
