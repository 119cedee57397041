"""Fused attention backward shared by every single-softmax schedule (flash, ELSA scan).

Given the forward's output ``o`` and its per-row statistic ``M`` (the log2-domain
log-sum-exp of the transformed scores, see *M contract* below), this backward is
independent of how the forward was scheduled: a single-pass online softmax (flash), a
two-pass scan over key partitions (ELSA), or split-K all produce the same ``(o, M)`` and
can call ``attention_bwd``. It recomputes ``p = exp2(z2 - M)`` tile by tile, never
materialising ``[Sq, Sk]``.

Kernels (Triton tutorial 06 structure, FA2 split):

* ``_attn_bwd_kernel_dq``: one program per (query block, batch, query head); computes
  ``delta_i = sum_d o_id * do_id`` (fp32) for its rows from the tiles it loads anyway and
  stores it for the dK/dV kernel (launched after it on the same stream) -- no separate
  preprocess launch; loops over key blocks (unmasked blocks first, then the causal
  diagonal band / ragged tail with masks) and accumulates ``dq`` in fp32 registers.
* ``_attn_bwd_kernel_dkv``: one program per (key block, batch, kv head); loops over the
  GQA group's query heads and their query blocks, accumulating ``dk``, ``dv`` in
  registers (no atomics: the group sum is a plain loop).
* ``dn``/``db`` come from the dQ kernel, one partial per query row (``M``'s layout),
  using the exact row delta ``sum_j p dp`` (see the README); the host reduces the buffer
  in float64 -- bit-identical run to run.
* Single pass (``use_single_pass``: SSA at head dim <= 32 by default, ``NEMO_SSA_BWD``):
  no dQ kernel. The dK/dV kernel adds ``dq`` into an fp32 buffer with atomics, and (SSA,
  ``cstat`` = the forward's row means ``C_i = sum_j p smag``) writes one float64 ``dn``
  partial per key block of ``sum_i dz (smag - C_i)``; one tail kernel casts ``dq`` and
  sums the partials (fixed order).

Per element (``s = scale*qk``, ``t = 1 + b|s|``; ``dp = do . v`` times the dropout
mask / (1 - p_drop)):

    p  = exp2(z2 - M)                      z2 from transforms.score_bwd_parts
    dz = p * (dp - delta)
    dq = scale * sum_j dz * dz/ds * k_j,   dz/ds = n*b/t   (softmax: 1)
    dk = scale * sum_i dz * dz/ds * q_i,   dv = sum_i dropout(p) * do_i
    dn = sum dz * sgn(s) * ln t,           db = sum dz * n * s / t

Layouts: dense ``[B, H, S, D]`` with arbitrary strides on all four dims (views such as
Megatron's ``[s, b, h, d]`` permuted to ``[b, h, s, d]`` work without copies), or packed
THD ``[T, H, D]`` with ``cu_seqlens``. All addressing of rows uses int64.

This file also defines the dropout mask (``dropout_keep`` and ``dropout_rng_layout``):
the backward regenerates it, so every forward feeding this backward must build its mask
with exactly these helpers.
"""

from __future__ import annotations

import inspect
import os
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from nemo_ssa.ops.common.transforms import (
    TRANSFORM_SSA,
    grad_consts,
    log2_mode,
    score_bwd_parts,
    transform_consts,
    transform_id,
)

