"""Selected-block attention in Triton: KV-block-major for small GQA groups, query-major forward for G >= 16.

Query ``t`` (every head of its GQA group) attends to the tokens of the selection blocks
``block_idx[b, hk, t, :]`` (``-1`` = empty slot), causally (key ``s <= t``).

Why KV-major. Public NSA kernels are query-major: one program loads one query token's
heads ``[G, D]`` and streams its ``top_n`` blocks. That needs ``G >= 16`` heads per
group to fill a tensor-core tile; our model has ``G = 3`` (24 q / 8 kv heads), so those
kernels pad to 16 rows and reload every K/V block once per query. Here the loop is
inverted: a program owns one selection block ``j`` of one kv head and a chunk of up to
``BLOCK_Q`` queries *that selected it*, gathered from an inverted index. K_j, V_j are
loaded once and multiplied by ``BLOCK_Q`` queries x ``G`` heads; the tiles are dense
whatever ``G`` is.

Inverted index (host, torch, no host sync): the ``(t, slot)`` pairs of each
``(b, hk, j)`` sorted by key, cut into chunks of ``BLOCK_Q``; one work item per chunk,
grid sized by an upper bound (empty items exit at once).

Softmax across blocks. A query's row is split over the programs of its ``top_n``
blocks, so the forward runs two passes over the work items:
  1. per (query, head, slot): the block-local log-sum-exp (fp32, log2) -> ``lse_part``;
     the host merges the slots into the row ``lse``;
  2. ``p = exp2(z2 - lse)`` is then exactly normalised, and ``p @ V_j`` is added into
     an fp32 output accumulator with atomics.
Groups of ``G >= 16`` heads (``QMAJOR_MIN_GROUP``; the NSA paper's GQA 16) fill a tile
query-major, so their forward is the public kernels' schedule instead
(``_sel_fwd_qmajor_kernel``): one program per (query, kv head) streams the ``top_n``
blocks with an online softmax -- one pass, no atomics, no inverted index (measured at
N=64K D64 GQA16 on an H200: 10.1 ms against KV-major's 19.3). On sm_90+ (``QMAJOR_TILES``)
the blocks come through TMA tensor descriptors: the slot loop has no branch, so Triton
pipelines the copies into shared memory, and no thread holds a tile of addresses (the
pointer kernel spilled: 103 spill stores at D64, 1,718 at D128) -- 6.7 ms at D64 and 14.2
against 25.9 at D128. Its backward's ``dk, dv`` stay KV-major (it builds the inverted
index itself), and its ``dq`` is query-major (``_sel_bwd_dq_qmajor_kernel``, the forward's
schedule, ``use_qmajor_dq``): each program keeps its token's group rows of ``dq`` in
registers over the ``top_n`` blocks and stores them once. That removes the KV-major
kernel's dq atomics -- one fp32 row of D per (token, head, slot), 4.3G atomics at N=64K
Hq64 D64 -- and the backward at N=64K GQA16 went from 20.7 to 16.7 ms at D64 and from 47.5
to 33.0 at D128 (H100, 2026-11-26-nsa-qmajor-dq).

Backward recomputes ``p`` from ``lse`` (FA2 style, ``delta = rowsum(dO * O)``) and adds
the whole ``dk, dv`` tile of block ``j`` (and, for GQA < 16, the ``dq`` rows) with fp32
atomics. Atomic accumulation makes the fp32 sums order-nondeterministic (differences at
rounding level); the query-major ``dq`` is deterministic. SSA's ``dn, db``: per-item fp32
partials summed on the host.

Layouts: ``q [B, Hq, N, D]``, ``k, v [B, Hkv, N, D]`` (any strides), ``block_idx``
``[B, Hkv, N, top_n]`` int; output ``o`` in q's dtype, plus ``lse [B, Hq, N]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nemo_ssa.ops.common.device import online_softmax_step, tma_tile
from nemo_ssa.ops.common.dispatch import note
from nemo_ssa.ops.common.launch import is_interpreter, next_pow2
from nemo_ssa.ops.common.tma import descriptor, use_tma
from nemo_ssa.ops.common.transforms import grad_consts, score_bwd_parts, score_fwd, transform_consts
from nemo_ssa.ops.nsa._common import block_d, check_kernel_tensors, dot_precision, fast_log2, row_delta, ssa_scalars

__all__ = ["selected_attention", "build_worklist", "WorkList"]

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _item_tiles(ITEMS, TQ, TS, it, NS, Hkv, N, SBLK, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    """Decode work item ``it`` -> (b, hk, rows t [BLOCK_Q], slots, row mask, key positions, key mask)."""
    key = tl.load(ITEMS + 3 * it)
    start = tl.load(ITEMS + 3 * it + 1)
    cnt = tl.load(ITEMS + 3 * it + 2)
    bh = key // NS
    j = key % NS
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_Q)
    r_ok = offs_r < cnt
    t = tl.load(TQ + start.to(tl.int64) + offs_r, mask=r_ok, other=0)
    slot = tl.load(TS + start.to(tl.int64) + offs_r, mask=r_ok, other=0)
    offs_k = j * SBLK + tl.arange(0, BLOCK_S)
    k_ok = (tl.arange(0, BLOCK_S) < SBLK) & (offs_k < N)
    return cnt, b, hk, t, slot, r_ok, offs_k, k_ok


@triton.jit
def _item_kv_setup(K, NP, BP, b, hk, skb, skh, skn, skd, t, r_ok, offs_k, k_ok, D, BLOCK_D: tl.constexpr):
    """The SSA scalars, the item's key tile and the masks/rows shared by its query heads."""
    n_ssa = tl.load(NP).to(tl.float32)
    b_ssa = tl.load(BP).to(tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = k_ok[:, None] & d_ok[None, :]
    keys = offs_k.to(tl.int64)[:, None]
    k = tl.load(K + b * skb + hk * skh + keys * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    valid = r_ok[:, None] & k_ok[None, :] & (offs_k[None, :] <= t[:, None])  # [BLOCK_Q, BLOCK_S]
    rows = t.to(tl.int64)
    row_mask = r_ok[:, None] & d_ok[None, :]
    return n_ssa, b_ssa, offs_d, kv_mask, keys, k, valid, rows, row_mask


@triton.jit
def _sel_fwd_kernel(
    Q, K, V, ITEMS, TQ, TS, LSE_PART, LSE, OACC, NP, BP,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    Hq, Hkv, N, NS, D, GROUP, TOPN,
    scale, SBLK,
    PASS: tl.constexpr, TRANSFORM: tl.constexpr, PREC: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, FAST_LOG2: tl.constexpr = 0,
):
    it = tl.program_id(0).to(tl.int64)
    cnt, b, hk, t, slot, r_ok, offs_k, k_ok = _item_tiles(ITEMS, TQ, TS, it, NS, Hkv, N, SBLK, BLOCK_Q, BLOCK_S)
    if cnt == 0:
        return
    n_ssa, b_ssa, offs_d, kv_mask, keys, k, valid, rows, row_mask = _item_kv_setup(
        K, NP, BP, b, hk, skb, skh, skn, skd, t, r_ok, offs_k, k_ok, D, BLOCK_D)
    if PASS == 1:
        v = tl.load(V + b * svb + hk * svh + keys * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh_q = b * Hq + h
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_Q, BLOCK_S]
        z2 = tl.where(valid, score_fwd(qk, scale, n_ssa, b_ssa, TRANSFORM, FAST_LOG2), float("-inf"))
        if PASS == 0:
            m = tl.max(z2, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            l = tl.sum(tl.exp2(z2 - m_safe[:, None]), 1)
            lse_loc = tl.where(l > 0.0, m_safe + tl.log2(tl.where(l > 0.0, l, 1.0)), float("-inf"))
            tl.store(LSE_PART + (bh_q * N + rows) * TOPN + slot, lse_loc, mask=r_ok)
        else:
            lse = tl.load(LSE + bh_q * N + rows, mask=r_ok, other=float("inf"))
            p = tl.exp2(tl.where(valid, z2 - lse[:, None], float("-inf")))
            contrib = tl.dot(p.to(v.dtype), v, input_precision=PREC)  # [BLOCK_Q, BLOCK_D]
            tl.atomic_add(OACC + (bh_q * N + rows)[:, None] * D + offs_d[None, :], contrib, mask=row_mask, sem="relaxed")


@triton.jit
def _sel_online_step(q, k, v, k_ok, acc, m_i, l_i, scale, n_ssa, b_ssa,
                     TRANSFORM: tl.constexpr, PREC: tl.constexpr, FAST_LOG2: tl.constexpr):
    """One selected block of the query-major forward's online softmax (log2 domain):
    keys where ``k_ok`` is false carry no weight; a row with no key yet keeps ``p = 0``."""
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_G, BLOCK_S]
    z2 = tl.where(k_ok[None, :], score_fwd(qk, scale, n_ssa, b_ssa, TRANSFORM, FAST_LOG2), float("-inf"))
    p, alpha, m_new, l_i = online_softmax_step(z2, m_i, l_i, True)  # no key yet: p = 0, not NaN
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _sel_fwd_qmajor_kernel(
    Q, K, V, IDX, O, LSE, NP, BP,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sib, sih, sin, sis,
    sob, soh, son, sod,
    Hq, Hkv, N, D, GROUP, TOPN,
    scale, SBLK,
    TRANSFORM: tl.constexpr, PREC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, FAST_LOG2: tl.constexpr = 0,
    TMA: tl.constexpr = 0,
):
    """One program per (query token, kv head): the group's query heads are the rows of
    the tile (``BLOCK_G >= GROUP``), its ``TOPN`` selected blocks are streamed with an
    online softmax (log2 domain) -- one pass, no atomics, no inverted index. Writes ``o``
    (q's dtype) and ``lse`` (fp32; ``+inf`` and ``o = 0`` for a row with no key), the same
    contract as the two-pass KV-major forward, which the backward consumes.

    ``TMA``: ``K``, ``V`` are rank-4 tensor descriptors (``ops.common.tma``). The loop then
    has no branch (an empty slot reads block 0 with every key masked), so Triton's
    pipeliner streams the blocks through shared memory ahead of the dots, and no thread
    holds a tile of addresses."""
    t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    n_ssa = tl.load(NP).to(tl.float32)
    b_ssa = tl.load(BP).to(tl.float32)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    heads = hk * GROUP + offs_g.to(tl.int64)
    t64 = t.to(tl.int64)
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + t64 * sqn + offs_d[None, :] * sqd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    idx_row = IDX + b * sib + hk * sih + t64 * sin
    for slot in range(TOPN):
        j = tl.load(idx_row + slot * sis)
        if TMA:  # branch-free: an empty slot (j < 0) reads block 0, every key masked
            jc = tl.maximum(j, 0)
            offs_k = jc * SBLK + offs_s
            k_ok = (offs_s < SBLK) & (offs_k <= t) & (j >= 0)  # rows >= N read as 0
            k = tma_tile(K, b.to(tl.int32), hk.to(tl.int32), jc * SBLK, BLOCK_S, BLOCK_D)
            v = tma_tile(V, b.to(tl.int32), hk.to(tl.int32), jc * SBLK, BLOCK_S, BLOCK_D)
            acc, m_i, l_i = _sel_online_step(q, k, v, k_ok, acc, m_i, l_i, scale, n_ssa, b_ssa,
                                             TRANSFORM, PREC, FAST_LOG2)
        elif j >= 0:
            offs_k = j * SBLK + offs_s
            k_ok = (offs_s < SBLK) & (offs_k < N) & (offs_k <= t)
            keys = offs_k.to(tl.int64)
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(K + b * skb + hk * skh + keys[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(V + b * svb + hk * svh + keys[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
            acc, m_i, l_i = _sel_online_step(q, k, v, k_ok, acc, m_i, l_i, scale, n_ssa, b_ssa,
                                             TRANSFORM, PREC, FAST_LOG2)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    row_mask = g_ok[:, None] & d_ok[None, :]
    tl.store(O + b * sob + heads[:, None] * soh + t64 * son + offs_d[None, :] * sod, o.to(O.dtype.element_ty),
             mask=row_mask)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + (b * Hq + heads) * N + t64, lse, mask=g_ok)


@triton.jit
def _sel_bwd_kernel(
    Q, K, V, DO, ITEMS, TQ, TS, LSE, DELTA, DQACC, DKACC, DVACC, NP, BP, DNB,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod,
    Hq, Hkv, N, NS, D, GROUP,
    scale, SBLK,
    TRANSFORM: tl.constexpr, PREC: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, FAST_LOG2: tl.constexpr = 0,
    HAS_DQ: tl.constexpr = 1,
):
    """KV-major backward: ``dk, dv`` of the item's block (fp32 atomics) and SSA's ``dn, db``
    partials; with ``HAS_DQ`` also the ``dq`` rows of its queries (fp32 atomics), without it
    ``dq`` comes from the query-major ``_sel_bwd_dq_qmajor_kernel``."""
    it = tl.program_id(0).to(tl.int64)
    cnt, b, hk, t, slot, r_ok, offs_k, k_ok = _item_tiles(ITEMS, TQ, TS, it, NS, Hkv, N, SBLK, BLOCK_Q, BLOCK_S)
    if cnt == 0:
        return
    n_ssa, b_ssa, offs_d, kv_mask, keys, k, valid, rows, row_mask = _item_kv_setup(
        K, NP, BP, b, hk, skb, skh, skn, skd, t, r_ok, offs_k, k_ok, D, BLOCK_D)
    # one log2 and one reciprocal per score (score_bwd_parts); the constant factors g_s,
    # g_n, g_b (grad_consts) once per tile
    c0, c1 = transform_consts(scale, n_ssa, b_ssa, TRANSFORM)
    g_s, g_n, g_b = grad_consts(scale, n_ssa, b_ssa, TRANSFORM)
    v = tl.load(V + b * svb + hk * svh + keys * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    dn_acc = tl.zeros([BLOCK_Q, BLOCK_S], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_Q, BLOCK_S], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh_q = b * Hq + h
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdon + offs_d[None, :] * sdod, mask=row_mask, other=0.0)
        lse = tl.load(LSE + bh_q * N + rows, mask=r_ok, other=float("inf"))
        delta = tl.load(DELTA + bh_q * N + rows, mask=r_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_Q, BLOCK_S]
        z2, smag, rinv = score_bwd_parts(qk, c0, c1, TRANSFORM, FAST_LOG2)
        p = tl.exp2(tl.where(valid, z2 - lse[:, None], float("-inf")))  # masked exponent: no inf
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        dz = p * (dp - delta[:, None])
        ds = dz  # dL/dqk / g_s
        if TRANSFORM == 1:
            ds = dz * rinv
        if HAS_DQ:
            dq = tl.dot(ds.to(k.dtype), k, input_precision=PREC) * g_s  # [BLOCK_Q, BLOCK_D]
            tl.atomic_add(DQACC + (bh_q * N + rows)[:, None] * D + offs_d[None, :], dq, mask=row_mask, sem="relaxed")
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
        if TRANSFORM == 1:  # dn / g_n and db / g_b terms
            dn_acc += tl.where(valid, dz * smag, 0.0)
            db_acc += tl.where(valid, ds * qk, 0.0)
    kv_rows = (b * Hkv + hk) * N + keys  # fp32 accumulators are contiguous [B, Hkv, N, D]
    tl.atomic_add(DKACC + kv_rows * D + offs_d[None, :], dk * g_s, mask=kv_mask, sem="relaxed")
    tl.atomic_add(DVACC + kv_rows * D + offs_d[None, :], dv, mask=kv_mask, sem="relaxed")
    if TRANSFORM == 1:
        tl.store(DNB + 2 * it, tl.sum(tl.sum(dn_acc, 1), 0) * g_n)
        tl.store(DNB + 2 * it + 1, tl.sum(tl.sum(db_acc, 1), 0) * g_b)


@triton.jit
def _sel_dq_step(q, do, k, v, k_ok, lse, delta, dq, c0, c1,
                 TRANSFORM: tl.constexpr, PREC: tl.constexpr, FAST_LOG2: tl.constexpr):
    """One selected block of the query-major ``dq``: ``dq += dS K`` (``/ g_s``)."""
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_G, BLOCK_S]
    z2, smag, rinv = score_bwd_parts(qk, c0, c1, TRANSFORM, FAST_LOG2)
    p = tl.exp2(tl.where(k_ok[None, :], z2 - lse[:, None], float("-inf")))
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    if TRANSFORM == 1:
        ds = ds * rinv
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)


@triton.jit
def _sel_bwd_dq_qmajor_kernel(
    Q, K, V, DO, IDX, LSE, DELTA, DQ, NP, BP,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod,
    sib, sih, sin, sis,
    sdqb, sdqh, sdqn, sdqd,
    Hq, Hkv, N, D, GROUP, TOPN,
    scale, SBLK,
    TRANSFORM: tl.constexpr, PREC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, FAST_LOG2: tl.constexpr = 0,
    TMA: tl.constexpr = 0,
):
    """``dq`` query-major, the forward's schedule: one program per (query token, kv head)
    holds the group's ``dq`` rows ``[BLOCK_G, D]`` in fp32 registers over the token's
    ``TOPN`` blocks and stores them once, in ``dq``'s dtype -- no atomics, deterministic.
    ``p`` is recomputed from the forward's ``lse`` (a row with no key has ``lse = +inf``,
    ``p = 0``). ``TMA``: K, V through rank-4 tensor descriptors, branch-free as in
    ``_sel_fwd_qmajor_kernel``."""
    t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    n_ssa = tl.load(NP).to(tl.float32)
    b_ssa = tl.load(BP).to(tl.float32)
    c0, c1 = transform_consts(scale, n_ssa, b_ssa, TRANSFORM)
    g_s, g_n, g_b = grad_consts(scale, n_ssa, b_ssa, TRANSFORM)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    heads = hk * GROUP + offs_g.to(tl.int64)
    t64 = t.to(tl.int64)
    row_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + t64 * sqn + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
    do = tl.load(DO + b * sdob + heads[:, None] * sdoh + t64 * sdon + offs_d[None, :] * sdod, mask=row_mask,
                 other=0.0)
    rows = (b * Hq + heads) * N + t64
    lse = tl.load(LSE + rows, mask=g_ok, other=float("inf"))
    delta = tl.load(DELTA + rows, mask=g_ok, other=0.0)
    offs_s = tl.arange(0, BLOCK_S)
    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    idx_row = IDX + b * sib + hk * sih + t64 * sin
    for slot in range(TOPN):
        j = tl.load(idx_row + slot * sis)
        if TMA:  # branch-free: an empty slot (j < 0) reads block 0, every key masked
            jc = tl.maximum(j, 0)
            k_ok = (offs_s < SBLK) & (jc * SBLK + offs_s <= t) & (j >= 0)  # rows >= N read as 0
            k = tma_tile(K, b.to(tl.int32), hk.to(tl.int32), jc * SBLK, BLOCK_S, BLOCK_D)
            v = tma_tile(V, b.to(tl.int32), hk.to(tl.int32), jc * SBLK, BLOCK_S, BLOCK_D)
            dq = _sel_dq_step(q, do, k, v, k_ok, lse, delta, dq, c0, c1, TRANSFORM, PREC, FAST_LOG2)
        elif j >= 0:
            offs_k = j * SBLK + offs_s
            k_ok = (offs_s < SBLK) & (offs_k < N) & (offs_k <= t)
            keys = offs_k.to(tl.int64)
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(K + b * skb + hk * skh + keys[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(V + b * svb + hk * svh + keys[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
            dq = _sel_dq_step(q, do, k, v, k_ok, lse, delta, dq, c0, c1, TRANSFORM, PREC, FAST_LOG2)
    tl.store(DQ + b * sdqb + heads[:, None] * sdqh + t64 * sdqn + offs_d[None, :] * sdqd,
             (dq * g_s).to(DQ.dtype.element_ty), mask=row_mask)


# ---------------------------------------------------------------------------- work list
class WorkList(NamedTuple):
    items: torch.Tensor  # [U, 3] int32: (b*Hkv*NS + hk*NS + j, start in tq/ts, count <= BLOCK_Q)
    tq: torch.Tensor  # [P] int32 query position of each sorted (query, slot) pair
    ts: torch.Tensor  # [P] int32 slot of each pair
    block_q: int


def build_worklist(block_idx: torch.Tensor, n_select_blocks: int, block_q: int) -> WorkList:
    """Invert ``block_idx [B, Hkv, N, top_n]`` into per-block query chunks (no host sync).

    Pairs are sorted by (b, hk, j) with a stable sort, so each block's queries stay in
    ascending ``t`` order (neighbouring rows share cache lines). The grid is the upper
    bound ``ceil(P / block_q) + B*Hkv*NS`` items; items past the real count have count 0.
    """
    bsz, hkv, n_tok, top_n = block_idx.shape
    dev = block_idx.device
    nb = bsz * hkv * n_select_blocks
    flat = block_idx.reshape(bsz * hkv, n_tok * top_n).long()
    bh = torch.arange(bsz * hkv, device=dev)[:, None]
    key = torch.where(flat >= 0, bh * n_select_blocks + flat, torch.full_like(flat, nb)).reshape(-1)
    _, order = torch.sort(key, stable=True)
    pair = order % (n_tok * top_n)
    tq = (pair // top_n).to(torch.int32)
    ts = (pair % top_n).to(torch.int32)
    counts = torch.bincount(key, minlength=nb + 1)[:nb]
    starts = torch.cumsum(counts, 0) - counts
    nchunk = (counts + block_q - 1) // block_q
    cum = torch.cumsum(nchunk, 0)
    upper = triton.cdiv(key.numel(), block_q) + nb
    item = torch.arange(upper, device=dev)
    kk = torch.searchsorted(cum, item, right=True)  # block of each item (nb = past the end)
    valid = kk < nb
    kc = kk.clamp(max=nb - 1)
    chunk = item - (cum[kc] - nchunk[kc])
    start = starts[kc] + chunk * block_q
    cnt = torch.where(valid, (counts[kc] - chunk * block_q).clamp(0, block_q), torch.zeros_like(kk))
    items = torch.stack([kc, start, cnt], dim=1).to(torch.int32).contiguous()
    return WorkList(items, tq.contiguous(), ts.contiguous(), block_q)


# ----------------------------------------------------------------------------- launchers
#: tuning hook: ``{"block_q": int, "num_warps": int, "num_stages": int}`` (KV-major kernels),
#: ``"qmajor"`` (bool: force the query-major forward on or off), ``"qmajor_tma"``,
#: ``"qmajor_warps"`` and ``"qmajor_stages"`` (its tiles); ``"qmajor_dq"`` (bool: the
#: backward's dq query-major or by atomics) and ``"qmajor_dq_tma"``, ``"qmajor_dq_warps"``,
#: ``"qmajor_dq_stages"`` override the defaults
TILE_OVERRIDE: dict = {}


def _num_warps() -> int:
    return 1 if is_interpreter() else TILE_OVERRIDE.get("num_warps", 4)


def _block_q(d: int, tid: int, qmajor: bool) -> int:
    """Queries per KV-major work item. Under the query-major forward the backward builds
    its own items, and SSA takes 32 rows there: at 64 its backward spills (387 spill
    stores on sm_90) and ran 35.7 ms against 21.7 (D64 GQA16 N=64K, H200,
    2026-11-26-nsa-selected). Where the KV-major forward shares its items with the
    backward (GQA < 16), 64 rows up to D64 stay for both transforms: SSA at GQA 3, N=32K,
    fwd+bwd 6.9 against 10.5 ms at 32 rows (D32) and 11.3 against 10.4 (D64), forward
    3.7 against 4.7 (D64). Softmax: 64 up to D64 (18.0 ms, the fastest of 64/32 rows x
    4/8 warps x 1-3 stages at D64 GQA16), 32 above."""
    if "block_q" in TILE_OVERRIDE:
        return TILE_OVERRIDE["block_q"]
    if is_interpreter():
        return 16
    if tid == 1 and qmajor:
        return 32
    return 64 if d <= 64 else 32


def _sel_fwd(q, k, v, wl: WorkList, n_t, b_t, tid, scale, sblk, ns, top_n):
    bsz, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    lse_part = torch.full((bsz, hq, n_tok, top_n), -math.inf, device=q.device, dtype=torch.float32)
    lse = torch.empty(bsz, hq, n_tok, device=q.device, dtype=torch.float32)  # filled after pass 0
    oacc = torch.zeros(bsz, hq, n_tok, d, device=q.device, dtype=torch.float32)
    grid = (wl.items.shape[0],)
    args = lambda: (  # noqa: E731
        q, k, v, wl.items, wl.tq, wl.ts, lse_part, lse, oacc, n_t, b_t,
        *q.stride(), *k.stride(), *v.stride(),
        hq, hkv, n_tok, ns, d, hq // hkv, top_n, scale, sblk,
    )
    meta = dict(TRANSFORM=tid, PREC=dot_precision(q.dtype), BLOCK_Q=wl.block_q,
                BLOCK_S=max(16, next_pow2(sblk)), BLOCK_D=block_d(d), num_warps=_num_warps(),
                FAST_LOG2=fast_log2(tid, q.device))
    _sel_fwd_kernel[grid](*args(), PASS=0, **meta)
    # merge the per-slot log-sum-exps (log2 domain); a row with no block gets +inf (p = 0)
    merged = torch.logsumexp(lse_part * LN2, dim=-1) / LN2
    lse.copy_(torch.where(torch.isneginf(merged), torch.full_like(merged, math.inf), merged))
    _sel_fwd_kernel[grid](*args(), PASS=1, **meta)
    return oacc.to(q.dtype), lse


#: GQA groups at least this large take the query-major forward (the group's heads fill
#: the rows of a tensor-core tile); smaller groups the KV-major two-pass forward
QMAJOR_MIN_GROUP = 16
#: query-major forward tiles, by head dim bound: ``(tma, num_warps, num_stages)``. K/V
#: through descriptors, one warp, two stages at N=64K GQA16 (H200, 2026-11-26-nsa-selected):
#: D64 6.68 ms against the pointer kernel's 10.0 (one warp; 2 warps 7.36, 4 warps 9.0 with
#: descriptors), D128 14.2 against 25.9; at 16K 1.55 / 2.46 and 3.33 / 6.21. Above D128
#: (not measured) the pointer kernel stays, as before.
QMAJOR_TILES = {64: (1, 1, 2), 128: (1, 1, 2), 256: (0, 1, 3)}
#: the query-major backward dq's tiles, same form. N=64K GQA16 (H100,
#: 2026-11-26-nsa-qmajor-dq, calls 1-2): D64 one warp, 3 stages 8.3 ms (2 stages 8.5, 2
#: warps 8.7, pointers 11.6); D128 two warps, 3 stages 16.6 (2 stages 17.3, 4 warps 16.8,
#: one warp 26.3). Above D128 not measured.
QMAJOR_DQ_TILES = {64: (1, 1, 3), 128: (1, 2, 3), 256: (0, 2, 2)}
#: ``(head dim bound, transform id) -> (block_q, num_warps, num_stages)`` of the KV-major
#: backward without dq (the query-major dq's partner); head dims above the largest bound
#: keep dq in the KV-major kernel (atomics). N=64K GQA16, dq + dK/dV (calls 1-2, against
#: the atomic-dq kernel): softmax D64 64 rows, 4 warps, 3 stages 16.7 ms (20.7); D128 128
#: rows, 8 warps, 2 stages 33.0 (47.5; 64 rows 34.4); SSA D64 32 rows 21.8 (22.8; 64 rows
#: 28.0, spills); SSA D128 128 rows, 8 warps, 2 stages 49.4 (70.6; 32 rows 55.2).
DKV_TILES = {(64, 0): (64, 4, 3), (128, 0): (128, 8, 2), (64, 1): (32, 4, 3), (128, 1): (128, 8, 2)}


def use_qmajor(group: int) -> bool:
    """Which forward a GQA group size takes (``TILE_OVERRIDE["qmajor"]`` forces either)."""
    forced = TILE_OVERRIDE.get("qmajor")
    return bool(forced) if forced is not None else group >= QMAJOR_MIN_GROUP


def _qmajor_reason(group: int) -> str:
    if TILE_OVERRIDE.get("qmajor") is not None:
        return "TILE_OVERRIDE['qmajor']"
    return f"GQA group {group} {'>=' if group >= QMAJOR_MIN_GROUP else '<'} {QMAJOR_MIN_GROUP}"


def _qmajor_tiles(d: int, key: str = "qmajor"):
    """``(tma, num_warps, num_stages)`` of a query-major kernel at head dim ``d`` (``key``
    ``"qmajor"``: the forward, ``"qmajor_dq"``: the backward's dq); ``TILE_OVERRIDE`` keys
    ``<key>_tma``, ``<key>_warps``, ``<key>_stages`` override."""
    table = QMAJOR_TILES if key == "qmajor" else QMAJOR_DQ_TILES
    tma, warps, stages = next(v for bound, v in sorted(table.items()) if d <= bound)
    return (TILE_OVERRIDE.get(f"{key}_tma", tma), TILE_OVERRIDE.get(f"{key}_warps", warps),
            TILE_OVERRIDE.get(f"{key}_stages", stages))


def _sel_fwd_qmajor(q, k, v, block_idx, n_t, b_t, tid, scale, sblk):
    """Query-major forward (``_sel_fwd_qmajor_kernel``): ``(o, lse)``."""
    bsz, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    o = torch.empty_like(q)
    lse = torch.empty(bsz, hq, n_tok, device=q.device, dtype=torch.float32)
    idx = block_idx if block_idx.dtype == torch.int32 else block_idx.to(torch.int32)
    tma, warps, stages = _qmajor_tiles(d)
    if is_interpreter():
        warps = 1
    bs = max(16, next_pow2(sblk))
    tma = use_tma(tma, False, k, v)
    kk, vv = (descriptor(k, bs, block_d(d)), descriptor(v, bs, block_d(d))) if tma else (k, v)
    _sel_fwd_qmajor_kernel[(n_tok, bsz * hkv)](
        q, kk, vv, idx, o, lse, n_t, b_t,
        *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *o.stride(),
        hq, hkv, n_tok, d, group, idx.shape[-1], scale, sblk,
        TRANSFORM=tid, PREC=dot_precision(q.dtype), BLOCK_G=max(16, next_pow2(group)),
        BLOCK_S=bs, BLOCK_D=block_d(d), num_warps=warps, num_stages=stages,
        FAST_LOG2=fast_log2(tid, q.device), TMA=tma,
    )
    return o, lse


def use_qmajor_dq(group: int, d: int) -> bool:
    """Whether the backward's ``dq`` runs query-major (``_sel_bwd_dq_qmajor_kernel``, no
    atomics) rather than inside the KV-major kernel (``TILE_OVERRIDE["qmajor_dq"]`` forces
    either). The forward's group rule (the group's heads fill the rows of a tile), up to
    the head dims measured (``DKV_TILES``)."""
    forced = TILE_OVERRIDE.get("qmajor_dq")
    if forced is not None:
        return bool(forced)
    return group >= QMAJOR_MIN_GROUP and d <= max(b for b, _ in DKV_TILES)


def _dkv_tiles(d: int, tid: int):
    """``(block_q, num_warps, num_stages)`` of the KV-major backward without ``dq`` (under
    the query-major ``dq``); ``TILE_OVERRIDE`` keys ``block_q``, ``num_warps``,
    ``num_stages`` override."""
    bound = min((b for b, t in DKV_TILES if d <= b and t == tid), default=None)
    bq, warps, stages = DKV_TILES[(bound, tid)] if bound is not None else (32, 4, 3)
    if is_interpreter():
        return TILE_OVERRIDE.get("block_q", 16), 1, TILE_OVERRIDE.get("num_stages", stages)
    bq, warps, stages = (TILE_OVERRIDE.get("block_q", bq), TILE_OVERRIDE.get("num_warps", warps),
                         TILE_OVERRIDE.get("num_stages", stages))
    if d > 64 and bq <= 32 and warps == 4 and stages >= 3:
        # Triton 3.6 compiles this tile to a wrong dK on sm_90 (2026-11-26-nsa-qmajor-dq,
        # call 3: 3-8x eager bf16's error at D128, 32 and 16 rows; the same rows with 2
        # stages or 8 warps, and 64+ rows, are right)
        raise ValueError(f"selected backward without dq: {bq} rows x 4 warps x {stages} stages at head dim {d} "
                         "is miscompiled by Triton 3.6 (wrong dK); use num_stages <= 2, 8 warps or >= 64 rows")
    return bq, warps, stages


def _sel_bwd_dq_qmajor(q, k, v, do, lse, delta, block_idx, n_t, b_t, tid, scale, sblk):
    """Query-major ``dq`` (``_sel_bwd_dq_qmajor_kernel``) in q's dtype."""
    bsz, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    dq = torch.empty(bsz, hq, n_tok, d, device=q.device, dtype=q.dtype)
    idx = block_idx if block_idx.dtype == torch.int32 else block_idx.to(torch.int32)
    tma, warps, stages = _qmajor_tiles(d, "qmajor_dq")
    if is_interpreter():
        warps = 1
    bs = max(16, next_pow2(sblk))
    tma = use_tma(tma, False, k, v)
    kk, vv = (descriptor(k, bs, block_d(d)), descriptor(v, bs, block_d(d))) if tma else (k, v)
    _sel_bwd_dq_qmajor_kernel[(n_tok, bsz * hkv)](
        q, kk, vv, do, idx, lse, delta, dq, n_t, b_t,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *idx.stride(), *dq.stride(),
        hq, hkv, n_tok, d, hq // hkv, idx.shape[-1], scale, sblk,
        TRANSFORM=tid, PREC=dot_precision(q.dtype), BLOCK_G=max(16, next_pow2(hq // hkv)),
        BLOCK_S=bs, BLOCK_D=block_d(d), num_warps=warps, num_stages=stages,
        FAST_LOG2=fast_log2(tid, q.device), TMA=tma,
    )
    return dq


def _launch_sel_bwd(q, k, v, do, lse, delta, dq_acc, wl: WorkList, n_t, b_t, tid, scale, sblk, ns,
                    warps, stages, has_dq):
    """The KV-major backward kernel: fp32 ``dk, dv`` and the ``[items, 2]`` dn/db partials
    (and dq rows added into ``dq_acc`` with ``has_dq``)."""
    bsz, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    dk = torch.zeros(bsz, hkv, n_tok, d, device=q.device, dtype=torch.float32)
    dv = torch.zeros(bsz, hkv, n_tok, d, device=q.device, dtype=torch.float32)
    grid = (wl.items.shape[0],)
    dnb = torch.zeros(grid[0], 2, device=q.device, dtype=torch.float32)
    _sel_bwd_kernel[grid](
        q, k, v, do, wl.items, wl.tq, wl.ts, lse, delta, dq_acc, dk, dv, n_t, b_t, dnb,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        hq, hkv, n_tok, ns, d, hq // hkv, scale, sblk,
        TRANSFORM=tid, PREC=dot_precision(q.dtype), BLOCK_Q=wl.block_q,
        BLOCK_S=max(16, next_pow2(sblk)), BLOCK_D=block_d(d), num_warps=warps,
        num_stages=stages, FAST_LOG2=fast_log2(tid, q.device), HAS_DQ=int(has_dq),
    )
    return dk, dv, dnb


def _sel_bwd(q, k, v, o, lse, do, wl: WorkList, n_t, b_t, tid, scale, sblk, ns):
    """``(dq, dk, dv, [dn, db])`` from the KV-major kernel alone (dq by fp32 atomics)."""
    dq_acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    delta = row_delta(o, do, zero=dq_acc)  # and the dq accumulator zeroed in the same pass
    dk, dv, dnb = _launch_sel_bwd(q, k, v, do, lse, delta, dq_acc, wl, n_t, b_t, tid, scale, sblk, ns,
                                  _num_warps(), TILE_OVERRIDE.get("num_stages", 3), True)
    return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dnb.sum(0, dtype=torch.float64)


def _sel_bwd_split(q, k, v, o, lse, do, block_idx, n_t, b_t, tid, scale, sblk, ns):
    """``(dq, dk, dv, [dn, db])`` with ``dq`` query-major and ``dk, dv`` (and SSA's dn, db)
    from the KV-major kernel without dq -- no dq atomics, dq deterministic. (The two are
    independent; running the dq kernel on a second CUDA stream beside the index sort and
    the KV-major kernel measured no faster: 2026-11-26-nsa-qmajor-dq, call 5.)"""
    bq, warps, stages = _dkv_tiles(q.shape[-1], tid)
    delta = row_delta(o, do)
    dq = _sel_bwd_dq_qmajor(q, k, v, do, lse, delta, block_idx, n_t, b_t, tid, scale, sblk)
    wl = build_worklist(block_idx, ns, bq)
    dk, dv, dnb = _launch_sel_bwd(q, k, v, do, lse, delta, dq, wl, n_t, b_t, tid, scale, sblk, ns,
                                  warps, stages, False)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dnb.sum(0, dtype=torch.float64)


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n, b, block_idx, transform, scale, sblk):
        n_tok = q.shape[2]
        ns = -(-n_tok // sblk)
        tid, n_t, b_t = ssa_scalars(transform, n, b, q.device)
        group = q.shape[1] // k.shape[1]
        qmajor = use_qmajor(group)
        note(("nsa.selected.fwd", transform, f"D{q.shape[-1]}", q.dtype, f"group {group}"),
             "nsa.selected.fwd", "query-major" if qmajor else "kv-major", lambda: _qmajor_reason(group))
        if qmajor:
            # the backward (KV-major) builds its inverted index itself, only when it runs
            o, lse = _sel_fwd_qmajor(q, k, v, block_idx, n_t, b_t, tid, scale, sblk)
            ctx.save_for_backward(q, k, v, o, lse, n_t, b_t, block_idx)
        else:
            wl = build_worklist(block_idx, ns, _block_q(q.shape[-1], tid, False))
            o, lse = _sel_fwd(q, k, v, wl, n_t, b_t, tid, scale, sblk, ns, block_idx.shape[-1])
            ctx.save_for_backward(q, k, v, o, lse, n_t, b_t, wl.items, wl.tq, wl.ts)
        ctx.args = (tid, scale, sblk, ns, _block_q(q.shape[-1], tid, qmajor))
        ctx.n_meta = None if n is None else (n.shape, n.dtype)
        ctx.b_meta = None if b is None else (b.shape, b.dtype)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        tid, scale, sblk, ns, block_q = ctx.args
        if len(ctx.saved_tensors) == 8:  # query-major forward: the index is inverted here
            q, k, v, o, lse, n_t, b_t, block_idx = ctx.saved_tensors
            split = use_qmajor_dq(q.shape[1] // k.shape[1], q.shape[-1])
            note(("nsa.selected.bwd", "ssa" if tid == 1 else "softmax", f"D{q.shape[-1]}", q.dtype,
                  f"group {q.shape[1] // k.shape[1]}"),
                 "nsa.selected.bwd", "dq query-major + dk/dv kv-major" if split else "kv-major, dq by atomics",
                 lambda: "TILE_OVERRIDE['qmajor_dq']" if TILE_OVERRIDE.get("qmajor_dq") is not None else
                 f"group >= {QMAJOR_MIN_GROUP} up to the measured head dims" if split else
                 f"group < {QMAJOR_MIN_GROUP} or head dim beyond the measured tiles")
            if split:  # dq query-major, dk/dv KV-major
                dq, dk, dv, dnb = _sel_bwd_split(q, k, v, o, lse, do.contiguous(), block_idx, n_t, b_t, tid,
                                                 scale, sblk, ns)
            else:
                wl = build_worklist(block_idx, ns, block_q)
                dq, dk, dv, dnb = _sel_bwd(q, k, v, o, lse, do.contiguous(), wl, n_t, b_t, tid, scale, sblk, ns)
        else:
            q, k, v, o, lse, n_t, b_t, items, tq, ts = ctx.saved_tensors
            wl = WorkList(items, tq, ts, block_q)
            dq, dk, dv, dnb = _sel_bwd(q, k, v, o, lse, do.contiguous(), wl, n_t, b_t, tid, scale, sblk, ns)
        dn = db = None
        if ctx.n_meta is not None:
            dn = dnb[0].reshape(ctx.n_meta[0]).to(ctx.n_meta[1])
            db = dnb[1].reshape(ctx.b_meta[0]).to(ctx.b_meta[1])
        return dq, dk, dv, dn, db, None, None, None, None


def selected_attention(q, k, v, block_idx, select_block: int, *, transform="softmax", n=None, b=None,
                       softmax_scale=None, return_lse: bool = False):
    """Causal attention of each query to the tokens of its selected blocks.

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (``Hq % Hkv == 0``).
        block_idx: ``[B, Hkv, N, top_n]`` int selection-block indices (``-1`` = none),
            shared by the query heads of a group; not differentiable. Indices in a row
            must be distinct (as every selection produces); a repeated block would be
            counted twice.
        select_block: ``l'``, tokens per selection block.
        transform, n, b: ``"softmax"`` or ``"ssa"`` with its ``[1]`` scalars.
        softmax_scale: default ``1/sqrt(D)``.
        return_lse: also return the row log-sum-exp (fp32, log2 domain).

    Returns:
        ``o [B, Hq, N, D]`` in q's dtype (and ``lse``). Rows with no block are 0.
    """
    check_kernel_tensors({"q": q, "k": k, "v": v})
    bsz, hq, n_tok, d = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != bsz or k.shape[2] != n_tok or k.shape[3] != d:
        raise ValueError(f"k, v must be [B, Hkv, N, D] matching q {tuple(q.shape)}; got {tuple(k.shape)}, {tuple(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({k.shape[1]})")
    if block_idx.dim() != 4 or tuple(block_idx.shape[:3]) != (bsz, k.shape[1], n_tok) or block_idx.is_floating_point():
        raise ValueError(f"block_idx must be an int tensor [B, Hkv, N, top_n] = [{bsz}, {k.shape[1]}, {n_tok}, n]; "
                         f"got {block_idx.dtype} {tuple(block_idx.shape)}")
    if select_block < 1:
        raise ValueError(f"select_block must be >= 1, got {select_block}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    o, lse = _SelectedAttention.apply(q, k, v, n, b, block_idx.to(q.device), transform, scale, int(select_block))
    return (o, lse) if return_lse else o
