"""ELSA: exact attention as a two-pass parallel scan over key partitions (Triton).

Computes ``o = softmax(z) @ v`` with ``z`` the softmax or SSA transform of
``s = scale * q k^T`` (``nemo_ssa/ops/common/transforms.py``), exactly (no approximation),
as the product of the associative (m, l, acc) monoid (``monoid.py``) over the keys:

* phase 1 (``_elsa_fwd_partial_kernel``): one program per live (query block, key
  partition, batch x query head) folds the partition's key tiles into a register-resident
  partial (m, l, acc) and writes it to global memory in fp32. Causal: the grid holds only
  the live pairs (``(live pairs, B*Hq)``, decoded in closed form; ``ElsaPlan.phase1_grid``),
  so partitions in a block's future are not launched at all;
* phase 2 (``_elsa_merge_kernel``): one program per (row block, batch x query head) merges
  the partials of the live partitions (tree max, then a fixed-order scaled sum) and writes
  ``o`` (input dtype) and the per-row log2 log-sum-exp ``M = m + log2(l)`` (fp32,
  ``+inf`` for rows that see no key).

With one partition (short inputs, ``routing.num_partitions``) phase 2 is only the
finalisation ``acc / l`` and is fused into the phase-1 epilogue (no summary round trip).

``merge_finalize_partials(m, l, acc)`` runs the phase-2 kernel on caller partials
``[P, B, H, S(, D)]`` (any strides) and returns ``(o, M)``: the GPU form of
``finalize_partials(*merge_partials(..., dim=0))`` (``monoid.py``) for context-parallel
attention (one partial per rank) and split-K decode (one partial per key split).

Layouts: ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` with any strides (GQA: query head
``h`` reads kv head ``h // (Hq // Hkv)``); ``o [B, Hq, Sq, D]`` contiguous;
``M [B, Hq, Sq]`` fp32. Causal masking is bottom-right aligned (query ``i`` sees key
``j`` iff ``j <= i + Sk - Sq``); partitions that start after a query block's last visible
key are neither launched nor read. Offsets are int64. Any ``Sq``, ``Sk`` (masked tails),
head dims 16..256 (padded to a power of two and masked). fp32 inputs use IEEE fp32 dots
by default (``fp32_precision``).

Differences from the reference (``nemo_ssa.ops.attention.naive``): no ``keep_mask`` and no
dropout (both refused with ``UnsupportedError``, a ValueError; arguments are checked by
``nemo_ssa.ops.common.validate`` against ``ELSA_CAPS``).

Backward is exact recompute from ``M`` through the shared
``nemo_ssa.ops.common.bwd.attention_bwd`` (``backward.py``). The math, the merge,
causal skipping and the routing rule are in ``README.md``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from nemo_ssa.ops.common.device import online_softmax_step
from nemo_ssa.ops.common.launch import is_interpreter as kernels_interpreted
from nemo_ssa.ops.common.target import target, use_fast_math
from nemo_ssa.ops.common.transforms import score_fwd_hoisted, transform_consts, transform_id
from nemo_ssa.ops.common.validate import (
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    Capabilities,
    check_deterministic,
    validate_attention_args,
)
from nemo_ssa.ops.elsa.backward import elsa_bwd
from nemo_ssa.ops.elsa.routing import ElsaPlan, block_d, make_plan, merge_tiles

__all__ = [
    "elsa_attention",
    "elsa_softmax_attention",
    "elsa_ssa_attention",
    "elsa_forward",
    "merge_finalize_partials",
    "FP32_PRECISIONS",
    "SUPPORTED_DTYPES",
    "kernels_interpreted",
]

FP32_PRECISIONS = ("ieee", "tf32", "tf32x3")
SUPPORTED_DTYPES = KERNEL_DTYPES


# ======================================================================================
# Triton kernels
# ======================================================================================


@triton.jit
def _load_tile(ptrs, rows, LIMIT, dmask, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a ``[R, BLOCK_D]`` tile; rows ``>= LIMIT`` and padded head dims read 0."""
    if ROW_MASK:
        if EVEN_D:
            x = tl.load(ptrs, mask=(rows < LIMIT)[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows < LIMIT)[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return x


@triton.jit
def _elsa_fold(acc, m_i, l_i, q, k_base, v_base, k_offs, v_offs, lo, hi, rows, offs_n, dmask,
               stride_kn, stride_vn, c0, c1, SQ, SK,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               EVEN_D: tl.constexpr, TRANSFORM: tl.constexpr, PRECISION: tl.constexpr,
               FAST_LOG2: tl.constexpr):
    """Fold key tiles ``[lo, hi)`` into the register-resident partial ``(m_i, l_i, acc)``.

    ``k_base``/``v_base`` are scalar pointers at key ``lo`` (advanced by a scalar per tile),
    ``k_offs``/``v_offs`` the loop-invariant int32 in-tile offsets ``[BLOCK_N, BLOCK_D]``:
    no loop-carried 64-bit pointer tiles (they cost ~128 registers per operand).
    ``MASKED`` tiles mask keys ``>= SK`` and (``CAUSAL``) keys in a row's future; a row
    with no visible key in the tile keeps the identity (``m = -inf``, nothing added).
    """
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n  # [BLOCK_N]
        k = _load_tile(k_base + k_offs, cols, SK, dmask, MASKED, EVEN_D)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        z2 = score_fwd_hoisted(qk, c0, c1, TRANSFORM, FAST_LOG2)
        if MASKED:
            valid = cols[None, :] < SK
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + (SK - SQ))
            z2 = tl.where(valid, z2, float("-inf"))
        # a row that has seen no key yet stays the identity
        p, alpha, m_new, l_i = online_softmax_step(z2, m_i, l_i, MASKED)  # p: [BLOCK_M, BLOCK_N]
        v = _load_tile(v_base + v_offs, cols, SK, dmask, MASKED, EVEN_D)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        k_base += BLOCK_N * stride_kn
        v_base += BLOCK_N * stride_vn
    return acc, m_i, l_i


@triton.jit
def _elsa_fwd_partial_kernel(
    Q, K, V, N_PTR, B_PTR,
    O, LSE,  # FINALIZE: outputs [B, Hq, Sq, D] / [B*Hq, Sq]
    MS, LS, ACCS,  # otherwise: summaries [B*Hq, P, Sq] / [B*Hq, P, Sq, D] fp32
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    HQ, GROUP, SQ, SK, N_TILES, NUM_PART, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TRANSFORM: tl.constexpr, CAUSAL: tl.constexpr, FINALIZE: tl.constexpr, COMPACT: tl.constexpr,
    PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
):
    """Phase 1: partial (m, l, acc) of one query block over one key partition.

    Launch order: partition-major, latest (causal: heaviest) query block first, so that
    neighbouring programs share one K/V partition in L2. ``COMPACT`` (causal summaries):
    the 2-D grid ``(live pairs, B*Hq)`` holds only the (query block, partition) pairs
    with a visible key, in that same order; the pair is decoded in closed form (mirrored
    on the host by ``ElsaPlan.first_live_q_block`` / ``phase1_grid``). Otherwise the grid
    is the rectangle ``(query blocks, P, B*Hq)`` and every program has work.
    """
    n_qb = tl.cdiv(SQ, BLOCK_M)
    if COMPACT:
        # partition p is seen by query blocks >= qb0_p, the block of row start_p + SQ - SK
        # (the first row whose causal window reaches p's first key); its programs are
        # qb = n_qb - 1 .. qb0_p. Find p by a scalar prefix sum over the (few) partitions
        # (scalar: a tl.cumsum over a P-vector cost 25-45 more registers on sm_90a).
        pid = tl.program_id(0)
        pid_p = 0
        cum = 0  # programs of partitions 0..p
        before = 0  # programs of partitions < pid_p
        for p in range(0, NUM_PART):
            first_row = ((p * N_TILES) // NUM_PART) * BLOCK_N + (SQ - SK)
            n_live_qb = n_qb - tl.maximum(first_row, 0) // BLOCK_M
            cum += n_live_qb
            done = cum <= pid  # partition p lies entirely before this program
            pid_p += done.to(tl.int32)
            before += tl.where(done, n_live_qb, 0)
        qb = n_qb - 1 - (pid - before)
        pid_bh = tl.program_id(1)
    else:
        pid_p = tl.program_id(1)
        pid_bh = tl.program_id(2)
        qb = n_qb - 1 - tl.program_id(0)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    off_hk = off_h // GROUP

    row0 = qb * BLOCK_M
    if CAUSAL:
        last_row = tl.minimum(row0 + BLOCK_M, SQ) - 1
        kv_hi = tl.minimum(tl.maximum(last_row + (SK - SQ) + 1, 0), SK)  # keys any row sees
        kv_full = tl.minimum(tl.maximum(row0 + (SK - SQ) + 1, 0), SK)  # keys every row sees
    else:
        kv_hi = SK
        kv_full = SK
    # partition pid_p = key tiles [pid_p*T//P, (pid_p+1)*T//P): balanced, tile aligned
    lo = ((pid_p * N_TILES) // NUM_PART) * BLOCK_N
    hi = tl.minimum(((pid_p + 1) * N_TILES // NUM_PART) * BLOCK_N, kv_hi)
    # every launched program has lo < kv_hi, except FINALIZE blocks whose rows see no key
    # (Sq > Sk): they fold nothing and write o = 0, M = +inf

    rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
              + rows.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh  # scalar
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, BLOCK_D] int32
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    q = _load_tile(q_ptrs, rows, SQ, dmask, True, EVEN_D)  # [BLOCK_M, BLOCK_D]

    if TRANSFORM == 1:
        n = tl.load(N_PTR).to(tl.float32)
        b = tl.load(B_PTR).to(tl.float32)
    else:
        n = 0.0
        b = 0.0
    c0, c1 = transform_consts(scale, n, b, TRANSFORM)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # tiles every row of the block sees completely: no mask at all
    mid = lo + (tl.maximum(tl.minimum(hi, kv_full) - lo, 0) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _elsa_fold(acc, m_i, l_i, q, k_base + lo.to(tl.int64) * stride_kn,
                               v_base + lo.to(tl.int64) * stride_vn, k_offs, v_offs, lo, mid, rows, offs_n, dmask,
                               stride_kn, stride_vn, c0, c1, SQ, SK,
                               BLOCK_N, False, CAUSAL, EVEN_D, TRANSFORM, PRECISION, FAST_LOG2)
    # ragged tail / causal diagonal tiles
    acc, m_i, l_i = _elsa_fold(acc, m_i, l_i, q, k_base + mid.to(tl.int64) * stride_kn,
                               v_base + mid.to(tl.int64) * stride_vn, k_offs, v_offs, mid, hi, rows, offs_n, dmask,
                               stride_kn, stride_vn, c0, c1, SQ, SK,
                               BLOCK_N, True, CAUSAL, EVEN_D, TRANSFORM, PRECISION, FAST_LOG2)

    row_ok = rows < SQ
    if FINALIZE:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
        o_ptrs = (O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                  + rows.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
        tl.store(LSE + pid_bh.to(tl.int64) * SQ + rows, lse, mask=row_ok)
    else:
        srow = (pid_bh.to(tl.int64) * NUM_PART + pid_p) * SQ + rows  # [BLOCK_M] int64
        tl.store(MS + srow, m_i, mask=row_ok)
        tl.store(LS + srow, l_i, mask=row_ok)
        tl.store(ACCS + srow[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & dmask[None, :])


@triton.jit
def _elsa_merge_kernel(
    MS, LS, ACCS, O, LSE,
    stride_mp, stride_mb, stride_mh, stride_mm,  # m and l: [P, B, Hq, Sq], any strides
    stride_ap, stride_ab, stride_ah, stride_am, stride_ad,  # acc: [P, B, Hq, Sq, D]
    stride_ob, stride_oh, stride_om, stride_od,
    HQ, SQ, SK, N_TILES, NUM_PART,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, KEY_TILE: tl.constexpr,
    BLOCK_D: tl.constexpr, P_POW2: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Phase 2: merge the partials of all live partitions of a row block -> (o, M).

    The monoid product of P partials has the closed form ``m* = max_p m_p`` (a tree
    reduction over the partition axis), ``l* = sum_p l_p 2^(m_p - m*)``, ``acc*`` likewise
    (a fixed-order sum: deterministic). A partition is read for a row only if it starts
    before the row's last visible key, i.e. only summaries phase 1 wrote.
    ``merge_finalize_partials`` reuses this kernel on caller partials (``CAUSAL=False``,
    one "key" per partition: every partition live).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < SQ
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    if CAUSAL:
        kv_hi_row = tl.minimum(tl.maximum(rows + (SK - SQ) + 1, 0), SK)  # [BLOCK_M]
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, SQ) - 1
        kv_hi_blk = tl.minimum(tl.maximum(last_row + (SK - SQ) + 1, 0), SK)
    else:
        kv_hi_row = tl.full([BLOCK_M], SK, dtype=tl.int32)
        kv_hi_blk = SK

    parts = tl.arange(0, P_POW2)  # [P_POW2]
    starts = ((parts * N_TILES) // NUM_PART) * KEY_TILE
    live = (parts[:, None] < NUM_PART) & (starts[:, None] < kv_hi_row[None, :]) & row_ok[None, :]
    # scalar pointers at (batch, head, partition 0), advanced per partition below; row
    # offsets int64, in-row head-dim offsets int32 (no loop-carried 64-bit pointer tiles)
    ms_p = MS + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
    ls_p = LS + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
    accs_p = ACCS + off_b.to(tl.int64) * stride_ab + off_h.to(tl.int64) * stride_ah
    m_rows = rows.to(tl.int64) * stride_mm  # [BLOCK_M]
    a_rows = rows.to(tl.int64) * stride_am  # [BLOCK_M]
    d_offs = offs_d * stride_ad  # [BLOCK_D]
    m_all = tl.load(ms_p + m_rows[None, :] + parts[:, None].to(tl.int64) * stride_mp,
                    mask=live, other=float("-inf"))  # [P_POW2, BLOCK_M]
    m_star = tl.max(m_all, 0)  # [BLOCK_M]
    m_use = tl.where(m_star == float("-inf"), 0.0, m_star)
    n_live = tl.sum(((parts < NUM_PART) & (starts < kv_hi_blk)).to(tl.int32), 0)

    l_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for p in range(0, n_live):
        start_p = ((p * N_TILES) // NUM_PART) * KEY_TILE
        ok = row_ok & (start_p < kv_hi_row)
        m_p = tl.load(ms_p + m_rows, mask=ok, other=float("-inf"))
        l_p = tl.load(ls_p + m_rows, mask=ok, other=0.0)
        a_p = tl.load(accs_p + a_rows[:, None] + d_offs[None, :],
                      mask=ok[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        f = tl.where(m_p == float("-inf"), 0.0, tl.math.exp2(m_p - m_use))  # identity -> 0
        l_acc += l_p * f
        acc += a_p * f[:, None]
        ms_p += stride_mp
        ls_p += stride_mp
        accs_p += stride_ap

    empty = l_acc == 0.0
    l_safe = tl.where(empty, 1.0, l_acc)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), m_star + tl.log2(l_safe))
    o_ptrs = (O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
              + rows.to(tl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * SQ + rows, lse, mask=row_ok)


# ======================================================================================
# Host launchers
# ======================================================================================


def _precision(dtype: torch.dtype, fp32_precision: str) -> str:
    return fp32_precision if dtype == torch.float32 else "ieee"  # ignored for 16-bit dots


def allocate_summaries(plan: ElsaPlan, B: int, Hq: int, Sq: int, D: int, device, fill=None):
    """fp32 summary buffers ``(m [B*Hq, P, Sq], l, acc [B*Hq, P, Sq, D])`` (``fill``: e.g. NaN)."""
    P = plan.num_partitions
    alloc = torch.empty if fill is None else (lambda *s, **kw: torch.full(s, fill, **kw))
    kw = dict(dtype=torch.float32, device=device)
    return alloc(B * Hq, P, Sq, **kw), alloc(B * Hq, P, Sq, **kw), alloc(B * Hq, P, Sq, D, **kw)


def elsa_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    n: Optional[torch.Tensor], b: Optional[torch.Tensor], *,
    transform: int, causal: bool, scale: float, num_partitions: Optional[int] = None,
    fp32_precision: str = "ieee", two_pass: Optional[bool] = None, summaries=None, out=None,
    fast_log2_override: Optional[bool] = None, _collect: Optional[list] = None,
) -> Tuple[torch.Tensor, torch.Tensor, ElsaPlan, Optional[tuple]]:
    """Launch phase 1 (+ phase 2). No validation (the public functions validate).

    Args:
        transform: ``TRANSFORM`` id (0 softmax, 1 SSA).
        num_partitions: forced partition count (clamped to the key tiles) or None (routing).
        two_pass: None = fuse phase 2 into phase 1 when there is one partition; True =
            always round-trip the summaries through global memory (introspection tests).
        summaries: optional preallocated ``(m, l, acc)`` buffers (``allocate_summaries``).
        out: optional preallocated ``(o, M)`` (tests pass NaN-poisoned ones).
        fast_log2_override: force the ``lg2.approx`` choice (default: ``backward.fast_log2``).
        _collect: a list to receive ``(kernel, grid, args, kwargs)`` instead of launching
            (``aot_check.py`` compiles them offline; works with ``meta`` tensors).

    Returns:
        ``(o [B, Hq, Sq, D] q.dtype, M [B, Hq, Sq] fp32, plan, summaries or None)``.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    plan = make_plan(B, Hq, Sq, Sk, D, q.dtype, q.device, forced=num_partitions)
    # in-tile offsets and per-tile pointer steps are int32 (bases are int64): only absurd
    # strides could overflow them; such inputs are copied once instead
    k, v = (t if max(t.stride(2), 1) * max(plan.block_n, plan.block_d) < 2 ** 30 and t.stride(3) < 2 ** 20
            else t.contiguous() for t in (k, v))
    finalize = plan.num_partitions == 1 and not two_pass
    if out is None:
        o = torch.empty(B, Hq, Sq, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    else:
        o, lse = out
        assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3] and lse.is_contiguous()
    if finalize:
        ms = ls = accs = lse  # unused pointers
        summaries = None
    else:
        if summaries is None:
            summaries = allocate_summaries(plan, B, Hq, Sq, D, q.device)
        ms, ls, accs = summaries
    np_ = n if n is not None else lse  # never read for softmax (constexpr branch)
    bp_ = b if b is not None else lse
    precision = _precision(q.dtype, fp32_precision)
    fast = use_fast_math(q.device) if fast_log2_override is None else bool(fast_log2_override)

    specs = _launch_specs(q, k, v, np_, bp_, o, lse, ms, ls, accs, plan, transform=transform,
                          causal=causal, scale=scale, finalize=finalize, precision=precision, fast=fast)
    if _collect is not None:
        _collect.extend(specs)
        return o, lse, plan, summaries
    run_specs(specs, q.device)
    return o, lse, plan, summaries


def run_specs(specs, device) -> None:
    """Run recorded ``(kernel, grid, args, kwargs)`` launches on ``device`` (``_collect`` output)."""
    with torch.cuda.device(device) if torch.device(device).type == "cuda" else contextlib.nullcontext():
        for kernel, grid, args, kwargs in specs:
            kernel[grid](*args, **kwargs)


def _p_pow2(p: int) -> int:
    return max(2, triton.next_power_of_2(p))


def _launch_specs(q, k, v, np_, bp_, o, lse, ms, ls, accs, plan: ElsaPlan, *, transform, causal, scale,
                  finalize, precision, fast):
    """``[(kernel, grid, args, kwargs)]``: phase 1, then phase 2 unless fused."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    P = plan.num_partitions
    specs = [(
        _elsa_fwd_partial_kernel,
        plan.phase1_grid(B, Hq, Sq, Sk, causal=causal, fused=finalize),
        (q, k, v, np_, bp_, o, lse, ms, ls, accs,
         *q.stride(), *k.stride(), *v.stride(), *o.stride(),
         Hq, Hq // Hkv, Sq, Sk, plan.n_key_tiles, P, float(scale)),
        dict(HEAD_DIM=D, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
             TRANSFORM=int(transform), CAUSAL=bool(causal), FINALIZE=finalize,
             COMPACT=plan.compact_phase1(causal, fused=finalize),
             PRECISION=precision, FAST_LOG2=fast,
             num_warps=plan.num_warps, num_stages=plan.num_stages),
    )]
    if not finalize:
        # summaries [B*Hq, P, Sq(, D)] seen as [P, B, Hq, Sq(, D)] (the merge kernel's layout)
        ms4, ls4 = (t.view(B, Hq, P, Sq).permute(2, 0, 1, 3) for t in (ms, ls))
        accs5 = accs.view(B, Hq, P, Sq, D).permute(2, 0, 1, 3, 4)
        specs.append(_merge_spec(ms4, ls4, accs5, o, lse, sk=Sk, n_tiles=plan.n_key_tiles, key_tile=plan.block_n,
                                 causal=causal, block_m=plan.merge_block_m, num_warps=plan.merge_warps))
    return specs


def _merge_spec(m, l, acc, o, lse, *, sk, n_tiles, key_tile, causal, block_m, num_warps):
    """Phase-2 launch for partials ``m, l [P, B, H, S]`` (same strides), ``acc [P, B, H, S, D]``.

    ``o [B, H, S, D]`` (any strides), ``lse`` contiguous ``[B, H, S]``. Partition ``p`` starts
    at key ``(p * n_tiles // P) * key_tile``; with ``causal`` a row reads only partitions
    starting before its last visible key (``sk`` keys, bottom-right aligned).
    """
    P, B, H, S, D = acc.shape
    assert m.stride() == l.stride() and lse.is_contiguous()
    return (
        _elsa_merge_kernel,
        (triton.cdiv(S, block_m), B * H),
        (m, l, acc, o, lse, *m.stride(), *acc.stride(), *o.stride(), H, S, sk, n_tiles, P),
        dict(HEAD_DIM=D, BLOCK_M=block_m, KEY_TILE=key_tile, BLOCK_D=block_d(D), P_POW2=_p_pow2(P),
             CAUSAL=bool(causal), num_warps=num_warps),
    )


# ======================================================================================
# custom ops + autograd
# ======================================================================================


@torch.library.custom_op("nemo_ssa::elsa_fwd", mutates_args=())
def _elsa_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    n: Optional[torch.Tensor], b: Optional[torch.Tensor],
    transform: str, causal: bool, scale: float, num_partitions: int, fp32_precision: str,
    deterministic: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    # ``deterministic`` is for the backward (kept by setup_context); the forward is a
    # fixed-order scan either way
    o, lse, _, _ = elsa_forward(q, k, v, n, b, transform=transform_id(transform), causal=causal, scale=scale,
                                num_partitions=num_partitions, fp32_precision=fp32_precision)
    return o, lse


@_elsa_fwd_op.register_fake
def _(q, k, v, n, b, transform, causal, scale, num_partitions, fp32_precision, deterministic):
    B, Hq, Sq, D = q.shape
    return q.new_empty(B, Hq, Sq, D), q.new_empty(B, Hq, Sq, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, n, b, transform, causal, scale, num_partitions, fp32_precision, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, n, b)
    ctx.transform, ctx.causal, ctx.scale, ctx.fp32_precision = transform, causal, scale, fp32_precision
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, n, b = ctx.saved_tensors
    dq, dk, dv, dn, db = elsa_bwd(do, q, k, v, o, lse, n, b, ctx.transform, ctx.causal,
                                  ctx.scale, ctx.fp32_precision, ctx.deterministic)
    if ctx.transform == "ssa":
        dn = dn.reshape(n.shape).to(n.dtype) if ctx.needs_input_grad[3] else None
        db = db.reshape(b.shape).to(b.dtype) if ctx.needs_input_grad[4] else None
    else:
        dn = db = None
    return dq, dk, dv, dn, db, None, None, None, None, None, None


_elsa_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ======================================================================================
# Public functions
# ======================================================================================


# no keep_mask and no dropout: the scan's partials carry neither
ELSA_CAPS = Capabilities(name="ELSA", dtypes=SUPPORTED_DTYPES, head_dims=(MIN_HEAD_DIM, MAX_HEAD_DIM),
                         dropout=False, keep_mask=False, triton=True, grid_limit=True)


def _validate_elsa(q, k, v, *, transform, n, b, causal, softmax_scale, keep_mask, dropout_p,
                   num_partitions, fp32_precision) -> None:
    """The shared argument check with ELSA's capabilities, plus ELSA's own options."""
    validate_attention_args(ELSA_CAPS, q, k, v, n, b, transform=transform, causal=causal,
                            softmax_scale=softmax_scale, dropout_p=dropout_p, keep_mask=keep_mask)
    if fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}, got {fp32_precision!r}")
    if num_partitions is not None and (isinstance(num_partitions, bool) or not isinstance(num_partitions, int)
                                       or num_partitions < 1):
        raise ValueError(f"num_partitions must be a positive int or None, got {num_partitions!r}")


def elsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    transform: str = "softmax",
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    num_partitions: Optional[int] = None,
    keep_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    fp32_precision: str = "ieee",
    deterministic: Optional[bool] = None,
) -> torch.Tensor:
    """Exact attention as a two-pass parallel scan (ELSA) with a softmax or SSA transform.

    Args:
        q: ``[B, Hq, Sq, D]``, float16 / bfloat16 / float32, CUDA (CPU only under
            ``TRITON_INTERPRET=1``), any strides; ``16 <= D <= 256``.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0`` (GQA, not expanded).
        transform: ``"softmax"`` or ``"ssa"``.
        n, b: SSA parameters (tensors of shape ``[1]`` or 0-d; may require grad).
        causal: bottom-right-aligned causal mask (``j <= i + Sk - Sq``).
        softmax_scale: multiplies ``q @ k^T`` (> 0); default ``1 / sqrt(D)``.
        num_partitions: force the number of key partitions scanned in parallel (clamped
            to the number of key tiles); None = length-adaptive routing.
        keep_mask, dropout_p: not supported (``UnsupportedError`` unless None / 0.0).
        fp32_precision: dot precision for float32 inputs: ``"ieee"`` (default, exact
            fp32), ``"tf32x3"`` or ``"tf32"``.
        deterministic: True: every gradient bit-identical run to run (the shared
            backward's two-kernel path); None / False: the backward's own choice
            (``ops.common.dispatch.backward_plan``).

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype; rows without a visible key are 0 (zero grads).
    """
    _validate_elsa(q, k, v, transform=transform, n=n, b=b, causal=causal, softmax_scale=softmax_scale,
                   keep_mask=keep_mask, dropout_p=dropout_p, num_partitions=num_partitions,
                   fp32_precision=fp32_precision)
    check_deterministic(deterministic)
    B, Hq, Sq, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    plan = make_plan(B, Hq, Sq, k.shape[2], D, q.dtype, q.device, forced=num_partitions)
    o, _ = _elsa_fwd_op(q, k, v, n, b, transform, bool(causal), scale,
                        plan.num_partitions, fp32_precision, bool(deterministic))
    return o


def elsa_softmax_attention(q, k, v, **kw) -> torch.Tensor:
    """``elsa_attention(q, k, v, transform="softmax", **kw)`` (registry softmax convention)."""
    return elsa_attention(q, k, v, transform="softmax", **kw)


def elsa_ssa_attention(q, k, v, n, b, **kw) -> torch.Tensor:
    """``elsa_attention(q, k, v, transform="ssa", n=n, b=b, **kw)`` (registry SSA convention)."""
    return elsa_attention(q, k, v, transform="ssa", n=n, b=b, **kw)


def merge_finalize_partials(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge stacked (m, l, acc) partials and finalise them with ELSA's phase-2 Triton kernel.

    The kernel equivalent of ``finalize_partials(*merge_partials(m, l, acc, dim=0))``
    (``monoid.py``): what context-parallel attention (one partial per rank, all-gathered)
    and split-K decode (one partial per key split) call to combine their pieces on the GPU.
    Partials are in the log2 domain (``m = max z2``, ``l = sum 2^(z2 - m)``,
    ``acc = sum 2^(z2 - m) v``); identities ``(-inf, 0, 0)`` contribute nothing, and rows
    where every partial is the identity give ``o = 0``, ``M = +inf``. Deterministic:
    fixed partition order. Not differentiable (no autograd).

    Args:
        m, l: ``[P, B, H, S]`` float32, any strides (copied once if ``m`` and ``l`` differ
            in strides), CUDA (CPU only under ``TRITON_INTERPRET=1``).
        acc: ``[P, B, H, S, D]`` float32, any strides, ``1 <= D <= 256``.
        out_dtype: dtype of ``o`` (float32, float16 or bfloat16; e.g. the attention's).

    Returns:
        ``(o [B, H, S, D] out_dtype, M [B, H, S] float32)`` with ``M = m* + log2(l*)`` (the
        per-row log2 log-sum-exp that ``nemo_ssa.ops.common`` backward kernels take).
    """
    for name, t in (("m", m), ("l", l), ("acc", acc)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"merge_finalize_partials: `{name}` must be a float32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    if m.dim() != 4 or l.shape != m.shape or acc.dim() != 5 or acc.shape[:4] != m.shape:
        raise ValueError(f"merge_finalize_partials needs m, l [P, B, H, S] and acc [P, B, H, S, D]; got "
                         f"m {tuple(m.shape)}, l {tuple(l.shape)}, acc {tuple(acc.shape)}")
    P, B, H, S, D = acc.shape
    if min(P, B, H, S, D) < 1:
        raise ValueError(f"merge_finalize_partials: empty partials acc {tuple(acc.shape)}; every dim must be >= 1")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"merge_finalize_partials supports D <= {MAX_HEAD_DIM}, got D={D}")
    if B * H > 65535:
        raise ValueError(f"merge_finalize_partials supports B * H <= 65535 (grid limit), got {B * H}")
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be one of {SUPPORTED_DTYPES}, got {out_dtype}")
    if not (m.device == l.device == acc.device):
        raise ValueError(f"m, l, acc must be on one device, got {m.device}, {l.device}, {acc.device}")
    interp = kernels_interpreted()
    if not target(m.device).runs_kernels:
        raise ValueError(f"the merge kernel runs on CUDA tensors, or on CPU when TRITON_INTERPRET=1 was set "
                         f"before nemo_ssa.ops.elsa was imported (supported here: "
                         f"{'cpu' if interp else 'cuda'}); got device {m.device}")
    if m.stride() != l.stride():
        m, l = m.contiguous(), l.contiguous()
    o = torch.empty(B, H, S, D, dtype=out_dtype, device=m.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=m.device)
    block_m, warps = merge_tiles(D)
    # partition p "starts at key p" of P keys: every partition is live for every row
    spec = _merge_spec(m, l, acc, o, lse, sk=P, n_tiles=P, key_tile=1, causal=False,
                       block_m=block_m, num_warps=warps)
    run_specs([spec], m.device)
    return o, lse