__all__ = [
    "attention_bwd",
    "BwdConfig",
    "use_single_pass",
    "single_pass_pays",
    "single_config",
    "SINGLE_CONFIGS",
    "bwd_config",
    "BWD_CONFIGS",
    "dropout_keep",
    "dropout_rng_layout",
    "make_rng_state",
    "seq_info",
    "is_interpreter",
    "use_fast_math",
    "default_input_precision",
    "SUPPORTED_DTYPES",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256

# Tests set this (or NEMO_SSA_POISON=1) to allocate every kernel output NaN-filled, so an
# element a kernel forgets to write shows up as NaN instead of stale memory.
POISON_OUTPUTS = os.environ.get("NEMO_SSA_POISON", "0") not in ("", "0")


def new_output_like(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.empty_like`` (same memory order for dense views), NaN-filled if poisoning."""
    out = torch.empty_like(t, dtype=dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


# ----------------------------------------------------------------------------------------
# Device helpers shared with the forward kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def seq_info(CU_Q, CU_K, off_z, SEQ_Q, SEQ_K, VARLEN: tl.constexpr):
    """``(q_start, q_len, k_start, k_len)`` of sequence ``off_z``; starts are int64 rows.

    Dense: starts are 0 and lengths ``SEQ_Q``/``SEQ_K``. Packed (``VARLEN``): read from
    ``cu_seqlens`` (int32).
    """
    if VARLEN:
        q_start = tl.load(CU_Q + off_z)
        q_len = tl.load(CU_Q + off_z + 1) - q_start
        k_start = tl.load(CU_K + off_z)
        k_len = tl.load(CU_K + off_z + 1) - k_start
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    else:
        zero = (off_z * 0).to(tl.int64)
        q_start = zero
        k_start = zero
        q_len = off_z * 0 + SEQ_Q
        k_len = off_z * 0 + SEQ_K
    return q_start, q_len, k_start, k_len


@triton.jit
def dropout_keep(seed, rbase, offs_q, offs_k, RSTRIDE, dropout_p, TRANSPOSED: tl.constexpr):
    """Keep-mask of dropout on ``p`` for rows ``offs_q`` x keys ``offs_k`` (Philox).

    Counter of entry (i, j) = ``rbase + i * RSTRIDE + j`` (int64; ``rbase`` from
    ``dropout_rng_layout``). Returns ``[len(q), len(k)]`` (``TRANSPOSED``: ``[len(k),
    len(q)]``) booleans, True = kept (probability ``1 - dropout_p``).
    """
    if TRANSPOSED:
        idx = rbase + offs_q[None, :].to(tl.int64) * RSTRIDE + offs_k[:, None]
    else:
        idx = rbase + offs_q[:, None].to(tl.int64) * RSTRIDE + offs_k[None, :]
    return tl.rand(seed, idx) >= dropout_p


@triton.jit
def tile_ptrs(X, z64, h64, row, s_z, s_h, s_s, s_d, offs_r, offs_d):
    """Pointers of the ``[len(offs_r), len(offs_d)]`` tile at rows ``row + offs_r`` of head
    ``h64`` of batch ``z64`` (int64 block base, in-tile offsets)."""
    return X + z64 * s_z + h64 * s_h + row * s_s + offs_r[:, None] * s_s + offs_d[None, :] * s_d


@triton.jit
def load_params(NP, BP, TRANSFORM: tl.constexpr):
    """SSA ``(n, b)`` as fp32 from 1-element tensors of any float dtype; ``0.0`` otherwise."""
    if TRANSFORM == 1:
        n = tl.load(NP).to(tl.float32)
        b = tl.load(BP).to(tl.float32)
    else:
        n = 0.0
        b = 0.0
    return n, b


@triton.jit
def dropout_state(RNG, dropout_p, HAS_DROPOUT: tl.constexpr):
    """``(seed, Philox offset, 1 / (1 - dropout_p))`` from ``rng_state``; ``(0, 0, 1.0)``
    without dropout."""
    if HAS_DROPOUT:
        seed = tl.load(RNG)
        rng_off = tl.load(RNG + 1)
        inv_keep = 1.0 / (1.0 - dropout_p)
    else:
        seed = 0
        rng_off = 0
        inv_keep = 1.0
    return seed, rng_off, inv_keep


@triton.jit
def load_kv_tile(ptrs, cols, k_len, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASKED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A key/value tile, ``[BLOCK_D, BLOCK_N]`` (``TRANSPOSED``) or ``[BLOCK_N, BLOCK_D]``;
    keys ``cols >= k_len`` are masked only on the ``MASKED`` stage."""
    if TRANSPOSED:
        if MASKED:
            t = tl.load(ptrs, mask=(cols < k_len)[None, :] & (offs_d < HEAD_DIM)[:, None], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
    else:
        if MASKED:
            t = tl.load(ptrs, mask=(cols < k_len)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return t


@triton.jit
def mask_scores(z2, offs_m, offs_n, k_len, off_c, CAUSAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``-inf`` where key ``offs_n`` is past ``k_len`` or (``CAUSAL``) after query row
    ``offs_m`` (bottom-right aligned by ``off_c``); ``z2`` is ``[M, N]`` or (``TRANSPOSED``)
    ``[N, M]``."""
    if TRANSPOSED:
        valid = (offs_n < k_len)[:, None]
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + off_c)
    else:
        valid = (offs_n < k_len)[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + off_c)
    return tl.where(valid, z2, float("-inf"))


@triton.jit
def kv_range_for_q_block(start_m, q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    """Key range of a query block: ``[0, full)`` needs no mask, ``[full, hi)`` does.

    Causal is bottom-right aligned: row i sees key j iff ``j <= i + (k_len - q_len)``.
    ``full`` is a multiple of ``BLOCK_N`` and ``<= k_len``, so unmasked blocks are in
    bounds; the masked stage covers the diagonal band and the ragged tail.
    """
    if CAUSAL:
        off_c = k_len - q_len
        hi = tl.maximum(tl.minimum(k_len, start_m + BLOCK_M + off_c), 0)
        full = tl.maximum(tl.minimum(start_m + off_c + 1, k_len), 0)
        full = (full // BLOCK_N) * BLOCK_N
    else:
        hi = k_len
        full = (k_len // BLOCK_N) * BLOCK_N
    return full, hi


@triton.jit
def q_range_for_kv_block(start_n, q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    """Query range of a key block: ``[lo, mid)`` masked, ``[mid, q_len)`` unmasked."""
    q_end = ((q_len + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if CAUSAL:
        off_c = k_len - q_len
        first = tl.maximum(start_n - off_c, 0)  # first row that sees key start_n
        lo = (first // BLOCK_M) * BLOCK_M
        full = tl.maximum(start_n + BLOCK_N - 1 - off_c, 0)  # rows >= full see the block
        mid = ((full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        lo = q_len * 0
        mid = q_len * 0
    # a ragged last key block always takes the masked path (keys >= k_len must weigh 0)
    mid = tl.where(start_n + BLOCK_N > k_len, q_end, mid)
    mid = tl.minimum(mid, q_end)
    lo = tl.minimum(lo, mid)
    return lo, mid


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _bwd_dq_inner(
    dq, dn_r, db_r, gn_r, gb_r, de_r, q, do, m_row, delta_row,
    k_base, v_base, s_ks, s_kd, s_vs, s_vd, s_ks64, s_vs64,
    offs_m, lo, hi, k_len, off_c,
    c0, c1, seed, rbase, RSTRIDE, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRANSFORM: tl.constexpr, DPARAMS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    DB: tl.constexpr = True,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kT_off = offs_n[None, :] * s_ks + offs_d[:, None] * s_kd  # [BLOCK_D, BLOCK_N]
    vT_off = offs_n[None, :] * s_vs + offs_d[:, None] * s_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
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


@triton.jit
def _attn_bwd_preprocess(
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


@triton.jit
def _attn_bwd_postprocess(
    DQA, DQ, DNK, NUMEL, NK,
    BLOCK: tl.constexpr, DN_BLOCK: tl.constexpr, CAST: tl.constexpr, DPARAMS: tl.constexpr,
):
    """The single-pass backward's tail in one launch (issue 13: three torch launches
    before). ``DPARAMS``: program 0 sums the ``NK`` float64 ``dn`` partials (one per key
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


@triton.jit
def _attn_bwd_kernel_dq(
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
    FUSED_DELTA: tl.constexpr = True, DB: tl.constexpr = True,
):
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
    q = tl.load(tile_ptrs(Q, z64, hq64, row, s_qz, s_qh, s_qs, s_qd, offs_mb, offs_d), mask=ld, other=0.0)
    do = tl.load(tile_ptrs(DO, z64, hq64, row, s_doz, s_doh, s_dos, s_dod, offs_mb, offs_d), mask=ld, other=0.0)
    m_off = z64 * s_mz + hq64 * s_mh + (q_start + offs_m) * s_ms
    m_row = tl.load(M + m_off, mask=row_ok, other=float("inf"))
    if FUSED_DELTA:
        # delta = rowsum(o * do) (fp32), stored for the dK/dV kernel that runs next
        o = tl.load(tile_ptrs(O, z64, hq64, row, s_oz, s_oh, s_os, s_od, offs_mb, offs_d), mask=ld, other=0.0)
        delta_row = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(Delta + m_off, delta_row, mask=row_ok)
    else:  # written by _attn_bwd_preprocess
        delta_row = tl.load(Delta + m_off, mask=row_ok, other=0.0)

    n, b = load_params(NP, BP, TRANSFORM)
    c0, c1 = transform_consts(scale, n, b, TRANSFORM)
    g_s, g_n, g_b = grad_consts(scale, n, b, TRANSFORM)
    seed, rng_off, inv_keep = dropout_state(RNG, dropout_p, HAS_DROPOUT)
    rbase = rng_off + z64 * RNG_SZ + hq64 * RNG_SH + q_start * RNG_SS

    k_base = K + z64 * s_kz + hkv64 * s_kh + k_start * s_ks
    v_base = V + z64 * s_vz + hkv64 * s_vh + k_start * s_vs
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
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, DB)
    dq, dn_r, db_r, gn_r, gb_r, de_r = _bwd_dq_inner(
        dq, dn_r, db_r, gn_r, gb_r, de_r, q, do, m_row, delta_row, k_base, v_base, s_ks, s_kd, s_vs, s_vd,
        s_ks + zero64, s_vs + zero64, offs_m, full, hi, k_len, off_c, c0, c1, seed, rbase, RNG_SS, dropout_p,
        inv_keep, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, TRANSFORM, DPARAMS,
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, DB)
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
):
    """Query blocks ``lo + i*BLOCK_M`` (``i < n_blk``) of each of the GROUP query heads.

    ``EVEN``: every block is whole (dense, ``Sq % BLOCK_M == 0``, ``HEAD_DIM == BLOCK_D``) --
    the q/dO/M/delta loads need no masks.

    ``ATOMIC_DQ`` (single-pass backward): also ``dq += g_s * ds @ k`` for the block,
    added into the fp32 accumulator at ``a_base`` (same head/row addressing as ``q``)
    with atomics -- no dQ kernel recomputing ``p``. ``DN_KV``: ``dnk`` (per key row, summed
    per key block in the kernel's epilogue) accumulates ``sum_i p dp (smag - C_i)`` with the forward's row means ``C`` at
    ``c_base`` (M's layout), i.e. ``dn / ln 2`` split by key rows, without atomics.

    One flat loop over (head, block) pairs, head-major: a nested runtime loop around the
    software-pipelined block loop made ptxas spill heavily (sm_90), a flat one does not.
    Base pointers are those of the group's first query head.
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
        if EVEN:
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
        if ATOMIC_DQ:
            dq_t = tl.dot(tl.trans(ds_lp), k, input_precision=INPUT_PRECISION) * g_s  # [BLOCK_M, BLOCK_D]
            a_ptrs = (a_base + (start_m * s_as64 + g * s_ah64)
                      + offs_mb[:, None] * s_as + offs_d[None, :] * s_ad)
            if EVEN:
                tl.atomic_add(a_ptrs, dq_t, sem="relaxed")
            else:
                tl.atomic_add(a_ptrs, dq_t, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv, dnk


@triton.jit
def _attn_bwd_kernel_dkv(
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
):
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
    q_base = Q + z64 * s_qz + hq0 * s_qh + q_start * s_qs
    do_base = DO + z64 * s_doz + hq0 * s_doh + q_start * s_dos
    m_base = M + z64 * s_mz + hq0 * s_mh + q_start * s_ms
    d_base = Delta + z64 * s_mz + hq0 * s_mh + q_start * s_ms
    rbase = rng_off + z64 * RNG_SZ + hq0 * RNG_SH + q_start * RNG_SS
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
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, False, ATOMIC_DQ, DN_KV)
    dk, dv, dnk = _bwd_dkv_inner(
        dk, dv, dnk, k, v,
        q_base, do_base, m_base, d_base, s_qs, s_qd, s_dos, s_dod, s_ms,
        s_qh + zero64, s_doh + zero64, s_mh + zero64, s_qs + zero64, s_dos + zero64,
        offs_n, mid, n_full, q_len, k_len, off_c, c0, c1, seed, rbase, RNG_SH + zero64, RNG_SS, dropout_p,
        inv_keep, GROUP, a_base, c_base, s_as, s_ad, s_ah + zero64, s_as + zero64, g_s,
        HEAD_DIM, BLOCK_D, BLOCK_M, False, CAUSAL, TRANSFORM,
        HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, EVEN_Q, ATOMIC_DQ, DN_KV)

    dk = dk * g_s
    tl.store(tile_ptrs(DK, z64, hkv64, col, s_dkz, s_dkh, s_dks, s_dkd, offs_nb, offs_d),
             dk.to(DK.dtype.element_ty), mask=ld)
    tl.store(tile_ptrs(DV, z64, hkv64, col, s_dvz, s_dvh, s_dvs, s_dvd, offs_nb, offs_d),
             dv.to(DV.dtype.element_ty), mask=ld)
    if DN_KV:  # one float64 dn partial per key block: its rows summed in a fixed order
        part = tl.sum(tl.where(offs_n < k_len, dnk * g_n, 0.0).to(tl.float64), axis=0)
        tl.store(DNK.to(tl.pointer_type(tl.float64), bitcast=True) + z64 * s_nz + hkv64 * s_nh + pid_n * s_ns,
                 part)


# ----------------------------------------------------------------------------------------
# Host side: configs, layout helpers, launcher
# ----------------------------------------------------------------------------------------


# Evaluated once at import, as a plain bool: ``is_interpreter()`` runs in code that
# torch.compile traces (validation in ``flash_attention``), and dynamo must never see a
# Triton kernel object there (torch 2.11: "TritonKernelVariable() has no type").
_INTERPRETED: bool = type(_attn_bwd_kernel_dq).__name__ == "InterpretedFunction"


def is_interpreter() -> bool:
    """True when the kernels in this process were built for ``TRITON_INTERPRET=1``.

    Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, i.e. when
    this module is first imported; the env var must be set before that.
    """
    return _INTERPRETED


# ----------------------------------------------------------------------------------------
# Cached kernel launch (issue 13: per-call host cost)
# ----------------------------------------------------------------------------------------

# NEMO_SSA_FAST_LAUNCH=0 turns the cached launch off (every call goes through JITFunction.run)
FAST_LAUNCH: bool = os.environ.get("NEMO_SSA_FAST_LAUNCH", "1") not in ("", "0")
_LAUNCH_CACHE: dict = {}
_LAUNCH_CACHE_MAX = 512
_I32 = (-(2 ** 31), 2 ** 31 - 1)


def _current_stream(device_index: int):
    """The stream handle JITFunction.run would launch on."""
    return triton.runtime.driver.active.get_current_stream(device_index)


def _launch_hooks_active() -> bool:
    """Triton launch hooks (e.g. proton / the profiler) need JITFunction.run's metadata."""
    rt = triton.knobs.runtime
    hooks = (rt.launch_enter_hook, rt.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def launch_key(kernel, device_index: int, args: tuple, meta: dict) -> tuple:
    """Cache key of one launch, at least as fine as Triton's own specialization: every
    tensor's dtype and 16-byte alignment of its pointer, every int's exact value (finer
    than Triton's int32/int64 / ==1 / %16 classes, so a hit can never pick a kernel built
    for other values), floats by type only (Triton never specializes them), ``None``, every
    constexpr and launch option (``meta``), the kernel and the device."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            parts.append(("b", a))
        elif isinstance(a, int):
            parts.append(a)
        elif isinstance(a, float):
            parts.append(float)
        elif a is None:
            parts.append(None)
        else:
            raise TypeError(f"launch_key: unsupported kernel argument type {type(a).__name__}")
    return (id(kernel), device_index, tuple(parts), tuple(sorted(meta.items())))


def _full_args(kernel, args: tuple, meta: dict):
    """Positional values of every kernel parameter (constexprs included, in signature
    order), as ``JITFunction.run`` hands them to ``CompiledKernel.run``; None if a
    parameter has neither a value nor a default."""
    names = kernel.arg_names
    out = list(args)
    for p in kernel.params[len(args):]:
        if p.name in meta:
            out.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            return None
    return out if len(out) == len(names) else None


def _check_split(args: tuple, ntensors: int) -> None:
    """The contract of ``launch(..., ntensors=k)``: tensors first, then plain Python scalars."""
    for i, a in enumerate(args):
        is_t = isinstance(a, torch.Tensor)
        if i < ntensors and not is_t:
            raise TypeError(f"launch: argument {i} must be a tensor (ntensors={ntensors}), got {type(a).__name__}")
        if i >= ntensors and (is_t or not (a is None or isinstance(a, (int, float)))):
            raise TypeError(f"launch: argument {i} after the {ntensors} tensors must be an int, float, bool or "
                            f"None, got {type(a).__name__}")


def _cache_entry(compiled, kernel, args: tuple, meta: dict):
    """``(callable, prefix, tail)`` for the hit path, or None when the compiled kernel does
    not expose what a direct launch needs. ``callable(gx, gy, gz, stream, *prefix, *args,
    *tail)`` launches: the driver's C launcher itself where the kernel needs no global or
    profile scratch (what ``CudaLauncher.__call__`` would pass then: no scratch, the
    cooperative-grid and PDL flags), else ``CompiledKernel.run``."""
    full = _full_args(kernel, args, meta)
    if full is None or getattr(compiled, "function", None) is None or not hasattr(compiled, "packed_metadata"):
        return None
    tail = tuple(full[len(args):])  # the constexpr/default tail depends only on meta (part of the key)
    run = compiled.run
    direct = getattr(run, "launch", None)
    if (callable(direct) and getattr(run, "global_scratch_size", None) == 0
            and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        pre = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
               compiled.packed_metadata, None, None, None)
        return direct, pre, tail
    return run, (compiled.function, compiled.packed_metadata, None, None, None), tail


def launch(kernel, grid: tuple, args: tuple, meta: dict, ntensors: Optional[int] = None):
    """``kernel[grid](*args, **meta)`` with the compiled kernel cached per launch key.

    A hit skips ``JITFunction.run``'s binder, option parsing and cache-key hashing and
    calls the launcher ``JITFunction.run`` itself ends with, with the same arguments. A
    miss (or the interpreter, a launch hook such as the profiler's, ``FAST_LAUNCH`` off)
    takes the normal path, which compiles if needed; its ``CompiledKernel`` is stored.

    ``ntensors=k`` (every call site in this package): ``args[:k]`` are tensors and the rest
    ints, floats, bools or None, each position keeping its Python type from call to call.
    The key is then built in C loops (issue 13: ``launch_key``'s per-argument Python cost
    was ~26 us of each ~44 us launch on the lent H100's host): each tensor's dtype and
    16-byte alignment, the scalar tail by value (floats too: a new ``scale`` is a new
    entry, never a wrong one), ``meta`` in insertion order, kernel and device. The split
    is checked on every normal-path call (the interpreter's CPU tests cover each call
    site). ``ntensors=None``: ``launch_key`` (any argument order)."""
    if _INTERPRETED or not FAST_LAUNCH or _launch_hooks_active():
        if ntensors is not None:
            _check_split(args, ntensors)
        return kernel[grid](*args, **meta)
    dev = torch.cuda.current_device()
    if ntensors is None:
        key = launch_key(kernel, dev, args, meta)
    else:
        try:
            key = (id(kernel), dev, tuple(meta.items()),
                   tuple([(t.dtype, not t.data_ptr() & 15) for t in args[:ntensors]]), args[ntensors:])
        except AttributeError:
            _check_split(args, ntensors)  # raises the TypeError that names the argument
            raise
    hit = _LAUNCH_CACHE.get(key)
    if hit is None:
        if ntensors is not None:
            _check_split(args, ntensors)
        compiled = kernel[grid](*args, **meta)
        entry = _cache_entry(compiled, kernel, args, meta)
        if entry is not None:
            if len(_LAUNCH_CACHE) >= _LAUNCH_CACHE_MAX:
                _LAUNCH_CACHE.clear()
            _LAUNCH_CACHE[key] = entry + (compiled,)
        return compiled
    fn, pre, tail, compiled = hit
    if len(grid) == 2:
        fn(grid[0], grid[1], 1, _current_stream(dev), *pre, *args, *tail)
    else:
        g = tuple(grid) + (1, 1)
        fn(g[0], g[1], g[2], _current_stream(dev), *pre, *args, *tail)
    return compiled


def use_fast_math(device: torch.device) -> bool:
    """Default for ``fast_math`` (PTX ``lg2.approx``): CUDA (not ROCm), not interpreted."""
    return (not is_interpreter()) and device.type == "cuda" and torch.version.hip is None


def default_input_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs (exactness gates); irrelevant for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


class BwdConfig(NamedTuple):
    """Block sizes / launch params of the two backward kernels."""

    block_m_dq: int
    block_n_dq: int
    warps_dq: int
    stages_dq: int
    block_m_kv: int
    block_n_kv: int
    warps_kv: int
    stages_kv: int


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton 3.6 wraps it (and ``next_power_of_2``) as a
    ``ConstexprFunction``, ~1.5 us per call on the launch path; these are plain ints."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``)."""
    return 1 << max(0, int(x) - 1).bit_length()


def _d_bucket(head_dim: int) -> int:
    """Config bucket = the padded ``BLOCK_D`` (16 shares 32's row)."""
    return max(32, next_pow2(head_dim))


# (BLOCK_D bucket, causal, "16bit" | "fp32") -> BwdConfig(dq: BM, BN, warps, stages,
# dkv: BM, BN, warps, stages). 16-bit rows 32/64/128: the measured winners of
# benchmarks/tune_tiles.py (H100, bf16, causal SSA, 2026-11-22; docs/results/2026-11-22-tuning):
# 4 warps beat 8 everywhere, 1.1-1.55x over the compile-time estimates they replace. The
# D=32 row is the best for both the model shape (B4 N4K) and N=16K. 256 and fp32 are still
# compile-time estimates (largest tiles without spills; fp32 uses IEEE dots on FMA units,
# hence small tiles). NEMO_SSA_AUTOTUNE=1 tunes instead.
_BWD_16 = {32: BwdConfig(64, 32, 4, 2, 64, 64, 4, 2),
           64: BwdConfig(64, 128, 4, 2, 64, 64, 4, 2),  # re-tuned 2026-11-25: 1.04x / 1.05x
           128: BwdConfig(64, 64, 4, 2, 32, 64, 4, 2),
           256: BwdConfig(32, 32, 4, 2, 32, 32, 8, 2)}    # estimate: regs 235 / 247
_BWD_32 = {32: BwdConfig(32, 32, 4, 2, 32, 32, 8, 2),
           64: BwdConfig(32, 32, 4, 2, 16, 16, 4, 2),
           128: BwdConfig(32, 32, 8, 2, 16, 16, 4, 2),
           256: BwdConfig(16, 16, 8, 2, 16, 16, 8, 2)}
BWD_CONFIGS: Dict[Tuple[int, bool, str], BwdConfig] = {}
for _causal in (False, True):
    for _bd in (32, 64, 128, 256):
        BWD_CONFIGS[(_bd, _causal, "16bit")] = _BWD_16[_bd]
        BWD_CONFIGS[(_bd, _causal, "fp32")] = _BWD_32[_bd]
INTERPRETER_BWD_CONFIG = BwdConfig(16, 16, 1, 1, 16, 16, 1, 1)

# The single-pass backward's dK/dV(+dQ) kernel: (BLOCK_D bucket, "16bit" | "fp32") ->
# (BLOCK_M, BLOCK_N, warps, stages); it carries the dq tile and (SSA) the dn sums on top
# of the dK/dV kernel's registers, so it gets its own row (16-bit rows 32/64/128 measured,
# docs/results/2026-11-25-single-pass; 256 and fp32: estimates).
_SINGLE_16 = {32: (64, 64, 4, 2),     # tune_tiles bwd_single 2026-11-25: b32 and B4 N4K (1.01-1.02x)
              64: (64, 64, 4, 2),     # B1 N16K H16: 1.13x over (64, 64, 4, 1)
              128: (32, 128, 8, 2),   # B2 N8K H8: 1.15x over (32, 64, 4, 2)
              256: (32, 32, 8, 2)}    # estimate
_SINGLE_32 = {32: (32, 32, 8, 2), 64: (16, 16, 4, 2), 128: (16, 16, 4, 2), 256: (16, 16, 8, 2)}
SINGLE_CONFIGS: Dict[Tuple[int, str], Tuple[int, int, int, int]] = {}
for _bd in (32, 64, 128, 256):
    SINGLE_CONFIGS[(_bd, "16bit")] = _SINGLE_16[_bd]
    SINGLE_CONFIGS[(_bd, "fp32")] = _SINGLE_32[_bd]

# candidates when autotuning (GPU only; NEMO_SSA_AUTOTUNE=1)
_BWD_TUNE_DQ = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for s in (2, 3)]
_BWD_TUNE_KV = [(bm, bn, w, s) for bm in (16, 32, 64) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def bwd_config(head_dim: int, causal: bool, dtype: torch.dtype, interpret: Optional[bool] = None) -> BwdConfig:
    """Look up the backward block sizes (small 16x16 blocks under the interpreter)."""
    if interpret is None:
        interpret = is_interpreter()
    if interpret:
        return INTERPRETER_BWD_CONFIG
    kind = "fp32" if dtype == torch.float32 else "16bit"
    return BWD_CONFIGS[(_d_bucket(head_dim), bool(causal), kind)]


def single_config(head_dim: int, dtype: torch.dtype, interpret: Optional[bool] = None) -> BwdConfig:
    """Tiles of the single-pass backward (the dK/dV fields of a ``BwdConfig``; the dQ
    fields are unused there)."""
    if interpret is None:
        interpret = is_interpreter()
    if interpret:
        return INTERPRETER_BWD_CONFIG
    kind = "fp32" if dtype == torch.float32 else "16bit"
    return BwdConfig(0, 0, 0, 0, *SINGLE_CONFIGS[(_d_bucket(head_dim), kind)])


def autotune_enabled() -> bool:
    """``NEMO_SSA_AUTOTUNE=1`` switches the GPU kernels to ``triton.autotune`` over the
    candidate lists (the static tables are then ignored); never under the interpreter."""
    return os.environ.get("NEMO_SSA_AUTOTUNE", "0") not in ("", "0") and not is_interpreter()


_AUTOTUNED: Dict[str, object] = {}


def _autotuned(name: str, kernel, cands, block_names, key):
    """Build (once) an autotuned wrapper of ``kernel`` over ``cands`` = (bm, bn, w, s)."""
    if name not in _AUTOTUNED:
        cfgs = [triton.Config({block_names[0]: bm, block_names[1]: bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s in cands]
        _AUTOTUNED[name] = triton.autotune(configs=cfgs, key=key)(kernel)
    return _AUTOTUNED[name]


def dropout_rng_layout(num_heads_q: int, seqlen_q: int, seqlen_k: int, varlen: bool,
                       total_q: Optional[int] = None) -> Tuple[int, int, int]:
    """Philox counter layout ``(RNG_SZ, RNG_SH, RNG_SS)`` of the dropout mask.

    Entry (batch z, query head h, row i, key j) uses counter
    ``offset + z*RNG_SZ + h*RNG_SH + (q_start + i)*RNG_SS + j`` (``q_start`` = 0 dense;
    packed: the sequence's first token). Dense: ``(Hq*Sq*Sk, Sq*Sk, Sk)``; packed
    (``seqlen_k`` = max_seqlen_k, ``total_q`` = T_q): ``(0, T_q*max_k, max_k)``.
    """
    if varlen:
        return 0, int(total_q) * int(seqlen_k), int(seqlen_k)
    return int(num_heads_q) * int(seqlen_q) * int(seqlen_k), int(seqlen_q) * int(seqlen_k), int(seqlen_k)


def make_rng_state(device, seed: Optional[int] = None, offset: int = 0) -> torch.Tensor:
    """int64 ``[2]`` tensor ``(seed, offset)`` on ``device`` read by the dropout kernels.

    ``seed=None`` draws both from the device's default generator (``torch.randint``): no
    host sync, follows ``torch.manual_seed`` / Megatron's RNG-tracker forks, and is
    traceable by ``torch.compile``. An int seed gives a reproducible mask.
    """
    if seed is None:
        return torch.randint(0, 2 ** 62, (2,), device=device, dtype=torch.int64)
    return torch.tensor([int(seed), int(offset)], dtype=torch.int64, device=device)


def _zhsd(t: torch.Tensor, varlen: bool) -> Tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides of ``[B, H, S, D]`` or packed ``[T, H, D]``."""
    s = t.stride()
    if varlen:
        return 0, s[1], s[0], s[2]
    return s


def _stat_strides(M: torch.Tensor, varlen: bool) -> Tuple[int, int, int]:
    """(batch, head, row) strides of ``M`` ``[B, Hq, Sq]`` or packed ``[Hq, T_q]``."""
    s = M.stride()
    if varlen:
        return 0, s[0], s[1]
    return s


def _param_ptrs(n: Optional[torch.Tensor], b: Optional[torch.Tensor], dummy: torch.Tensor):
    """Kernel pointers for ``n``, ``b`` (read in-kernel as fp32, no host op); ``dummy``
    (never dereferenced) for softmax."""
    if n is None or b is None:
        return dummy, dummy
    return n, b  # the launcher only reads data_ptr(): no detach (a host op per call)


BWD_MODES = ("auto", "atomic", "deterministic")


def single_pass_pays(transform: str, head_dim: int) -> bool:
    """Where the single-pass backward is the faster one (H100, bf16, causal, 2026-11-25,
    docs/results/2026-11-25-single-pass): SSA at head dim <= 32, whose dQ kernel spends ~19
    instructions per score recomputing what the dK/dV loop already has (B32 N1024 fwd+bwd
    1.12 -> 1.06x cuDNN, B2 N4096 1.50 -> 1.34x). Softmax's dQ loop is cheap (~9 per score)
    and the fp32 atomics (``D / BLOCK_N`` per score, per-thread ``red`` into L2) cost more
    than it: single pass measured slower (B32 0.69 -> 0.83x); so did D >= 64 for both."""
    return transform in ("ssa", TRANSFORM_SSA) and _d_bucket(int(head_dim)) == 32


def use_single_pass(transform: str, head_dim: int) -> bool:
    """Which backward a call takes. ``NEMO_SSA_BWD`` = ``auto`` (default): the two-kernel
    backward when ``torch.are_deterministic_algorithms_enabled()`` (e.g. Megatron's
    ``deterministic_mode``), else the single pass where it is measured faster
    (``single_pass_pays``); ``atomic``: the single pass always (the dK/dV kernel also adds
    ``dq`` with fp32 atomics, FA2-style: ``dq`` is then not bit-identical run to run;
    ``dk``, ``dv``, ``dn`` still are); ``deterministic``: the two-kernel backward always
    (a dQ kernel recomputes ``p``; every gradient bit-identical run to run)."""
    mode = os.environ.get("NEMO_SSA_BWD", "auto") or "auto"
    if mode not in BWD_MODES:
        raise ValueError(f"NEMO_SSA_BWD={mode!r}; supported: {', '.join(BWD_MODES)}")
    if mode == "auto":
        return (not torch.are_deterministic_algorithms_enabled()) and single_pass_pays(transform, head_dim)
    return mode == "atomic"


def new_cstat(M: torch.Tensor) -> torch.Tensor:
    """The fp32 row statistic ``C`` a forward writes for the single-pass backward's ``dn``
    (``M``'s shape and layout)."""
    return new_output_like(M)


def _fused_delta(is_ssa: bool) -> bool:
    """Fold the delta pass into the dQ kernel? Softmax yes, SSA no (measured);
    ``NEMO_SSA_FUSED_DELTA=0|1`` forces either for A/B runs."""
    forced = os.environ.get("NEMO_SSA_FUSED_DELTA", "")
    if forced in ("0", "1"):
        return forced == "1"
    return not is_ssa


def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    M: torch.Tensor,
    *,
    transform: str = "ssa",
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    input_precision: Optional[str] = None,
    fast_math: Optional[bool] = None,
    need_dparams: bool = True,
    config: Optional[BwdConfig] = None,
    need_db: bool = True,
    cstat: Optional[torch.Tensor] = None,
    deterministic: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of ``o = dropout(softmax(transform(scale * q k^T) + mask)) @ v``.

    Schedule-independent: any forward that returns ``o`` and ``M`` under the contract
    below (flash single pass, ELSA two-pass scan, split-K) can use it.

    **M contract.** ``M[z, h, i] = m2 + log2(l)`` (fp32), where ``z2_ij`` is the score in
    the log2 domain exactly as ``transforms.score_fwd(qk, scale, n, b, TRANSFORM,
    FAST_LOG2=fast_math)`` computes it (``qk`` = fp32 ``q_i . k_j`` from ``tl.dot``),
    ``m2 = max_j z2_ij`` over visible keys and ``l = sum_j exp2(z2_ij - m2)`` -- i.e.
    ``M = log2 sum_j exp2(z2_ij)``, so ``p_ij = exp2(z2_ij - M_i)``. Rows with no visible
    key store ``M = +inf`` (and ``o = 0``): the recomputed ``p`` is then exactly 0, never
    NaN. ``l`` is the *undropped* normaliser; dropout multiplies ``p`` afterwards.

    **Masking.** Causal is bottom-right aligned (row i sees key j iff
    ``j <= i + Sk - Sq``, per sequence when packed); masked entries weigh exactly 0.

    **Dropout.** If ``dropout_p > 0`` the keep-mask is regenerated from ``rng_state``
    (int64 ``[2]`` = seed, offset; see ``make_rng_state``) with ``dropout_keep`` and the
    counter layout ``dropout_rng_layout``; the forward must have used the same.

    Args:
        do, q, o: ``[B, Hq, Sq, D]`` (or packed ``[T_q, Hq, D]``); any strides.
        k, v: ``[B, Hkv, Sk, D]`` (or ``[T_k, Hkv, D]``), ``Hq % Hkv == 0``; any strides.
        M: fp32 ``[B, Hq, Sq]`` (packed: ``[Hq, T_q]``).
        transform: ``"ssa"`` or ``"softmax"``.
        n, b: SSA parameters (1-element tensors); ignored for softmax.
        causal, scale: as in the forward (``scale`` defaults to ``1/sqrt(D)``).
        dropout_p, rng_state: dropout on ``p`` (see above).
        cu_seqlens_q/k, max_seqlen_q/k: packed (THD) layout; int32 cumulative lengths.
        input_precision: ``tl.dot`` precision; default ``"ieee"`` for fp32 inputs.
        fast_math: PTX ``lg2.approx`` for the SSA log; must match the forward. Default:
            on for CUDA, off under the interpreter.
        need_dparams: compute ``dn``/``db`` (SSA only).
        need_db: with ``need_dparams``, also ``db`` (False: ``db`` is None and the dQ
            kernel skips its two row sums -- ``b`` is fixed under the pinned policy).
        config: override the block-size table (``BwdConfig``).
        cstat: the forward's ``C_i = sum_j p_ij smag_ij`` (fp32, ``M``'s layout; SSA), which
            lets the single-pass backward compute ``dn`` from key-block partials.
        deterministic: ``False``: single pass -- the dK/dV kernel also accumulates ``dq``
            in an fp32 buffer with atomics (no dQ kernel; ``dq`` not bit-identical run to
            run). Used when ``b`` needs no gradient and, with ``dn``, ``cstat`` is given;
            otherwise the two-kernel path runs. ``True``: always the two-kernel path.
            ``None``: ``not use_single_pass(transform, D)`` (env ``NEMO_SSA_BWD``).

    Returns:
        ``(dq, dk, dv, dn, db)``: ``dq/dk/dv`` with the dtype and (dense) layout of
        ``q/k/v`` (``empty_like``); ``dn``, ``db`` fp32 ``[1]`` (summed in float64 over a
        fixed-size buffer of partials -- per query row (two kernels) or per key block
        (single pass) -- in a fixed order, bit-identical run to run), or ``None`` for
        softmax / ``need_dparams=False``.
    """
    varlen = cu_seqlens_q is not None
    tid = transform_id(transform)
    is_ssa = tid == TRANSFORM_SSA
    dparams = bool(need_dparams and is_ssa)
    want_db = dparams and bool(need_db)
    if varlen:
        _, hq, d = q.shape
        hkv = k.shape[1]
        bz = cu_seqlens_q.numel() - 1
        sq, sk = int(max_seqlen_q), int(max_seqlen_k)
        total_q = q.shape[0]
    else:
        bz, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        total_q = None
    group = hq // hkv
    m_shape = (hq, q.shape[0]) if varlen else (bz, hq, sq)
    if do.shape != q.shape or o.shape != q.shape:
        raise ValueError(f"do {tuple(do.shape)} and o {tuple(o.shape)} must have q's shape {tuple(q.shape)}")
    if M.dtype != torch.float32 or tuple(M.shape) != m_shape:
        raise ValueError(f"M must be fp32 of shape {m_shape}, got {M.dtype} {tuple(M.shape)}")
    if k.shape != v.shape or k.shape[-1] != d or hkv == 0 or hq % hkv != 0:
        raise ValueError(f"bad k/v shapes {tuple(k.shape)}, {tuple(v.shape)} for q {tuple(q.shape)}: k, v must "
                         f"match, share q's head dim, and Hq must be a multiple of Hkv")
    if scale is None:
        scale = d ** -0.5
    dev = q.device
    if input_precision is None:
        input_precision = default_input_precision(q.dtype)
    if fast_math is None:
        fast_math = use_fast_math(dev)
    has_dropout = dropout_p > 0.0
    if has_dropout and rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state (int64 [2] seed, offset)")
    # pointers a constexpr branch never dereferences get M as a placeholder (no allocation)
    rng = rng_state if has_dropout else M
    # unused without dropout (constexpr branch): zeros keep them out of the launch key
    rz, rh, rs = dropout_rng_layout(hq, sq, sk, varlen, total_q) if has_dropout else (0, 0, 0)
    n_ptr, b_ptr = _param_ptrs(n, b, M) if is_ssa else (M, M)
    cu_q = cu_seqlens_q if varlen else M
    cu_k = cu_seqlens_k if varlen else M
    block_d = max(16, next_pow2(d))
    tune = config is None and autotune_enabled()
    if deterministic is None:
        deterministic = not use_single_pass(transform, d)
    if not deterministic and not tune and not want_db and (not dparams or cstat is not None):
        return _attention_bwd_single(
            do, q, k, v, o, M, cstat if dparams else None, varlen=varlen, tid=tid, bz=bz, hq=hq, hkv=hkv,
            sq=sq, sk=sk, d=d, block_d=block_d, cfg=config or single_config(d, q.dtype), scale=scale, dropout_p=dropout_p, rng=rng,
            rz=rz, rh=rh, rs=rs, n_ptr=n_ptr, b_ptr=b_ptr, cu_q=cu_q, cu_k=cu_k,
            input_precision=input_precision, fast_math=fast_math, causal=causal)

    cfg = config or bwd_config(d, causal, q.dtype)
    dq = new_output_like(q)
    dk = new_output_like(k)
    dv = new_output_like(v)
    delta = new_output_like(M)
    stacked = None
    if dparams and M.is_contiguous():
        # one partial per query row (M's layout), written by the dQ kernel; dn and db
        # partials share one buffer so a single fp64 reduction launch sums both
        stacked = new_output((1 + want_db,) + tuple(M.shape), torch.float32, dev)
        dn_part = stacked[0]
        db_part = stacked[1] if want_db else dn_part  # never written without DB
    elif dparams:
        dn_part = new_output_like(M)
        db_part = new_output_like(M) if want_db else dn_part
    else:
        dn_part = db_part = M  # never written (DPARAMS is off)
    ms = _stat_strides(M, varlen)

    # delta = rowsum(o * do): folded into the dQ kernel for softmax (one launch fewer);
    # SSA keeps the separate pass -- its dQ kernel (dn/db partials on top) measured ~12%
    # slower with the extra tile on an H100 (B32 N1024: 2.10 vs 1.88 ms fwd+bwd GPU time)
    fused_delta = _fused_delta(is_ssa)
    if not fused_delta:
        pre_bm = _pre_block_m(block_d)
        launch(_attn_bwd_preprocess, (cdiv(sq, pre_bm), bz * hq),
               (o, do, delta, cu_q, M, *_zhsd(o, varlen), *_zhsd(do, varlen), *ms, 0, 0, 0, 0, hq, sq),
               dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_bm, VARLEN=varlen), 5)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, TRANSFORM=tid, CAUSAL=bool(causal), VARLEN=varlen,
                  HAS_DROPOUT=has_dropout, INPUT_PRECISION=input_precision,
                  FAST_LOG2=log2_mode(fast_math) if is_ssa else int(bool(fast_math)))
    dq_args = (q, k, v, do, o, dq, M, delta, n_ptr, b_ptr, rng, cu_q, cu_k, dn_part, db_part,
               *_zhsd(q, varlen), *_zhsd(k, varlen), *_zhsd(v, varlen), *_zhsd(do, varlen),
               *_zhsd(o, varlen), *_zhsd(dq, varlen), *ms, hq, group, sq, sk, float(scale), float(dropout_p), rz, rh, rs)
    if tune:
        kern = _autotuned("dq", _attn_bwd_kernel_dq, _BWD_TUNE_DQ, ("BLOCK_M", "BLOCK_N"),
                          ["HQ", "GROUP", "SEQ_Q", "SEQ_K", "HEAD_DIM", "TRANSFORM", "DPARAMS", "DB", "CAUSAL", "VARLEN", "HAS_DROPOUT"])
        kern[lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), bz * hq)](*dq_args, DPARAMS=dparams, DB=want_db,
                                                                         FUSED_DELTA=fused_delta, **common)
    else:
        launch(_attn_bwd_kernel_dq, (cdiv(sq, cfg.block_m_dq), bz * hq), dq_args,
               dict(BLOCK_M=cfg.block_m_dq, BLOCK_N=cfg.block_n_dq, DPARAMS=dparams, DB=want_db,
                    FUSED_DELTA=fused_delta,
                    num_warps=cfg.warps_dq, num_stages=cfg.stages_dq, **common), 15)
    kv_args = (q, k, v, do, dk, dv, M, delta, n_ptr, b_ptr, rng, cu_q, cu_k, M, M, M,
               *_zhsd(q, varlen), *_zhsd(k, varlen), *_zhsd(v, varlen), *_zhsd(do, varlen),
               *_zhsd(dk, varlen), *_zhsd(dv, varlen), *ms, 0, 0, 0, 0, 0, 0, 0, hkv, group, sq, sk,
               float(scale), float(dropout_p), rz, rh, rs)
    if tune:
        kern = _autotuned("dkv", _attn_bwd_kernel_dkv, _BWD_TUNE_KV, ("BLOCK_M", "BLOCK_N"),
                          ["HKV", "GROUP", "SEQ_Q", "SEQ_K", "HEAD_DIM", "TRANSFORM", "CAUSAL", "VARLEN", "HAS_DROPOUT"])
        kern[lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), bz * hkv)](*kv_args, **common)
    else:
        # whole query blocks in the unmasked loop: its loads drop their masks
        even_q = (not varlen) and sq % cfg.block_m_kv == 0 and d == block_d
        launch(_attn_bwd_kernel_dkv, (cdiv(sk, cfg.block_n_kv), bz * hkv), kv_args,
               dict(BLOCK_M=cfg.block_m_kv, BLOCK_N=cfg.block_n_kv, EVEN_Q=even_q,
                    num_warps=cfg.warps_kv, num_stages=cfg.stages_kv, **common), 16)
    if stacked is not None:
        # fixed-size buffer, fixed order, accumulated in float64 (sum's dtype= casts each
        # element before accumulating, no fp64 copy): bit-identical run to run
        both = stacked.sum(dim=tuple(range(1, stacked.dim())), dtype=torch.float64)
        # two casts, not one cast + views: callers' custom ops (ELSA) return dn and db,
        # and custom-op outputs must not alias each other
        dn = both[0:1].to(torch.float32)
        db = both[1:2].to(torch.float32) if want_db else None
    elif dparams:
        # fixed-size buffer, fixed order, float64: bit-identical run to run
        dn = dn_part.to(torch.float64).sum().to(torch.float32).reshape(1)
        db = db_part.to(torch.float64).sum().to(torch.float32).reshape(1) if want_db else None
    else:
        dn = db = None
    return dq, dk, dv, dn, db


# elements per program of _attn_bwd_postprocess (dq cast; also the dn sum's block)
_POST_BLOCK, _POST_BLOCK_INTERP = 4096, 1024


def _pre_block_m(block_d: int) -> int:
    """Rows per program of ``_attn_bwd_preprocess``."""
    return 16 if is_interpreter() else max(16, min(128, 8192 // block_d))


def _attention_bwd_single(do, q, k, v, o, M, cstat, *, varlen, tid, bz, hq, hkv, sq, sk, d, block_d, cfg,
                          scale, dropout_p, rng, rz, rh, rs, n_ptr, b_ptr, cu_q, cu_k, input_precision,
                          fast_math, causal):
    """Single-pass backward (``attention_bwd(deterministic=False)``): one preprocess launch
    (delta, and the fp32 dq accumulator zeroed), one dK/dV launch that also adds ``dq``
    with atomics and (``cstat`` given) writes one float64 ``dn`` partial per key block, and
    one tail launch (``_attn_bwd_postprocess``: dq cast, dn sum) unless dq is fp32 and
    there is no dn."""
    is_ssa = tid == TRANSFORM_SSA
    dparams = cstat is not None
    dev = q.device
    dqa = new_output_like(q, dtype=torch.float32)  # zeroed by the preprocess kernel
    cast = q.dtype != torch.float32
    dq = new_output_like(q) if cast else dqa  # same dense strides as dqa: a flat cast
    dk = new_output_like(k)
    dv = new_output_like(v)
    delta = new_output_like(M)
    ms = _stat_strides(M, varlen)
    if dparams:
        if cstat.dtype != torch.float32 or cstat.shape != M.shape or cstat.stride() != M.stride():
            raise ValueError(f"cstat must be fp32 with M's shape {tuple(M.shape)} and strides {M.stride()}, "
                             f"got {cstat.dtype} {tuple(cstat.shape)} {cstat.stride()}")
        # one float64 dn partial per key block ([B, Hkv, cdiv(Sk, BLOCK_N)], B = sequences
        # when packed) and, after them, the fp32 total the postprocess kernel writes: one
        # fp32 allocation (the partials are read through a float64 pointer), dn a view.
        # Per block, not per key row: the postprocess kernel's single-program sum stays
        # short (per row it was 171 us at B32 N1024 on an H100)
        nblk = cdiv(sk, cfg.block_n_kv)
        nk = bz * hkv * nblk
        dnk = new_output((2 * nk + 1,), torch.float32, dev)
        ns = (hkv * nblk, nblk, 1)
    else:
        nk, dnk, ns = 0, M, (0, 0, 0)
    az = _zhsd(dqa, varlen)
    pre_bm = _pre_block_m(block_d)
    launch(_attn_bwd_preprocess, (cdiv(sq, pre_bm), bz * hq),
           (o, do, delta, cu_q, dqa, *_zhsd(o, varlen), *_zhsd(do, varlen), *ms, *az, hq, sq),
           dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_bm, VARLEN=varlen, ZERO_DQ=True), 5)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, TRANSFORM=tid, CAUSAL=bool(causal), VARLEN=varlen,
                  HAS_DROPOUT=dropout_p > 0.0, INPUT_PRECISION=input_precision,
                  FAST_LOG2=log2_mode(fast_math) if is_ssa else int(bool(fast_math)))
    kv_args = (q, k, v, do, dk, dv, M, delta, n_ptr, b_ptr, rng, cu_q, cu_k, dqa,
               cstat if dparams else M, dnk,
               *_zhsd(q, varlen), *_zhsd(k, varlen), *_zhsd(v, varlen), *_zhsd(do, varlen),
               *_zhsd(dk, varlen), *_zhsd(dv, varlen), *ms, *az, *ns, hkv, hq // hkv, sq, sk,
               float(scale), float(dropout_p), rz, rh, rs)
    even_q = (not varlen) and sq % cfg.block_m_kv == 0 and d == block_d
    launch(_attn_bwd_kernel_dkv, (cdiv(sk, cfg.block_n_kv), bz * hkv), kv_args,
           dict(BLOCK_M=cfg.block_m_kv, BLOCK_N=cfg.block_n_kv, EVEN_Q=even_q, ATOMIC_DQ=True, DN_KV=dparams,
                num_warps=cfg.warps_kv, num_stages=cfg.stages_kv, **common), 16)
    if cast or dparams:
        # dq's cast and dn's fixed-order float64 sum: one launch
        numel = dqa.numel() if cast else 0
        pb = _POST_BLOCK_INTERP if _INTERPRETED else _POST_BLOCK
        launch(_attn_bwd_postprocess, (cdiv(numel, pb) + int(dparams),), (dqa, dq, dnk, numel, nk),
               dict(BLOCK=pb, DN_BLOCK=pb, CAST=cast, DPARAMS=dparams, num_warps=4), 3)
    return dq, dk, dv, (dnk[2 * nk:] if dparams else None), None
