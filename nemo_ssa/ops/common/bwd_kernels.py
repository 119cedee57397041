"""Triton kernels of the fused attention backward (host driver: ``bwd.attention_bwd``).

Kernels (Triton tutorial 06 structure, FA2 split):

* ``attn_bwd_kernel_dq``: one program per (query block, batch, query head); computes
  ``delta_i = sum_d o_id * do_id`` (fp32) for its rows from the tiles it loads anyway and
  stores it for the dK/dV kernel (launched after it on the same stream) -- no separate
  preprocess launch; loops over key blocks (unmasked blocks first, then the causal
  diagonal band / ragged tail with masks) and accumulates ``dq`` in fp32 registers.
* ``attn_bwd_kernel_dkv``: one program per (key block, batch, kv head); loops over the
  GQA group's query heads and their query blocks, accumulating ``dk``, ``dv`` in
  registers (no atomics: the group sum is a plain loop).
* ``dn``/``db`` come from the dQ kernel, one partial per query row (``M``'s layout),
  using the exact row delta ``sum_j p dp`` (see the README); the host reduces the buffer
  in float64 -- bit-identical run to run.
* Single pass: no dQ kernel. The dK/dV kernel adds ``dq`` into an fp32 buffer with
  atomics, and (SSA, ``cstat`` = the forward's row means ``C_i = sum_j p smag``) writes
  one float64 ``dn`` partial per key block of ``sum_i dz (smag - C_i)``; one tail kernel
  (``attn_bwd_postprocess``) casts ``dq`` and sums the partials (fixed order).
* ``attn_bwd_preprocess``: ``delta`` where it is not fused into the dQ kernel, and the
  zeroing of the single pass's fp32 ``dq`` accumulator.

Per element (``s = scale*qk``, ``t = 1 + b|s|``; ``dp = do . v`` times the dropout
mask / (1 - p_drop)):

    p  = exp2(z2 - M)                      z2 from transforms.score_bwd_parts
    dz = p * (dp - delta)
    dq = scale * sum_j dz * dz/ds * k_j,   dz/ds = n*b/t   (softmax: 1)
    dk = scale * sum_i dz * dz/ds * q_i,   dv = sum_i dropout(p) * do_i
    dn = sum dz * sgn(s) * ln t,           db = sum dz * n * s / t
"""

from __future__ import annotations

import triton
import triton.language as tl

from nemo_ssa.ops.common.launch import presence_flags

from nemo_ssa.ops.common.device import (
    dropout_keep,
    dropout_state,
    kv_range_for_q_block,
    load_kv_tile,
    load_params,
    mask_scores,
    q_range_for_kv_block,
    seq_info,
    tile_ptrs,
    tma_store,
    tma_tile,
)
from nemo_ssa.ops.common.transforms import grad_consts, score_bwd_parts, transform_consts

__all__ = ["attn_bwd_preprocess", "attn_bwd_postprocess", "attn_bwd_kernel_dq", "attn_bwd_kernel_dkv"]


@triton.jit
def _bwd_dq_inner(
    dq, dn_r, db_r, gn_r, gb_r, de_r, q, do, m_row, delta_row,
    k_base, v_base, s_ks, s_kd, s_vs, s_vd, s_ks64, s_vs64,
    offs_m, lo, hi, k_len, off_c,
    c0, c1, seed, rbase, RSTRIDE, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRANSFORM: tl.constexpr, DPARAMS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    DB: tl.constexpr = True, TMA: tl.constexpr = 0, off_z=0, off_h=0,
):
    """Key blocks ``lo .. hi`` of one query block; ``TMA`` as in the forward's inner loop
    (``k_base``/``v_base`` rank-4 descriptors, ``off_z``/``off_h`` batch and kv head)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kT_off = offs_n[None, :] * s_ks + offs_d[:, None] * s_kd  # [BLOCK_D, BLOCK_N]
    vT_off = offs_n[None, :] * s_vs + offs_d[:, None] * s_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if TMA:
            kT = tl.trans(tma_tile(k_base, off_z, off_h, start_n, BLOCK_N, BLOCK_D))
            vT = tl.trans(tma_tile(v_base, off_z, off_h, start_n, BLOCK_N, BLOCK_D))
        else:
            k_ptrs = k_base + start_n * s_ks64 + kT_off  # int64 block base, int32 in-tile offsets
            v_ptrs = v_base + start_n * s_vs64 + vT_off
            kT = load_kv_tile(k_ptrs, cols, k_len, offs_d, HEAD_DIM, BLOCK_D, MASKED, True)
            vT = load_kv_tile(v_ptrs, cols, k_len, offs_d, HEAD_DIM, BLOCK_D, MASKED, True)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        z2, smag, rinv = score_bwd_parts(qk, c0, c1, TRANSFORM, FAST_LOG2)
        if MASKED:
            z2 = mask_scores(z2, offs_m, cols, k_len, off_c, CAUSAL, False)
        p = tl.math.exp2(z2 - m_row[:, None])  # masked or M = +inf rows -> exactly 0
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rbase, offs_m, cols, RSTRIDE, dropout_p, False)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        dz = p * (dp - delta_row[:, None])
        if TRANSFORM == 1:
            ds = dz * rinv
            if DPARAMS:
                # per query row (log2 units for dn, without n*scale for db): the sums with
                # the delta used above, plus what the exact delta = sum_j p dp needs
                dn_r += tl.sum(dz * smag, axis=1)
                gn_r += tl.sum(p * smag, axis=1)
                de_r += tl.sum(p * dp, axis=1)
                if DB:  # b learnable (the pinned policy fixes it: 3 instructions per score saved)
                    db_r += tl.sum(ds * qk, axis=1)
                    gb_r += tl.sum(p * (rinv * qk), axis=1)
        else:
            ds = dz
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=INPUT_PRECISION)
    return dq, dn_r, db_r, gn_r, gb_r, de_r


@presence_flags(VARLEN="CU_Q", ZERO_DQ="DQA")
@triton.jit
def attn_bwd_preprocess(
    O, DO, Delta, CU_Q, DQA,
    s_oz, s_oh, s_os, s_od,
    s_doz, s_doh, s_dos, s_dod,
    s_mz, s_mh, s_ms,
    s_az, s_ah, s_as, s_ad,
    HQ, SEQ_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
    ZERO_DQ: tl.constexpr = False,
):
    """``delta = rowsum(o * do)`` (fp32); ``ZERO_DQ``: also zero the rows of the fp32 dq
    accumulator the single-pass backward adds into (no separate memset launch)."""
    pid_m = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = pid_zh // HQ
    off_h = pid_zh % HQ
    q_start, q_len, _, _ = seq_info(CU_Q, CU_Q, off_z, SEQ_Q, SEQ_Q, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row = (q_start + offs_m).to(tl.int64)
    mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + off_z.to(tl.int64) * s_oz + off_h.to(tl.int64) * s_oh
                + row[:, None] * s_os + offs_d[None, :] * s_od, mask=mask, other=0.0)
    do = tl.load(DO + off_z.to(tl.int64) * s_doz + off_h.to(tl.int64) * s_doh
                 + row[:, None] * s_dos + offs_d[None, :] * s_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # [BLOCK_M]
    tl.store(Delta + off_z.to(tl.int64) * s_mz + off_h.to(tl.int64) * s_mh + row * s_ms,
             delta, mask=offs_m < q_len)
    if ZERO_DQ:
        tl.store(DQA + off_z.to(tl.int64) * s_az + off_h.to(tl.int64) * s_ah
                 + row[:, None] * s_as + offs_d[None, :] * s_ad,
                 tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=mask)


@presence_flags(DPARAMS="DNK")
@triton.jit
def attn_bwd_postprocess(
    DQA, DQ, DNK, NUMEL, NK,
    BLOCK: tl.constexpr, DN_BLOCK: tl.constexpr, CAST: tl.constexpr, DPARAMS: tl.constexpr,
):
    """The single-pass backward's tail in one launch (instead of three torch ops).
    ``DPARAMS``: program 0 sums the ``NK`` float64 ``dn`` partials (one per key
    block, at the start of the fp32 buffer ``DNK``) in a fixed order (bit-identical run to
    run) and stores the fp32 total at ``DNK[2 * NK]``. ``CAST``: every other program casts
    ``BLOCK`` elements of the dense fp32 dq accumulator into ``dq`` (the input dtype; both
    dense with the same strides)."""
    pid = tl.program_id(0)
    if DPARAMS:
        if pid == 0:
            parts = DNK.to(tl.pointer_type(tl.float64), bitcast=True)
            acc = tl.zeros([DN_BLOCK], dtype=tl.float64)
            for start in range(0, NK, DN_BLOCK):
                offs = start + tl.arange(0, DN_BLOCK)
                acc += tl.load(parts + offs, mask=offs < NK, other=0.0)
            tl.store(DNK + 2 * NK, tl.sum(acc, axis=0).to(tl.float32))
        pid_c = pid - 1
    else:
        pid_c = pid
    if CAST:
        if pid_c >= 0:
            offs = pid_c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < NUMEL
            x = tl.load(DQA + offs, mask=mask)
            tl.store(DQ + offs, x.to(DQ.dtype.element_ty), mask=mask)


@presence_flags(VARLEN=("CU_Q", "CU_K"), HAS_DROPOUT="RNG", DPARAMS="DN")
@triton.jit
def attn_bwd_kernel_dq(
    Q, K, V, DO, O, DQ, M, Delta, NP, BP, RNG, CU_Q, CU_K, DN, DBP,
    s_qz, s_qh, s_qs, s_qd,
    s_kz, s_kh, s_ks, s_kd,
    s_vz, s_vh, s_vs, s_vd,
    s_doz, s_doh, s_dos, s_dod,
    s_oz, s_oh, s_os, s_od,
    s_dqz, s_dqh, s_dqs, s_dqd,
    s_mz, s_mh, s_ms,
    HQ, GROUP, SEQ_Q, SEQ_K,
    scale, dropout_p, RNG_SZ, RNG_SH, RNG_SS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSFORM: tl.constexpr, DPARAMS: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    FUSED_DELTA: tl.constexpr = True, DB: tl.constexpr = True, TMA: tl.constexpr = 0,
):
    """``TMA`` (``BwdConfig.tma_dq``; dense inputs only): ``Q``, ``K``, ``V``, ``DO``, ``O``,
    ``DQ`` are rank-4 ``[B, H, S, D]`` tensor descriptors (``ops.common.tma``)."""
    pid_m = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = pid_zh // HQ
    off_hq = pid_zh % HQ
    off_hkv = off_hq // GROUP
    q_start, q_len, k_start, k_len = seq_info(CU_Q, CU_K, off_z, SEQ_Q, SEQ_K, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    z64 = off_z.to(tl.int64)
    hq64 = off_hq.to(tl.int64)
    hkv64 = off_hkv.to(tl.int64)
    zero64 = z64 * 0  # promotes strides to int64 for block-base offsets
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row = q_start + start_m  # int64 first row of the block
    row_ok = offs_m < q_len
    ld = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]

    offs_mb = tl.arange(0, BLOCK_M)
    if TMA:
        q = tma_tile(Q, off_z, off_hq, start_m, BLOCK_M, BLOCK_D)
        do = tma_tile(DO, off_z, off_hq, start_m, BLOCK_M, BLOCK_D)
        k_base = K
        v_base = V
    else:
        q = tl.load(tile_ptrs(Q, z64, hq64, row, s_qz, s_qh, s_qs, s_qd, offs_mb, offs_d), mask=ld, other=0.0)
        do = tl.load(tile_ptrs(DO, z64, hq64, row, s_doz, s_doh, s_dos, s_dod, offs_mb, offs_d), mask=ld,
                     other=0.0)
        k_base = K + z64 * s_kz + hkv64 * s_kh + k_start * s_ks
        v_base = V + z64 * s_vz + hkv64 * s_vh + k_start * s_vs
    m_off = z64 * s_mz + hq64 * s_mh + (q_start + offs_m) * s_ms
    m_row = tl.load(M + m_off, mask=row_ok, other=float("inf"))
    if FUSED_DELTA:
        # delta = rowsum(o * do) (fp32), stored for the dK/dV kernel that runs next
        if TMA:
            o = tma_tile(O, off_z, off_hq, start_m, BLOCK_M, BLOCK_D)
        else:
            o = tl.load(tile_ptrs(O, z64, hq64, row, s_oz, s_oh, s_os, s_od, offs_mb, offs_d), mask=ld, other=0.0)
        delta_row = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(Delta + m_off, delta_row, mask=row_ok)
    else:  # written by attn_bwd_preprocess
        delta_row = tl.load(Delta + m_off, mask=row_ok, other=0.0)

    n, b = load_params(NP, BP, TRANSFORM)
    c0, c1 = transform_consts(scale, n, b, TRANSFORM)
    g_s, g_n, g_b = grad_consts(scale, n, b, TRANSFORM)
    seed, rng_off, inv_keep = dropout_state(RNG, dropout_p, HAS_DROPOUT)
    rbase = rng_off + z64 * RNG_SZ + hq64 * RNG_SH + q_start * RNG_SS

    full, hi = kv_range_for_q_block(start_m, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL)
    off_c = k_len - q_len
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dn_r = tl.zeros([BLOCK_M], dtype=tl.float32)
    db_r = tl.zeros([BLOCK_M], dtype=tl.float32)
    gn_r = tl.zeros([BLOCK_M], dtype=tl.float32)
    gb_r = tl.zeros([BLOCK_M], dtype=tl.float32)
    de_r = tl.zeros([BLOCK_M], dtype=tl.float32)
    dq, dn_r, db_r, gn_r, gb_r, de_r = _bwd_dq_inner(
        dq, dn_r, db_r, gn_r, gb_r, de_r, q, do, m_row, delta_row, k_base, v_base, s_ks, s_kd, s_vs, s_vd,
        s_ks + zero64, s_vs + zero64, offs_m, 0, full, k_len, off_c, c0, c1, seed, rbase, RNG_SS, dropout_p,
        inv_keep, HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, TRANSFORM, DPARAMS,
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, DB, TMA, off_z, off_hkv)
    dq, dn_r, db_r, gn_r, gb_r, de_r = _bwd_dq_inner(
        dq, dn_r, db_r, gn_r, gb_r, de_r, q, do, m_row, delta_row, k_base, v_base, s_ks, s_kd, s_vs, s_vd,
        s_ks + zero64, s_vs + zero64, offs_m, full, hi, k_len, off_c, c0, c1, seed, rbase, RNG_SS, dropout_p,
        inv_keep, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, TRANSFORM, DPARAMS,
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, DB, TMA, off_z, off_hkv)
    if TRANSFORM == 1:
        if DPARAMS:
            # delta_row = do . o comes from the *stored* o (rounded to the input dtype,
            # computed from p rounded for the PV dot): fine for dq/dk, but dn, db are
            # small sums with a -sum_i delta_i * sum_j p_ij g_ij term that amplifies its
            # error. de_r = sum_j p dp (fp32, exact p) is the true delta of this row.
            corr = delta_row - de_r
            dn_row = (dn_r + corr * gn_r) * g_n
            tl.store(DN + m_off, dn_row, mask=row_ok)
            if DB:
                db_row = (db_r + corr * gb_r) * g_b
                tl.store(DBP + m_off, db_row, mask=row_ok)
    dq = dq * g_s
    if TMA:
        tma_store(DQ, off_z, off_hq, start_m, dq.to(q.dtype), BLOCK_M, BLOCK_D)
    else:
        tl.store(tile_ptrs(DQ, z64, hq64, row, s_dqz, s_dqh, s_dqs, s_dqd, offs_mb, offs_d),
                 dq.to(DQ.dtype.element_ty), mask=ld)


@triton.jit
def _bwd_dkv_inner(
    dk, dv, dnk, k, v,
    q_base, do_base, m_base, d_base, s_qs, s_qd, s_dos, s_dod, s_ms,
    s_qh64, s_doh64, s_mh64, s_qs64, s_dos64,
    offs_n, lo, n_blk, q_len, k_len, off_c,
    c0, c1, seed, rbase, RNG_SH, RSTRIDE, dropout_p, inv_keep, GROUP,
    a_base, c_base, s_as, s_ad, s_ah64, s_as64, g_s,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRANSFORM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    EVEN: tl.constexpr = False, ATOMIC_DQ: tl.constexpr = False, DN_KV: tl.constexpr = False,
    TMA: tl.constexpr = 0, off_z=0, off_h0=0, TMA_REDUCE: tl.constexpr = False,
):
    """Query blocks ``lo + i*BLOCK_M`` (``i < n_blk``) of each of the GROUP query heads.

    ``EVEN``: every block is whole (dense, ``Sq % BLOCK_M == 0``, ``HEAD_DIM == BLOCK_D``) --
    the q/dO/M/delta loads need no masks.

    ``ATOMIC_DQ`` (single-pass backward): also ``dq += g_s * ds @ k`` for the block,
    added into the fp32 accumulator at ``a_base`` (same head/row addressing as ``q``; with
    ``TMA_REDUCE`` a descriptor, the tile added by one bulk tensor reduce)
    with atomics -- no dQ kernel recomputing ``p``. ``DN_KV``: ``dnk`` (per key row, summed
    per key block in the kernel's epilogue) accumulates ``sum_i p dp (smag - C_i)`` with the forward's row means ``C`` at
    ``c_base`` (M's layout), i.e. ``dn / ln 2`` split by key rows, without atomics.

    One flat loop over (head, block) pairs, head-major: a nested runtime loop around the
    software-pipelined block loop made ptxas spill heavily (sm_90), a flat one does not.
    Base pointers are those of the group's first query head. ``TMA``: ``q_base`` and
    ``do_base`` are rank-4 descriptors, ``off_z``/``off_h0`` the batch and the group's
    first query head.
    """
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qT_off = offs_mb[None, :] * s_qs + offs_d[:, None] * s_qd  # [BLOCK_D, BLOCK_M]
    do_off = offs_mb[:, None] * s_dos + offs_d[None, :] * s_dod  # [BLOCK_M, BLOCK_D]
    d_ok = offs_d < HEAD_DIM
    for it in range(0, GROUP * n_blk):
        g = it // n_blk
        start_m = lo + (it - g * n_blk) * BLOCK_M
        row0 = start_m * s_qs64 + g * s_qh64  # int64
        offs_m = start_m + offs_mb
        row_ok = offs_m < q_len
        m_off = g * s_mh64 + offs_m.to(tl.int64) * s_ms
        if TMA:
            qT = tl.trans(tma_tile(q_base, off_z, off_h0 + g, start_m, BLOCK_M, BLOCK_D))
            do = tma_tile(do_base, off_z, off_h0 + g, start_m, BLOCK_M, BLOCK_D)
            if EVEN:
                m_row = tl.load(m_base + m_off)
                delta_row = tl.load(d_base + m_off)
                if DN_KV:
                    c_row = tl.load(c_base + m_off)
            else:
                m_row = tl.load(m_base + m_off, mask=row_ok, other=float("inf"))
                delta_row = tl.load(d_base + m_off, mask=row_ok, other=0.0)
                if DN_KV:
                    c_row = tl.load(c_base + m_off, mask=row_ok, other=0.0)
        elif EVEN:
            qT = tl.load(q_base + row0 + qT_off)
            do = tl.load(do_base + (start_m * s_dos64 + g * s_doh64) + do_off)
            m_row = tl.load(m_base + m_off)
            delta_row = tl.load(d_base + m_off)
            if DN_KV:
                c_row = tl.load(c_base + m_off)
        else:
            qT = tl.load(q_base + row0 + qT_off, mask=row_ok[None, :] & d_ok[:, None], other=0.0)
            do = tl.load(do_base + (start_m * s_dos64 + g * s_doh64) + do_off,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            m_row = tl.load(m_base + m_off, mask=row_ok, other=float("inf"))
            delta_row = tl.load(d_base + m_off, mask=row_ok, other=0.0)
            if DN_KV:
                c_row = tl.load(c_base + m_off, mask=row_ok, other=0.0)
        qkT = tl.dot(k, qT, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M] fp32
        z2T, smagT, rinvT = score_bwd_parts(qkT, c0, c1, TRANSFORM, FAST_LOG2)
        if MASKED:
            z2T = mask_scores(z2T, offs_m, offs_n, k_len, off_c, CAUSAL, True)
        pT = tl.math.exp2(z2T - m_row[None, :])  # masked, padding, empty rows (M = +inf) -> 0
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            keepT = dropout_keep(seed, rbase + g * RNG_SH, offs_m, offs_n, RSTRIDE, dropout_p, True)
            pdT = tl.where(keepT, pT * inv_keep, 0.0)
            dpT = tl.where(keepT, dpT * inv_keep, 0.0)
        else:
            pdT = pT
        dv = tl.dot(pdT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dzT = pT * (dpT - delta_row[None, :])  # [BLOCK_N, BLOCK_M]
        if TRANSFORM == 1:
            dsT = dzT * rinvT
            if DN_KV:
                # dn / ln2 = sum_ij p dp (smag - C_i) (the exact-delta dn of the dQ kernel;
                # C_i = sum_j p smag from the forward) = sum_ij dz (smag - C_i), since
                # sum_j p (smag - C_i) = 0: the stored-o delta inside dz drops out (to fp32
                # rounding of C), and the sum splits by key rows -- no row sum of p dp
                dnk += tl.sum(dzT * (smagT - c_row[None, :]), axis=1)
        else:
            dsT = dzT
        ds_lp = dsT.to(qT.dtype)
        dk = tl.dot(ds_lp, tl.trans(qT), dk, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ and TMA_REDUCE:
            # the TMA adds the whole tile into the fp32 accumulator (a bulk tensor reduce: one
            # instruction from one thread instead of BLOCK_M * BLOCK_D / threads atomics each)
            dq_t = tl.dot(tl.trans(ds_lp), k, input_precision=INPUT_PRECISION) * g_s
            a_base.atomic_add([off_z, off_h0 + g, start_m, 0], dq_t.reshape(1, 1, BLOCK_M, BLOCK_D))
        elif ATOMIC_DQ:
            dq_t = tl.dot(tl.trans(ds_lp), k, input_precision=INPUT_PRECISION) * g_s  # [BLOCK_M, BLOCK_D]
            a_ptrs = (a_base + (start_m * s_as64 + g * s_ah64)
                      + offs_mb[:, None] * s_as + offs_d[None, :] * s_ad)
            if EVEN:
                tl.atomic_add(a_ptrs, dq_t, sem="relaxed")
            else:
                tl.atomic_add(a_ptrs, dq_t, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv, dnk


@presence_flags(VARLEN=("CU_Q", "CU_K"), HAS_DROPOUT="RNG", ATOMIC_DQ="DQA", DN_KV=("CS", "DNK"))
@triton.jit
def attn_bwd_kernel_dkv(
    Q, K, V, DO, DK, DV, M, Delta, NP, BP, RNG, CU_Q, CU_K, DQA, CS, DNK,
    s_qz, s_qh, s_qs, s_qd,
    s_kz, s_kh, s_ks, s_kd,
    s_vz, s_vh, s_vs, s_vd,
    s_doz, s_doh, s_dos, s_dod,
    s_dkz, s_dkh, s_dks, s_dkd,
    s_dvz, s_dvh, s_dvs, s_dvd,
    s_mz, s_mh, s_ms,
    s_az, s_ah, s_as, s_ad,
    s_nz, s_nh, s_ns,
    HKV, GROUP, SEQ_Q, SEQ_K,
    scale, dropout_p, RNG_SZ, RNG_SH, RNG_SS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSFORM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    EVEN_Q: tl.constexpr = False, ATOMIC_DQ: tl.constexpr = False, DN_KV: tl.constexpr = False,
    TMA: tl.constexpr = 0, TMA_REDUCE: tl.constexpr = False,
):
    """``TMA`` (``BwdConfig.tma_kv``; dense inputs only): ``Q``, ``K``, ``V``, ``DO``, ``DK``,
    ``DV`` are rank-4 ``[B, H, S, D]`` tensor descriptors (``ops.common.tma``);
    ``TMA_REDUCE`` (with ``ATOMIC_DQ``; not in Triton's interpreter, which lacks it): so is
    the fp32 accumulator ``DQA``, each dq tile added by a bulk tensor reduce."""
    pid_n = tl.program_id(0)
    pid_zh = tl.program_id(1)
    off_z = pid_zh // HKV
    off_hkv = pid_zh % HKV
    q_start, q_len, k_start, k_len = seq_info(CU_Q, CU_K, off_z, SEQ_Q, SEQ_K, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        if DN_KV:  # every partial slot is written (poisoned buffers stay checkable): 0 here
            tl.store(DNK.to(tl.pointer_type(tl.float64), bitcast=True) + off_z.to(tl.int64) * s_nz
                     + off_hkv.to(tl.int64) * s_nh + pid_n * s_ns, 0.0)
        return
    z64 = off_z.to(tl.int64)
    hkv64 = off_hkv.to(tl.int64)
    zero64 = z64 * 0  # promotes strides to int64 for block-base offsets
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col = k_start + start_n  # int64 first key row of the block
    ld = (offs_n < k_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    if TMA:
        k = tma_tile(K, off_z, off_hkv, start_n, BLOCK_N, BLOCK_D)
        v = tma_tile(V, off_z, off_hkv, start_n, BLOCK_N, BLOCK_D)
    else:
        k = tl.load(tile_ptrs(K, z64, hkv64, col, s_kz, s_kh, s_ks, s_kd, offs_nb, offs_d), mask=ld, other=0.0)
        v = tl.load(tile_ptrs(V, z64, hkv64, col, s_vz, s_vh, s_vs, s_vd, offs_nb, offs_d), mask=ld, other=0.0)

    n, b = load_params(NP, BP, TRANSFORM)
    c0, c1 = transform_consts(scale, n, b, TRANSFORM)
    g_s, g_n, _ = grad_consts(scale, n, b, TRANSFORM)
    seed, rng_off, inv_keep = dropout_state(RNG, dropout_p, HAS_DROPOUT)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dnk = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo, mid = q_range_for_kv_block(start_n, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL)
    off_c = k_len - q_len
    # the GQA group's query heads, in a fixed order (deterministic, no atomics)
    hq0 = (off_hkv * GROUP).to(tl.int64)
    if TMA:
        q_base = Q
        do_base = DO
    else:
        q_base = Q + z64 * s_qz + hq0 * s_qh + q_start * s_qs
        do_base = DO + z64 * s_doz + hq0 * s_doh + q_start * s_dos
    m_base = M + z64 * s_mz + hq0 * s_mh + q_start * s_ms
    d_base = Delta + z64 * s_mz + hq0 * s_mh + q_start * s_ms
    rbase = rng_off + z64 * RNG_SZ + hq0 * RNG_SH + q_start * RNG_SS
    if TMA_REDUCE:
        a_base = DQA  # a descriptor of the fp32 dq accumulator (single pass)
    else:
        a_base = DQA + z64 * s_az + hq0 * s_ah + q_start * s_as
    c_base = CS + z64 * s_mz + hq0 * s_mh + q_start * s_ms
    n_masked = (mid - lo) // BLOCK_M
    n_full = (q_len - mid + BLOCK_M - 1) // BLOCK_M
    dk, dv, dnk = _bwd_dkv_inner(
        dk, dv, dnk, k, v,
        q_base, do_base, m_base, d_base, s_qs, s_qd, s_dos, s_dod, s_ms,
        s_qh + zero64, s_doh + zero64, s_mh + zero64, s_qs + zero64, s_dos + zero64,
        offs_n, lo, n_masked, q_len, k_len, off_c, c0, c1, seed, rbase, RNG_SH + zero64, RNG_SS, dropout_p,
        inv_keep, GROUP, a_base, c_base, s_as, s_ad, s_ah + zero64, s_as + zero64, g_s,
        HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, TRANSFORM,
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, False, ATOMIC_DQ, DN_KV, TMA, off_z, off_hkv * GROUP,
        TMA_REDUCE)
    dk, dv, dnk = _bwd_dkv_inner(
        dk, dv, dnk, k, v,
        q_base, do_base, m_base, d_base, s_qs, s_qd, s_dos, s_dod, s_ms,
        s_qh + zero64, s_doh + zero64, s_mh + zero64, s_qs + zero64, s_dos + zero64,
        offs_n, mid, n_full, q_len, k_len, off_c, c0, c1, seed, rbase, RNG_SH + zero64, RNG_SS, dropout_p,
        inv_keep, GROUP, a_base, c_base, s_as, s_ad, s_ah + zero64, s_as + zero64, g_s,
        HEAD_DIM, BLOCK_D, BLOCK_M, False, CAUSAL, TRANSFORM,
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, EVEN_Q, ATOMIC_DQ, DN_KV, TMA, off_z, off_hkv * GROUP,
        TMA_REDUCE)

    dk = dk * g_s
    if TMA:
        tma_store(DK, off_z, off_hkv, start_n, dk.to(k.dtype), BLOCK_N, BLOCK_D)
        tma_store(DV, off_z, off_hkv, start_n, dv.to(k.dtype), BLOCK_N, BLOCK_D)
    else:
        tl.store(tile_ptrs(DK, z64, hkv64, col, s_dkz, s_dkh, s_dks, s_dkd, offs_nb, offs_d),
                 dk.to(DK.dtype.element_ty), mask=ld)
        tl.store(tile_ptrs(DV, z64, hkv64, col, s_dvz, s_dvh, s_dvs, s_dvd, offs_nb, offs_d),
                 dv.to(DV.dtype.element_ty), mask=ld)
    if DN_KV:  # one float64 dn partial per key block: its rows summed in a fixed order
        part = tl.sum(tl.where(offs_n < k_len, dnk * g_n, 0.0).to(tl.float64), axis=0)
        tl.store(DNK.to(tl.pointer_type(tl.float64), bitcast=True) + z64 * s_nz + hkv64 * s_nh + pid_n * s_ns,
                 part)
