"""The attention backward's Hopper kernel, written in Gluon: FA3's warp-specialised single pass.

One program per (key block of 128 keys, batch, kv head) loops over the GQA group's query
heads and their 64-row query blocks in three *partitions* (``gl.warp_specialize``):

* a producer warp streams Q and dO through a ``STAGES``-deep ring of TMA copies and, by
  ``cp.async`` into the same slot, the rows' statistics ``M``, ``delta`` and (SSA with ``dn``)
  the forward's row means ``C`` (``ready`` / ``empty`` mbarriers per slot);
* the default partition, two consumer warpgroups of 64 keys each, computes per block
  ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (asynchronous warpgroup MMAs), ``Pᵀ = exp2(z - M)``,
  ``dZᵀ = Pᵀ (dPᵀ - delta)``, ``dSᵀ = dZᵀ`` (softmax) or ``dZᵀ / (1 + b|s|)`` (SSA), ``dV += Pᵀ
  dO`` and ``dK += dSᵀ Q`` with ``Pᵀ`` and ``dSᵀ`` from registers, then ``dQ = dS K`` from
  ``dSᵀ`` staged in shared memory (a transposed view), scaled and staged in fp32; SSA's ``dn``
  as one float64 partial per program of ``sum dz (smag - C_i)`` (``bwd_kernels``' single-pass
  split: fixed order, bit-identical run to run);
* SSA's reciprocal ``1/t`` (``fold_rcp``): ``P/t = exp2(z - M - log2 t)`` with the ``log2 t``
  the transform already has (``|smag|``), then ``P = (P/t) t`` and ``dS = (P/t)(dP - delta)`` --
  two MUFU operations per score instead of three (``exp2``, ``log2``, ``rcp``) for two more
  FP32 ones. At D64, fwd+bwd without the ``rcp`` at all (wrong math, a probe) ran 5-6 % faster,
  the fold 4-5 % (docs/results/2026-11-26-ssa-d64-mufu, calls 2-3);
* a writer warp adds each staged dq tile into the fp32 accumulator with one TMA bulk reduce
  (``cp.reduce.async.bulk.tensor``; Gluon 3.6 has the op in its builder but no wrapper).

``pipeline`` (``GluonBwdConfig``; SSA at D64): the consumers issue block ``j``'s ``Sᵀ``, ``dPᵀ``
ahead of block ``j - 1``'s ``dV``, ``dK``, ``dQ`` and compute ``j``'s score gradients while
those run (FA3's intra-warpgroup overlap, here in the backward); ``dSᵀ`` gets two buffers and
the ring must hold two blocks plus the one in flight (three stages). At D128 the extra live
registers spill. ``ds_smem``: ``dK += dSᵀ Q`` reads block ``j - 1``'s ``dSᵀ`` from the shared
buffer ``dQ`` reads anyway, instead of registers carried across the loop (which cost ~40 moves
per block and warp in the SASS).

The two one-warp partitions run at 24 registers, which ``setmaxnreg`` gives to the consumers
(240 each at ``maxnreg=168``). Five products per block against the two-kernel backward's seven;
``dq`` is summed by fp32 atomics in the L2, so it is not bit-identical run to run: the kernel
runs only where the backward may be non-deterministic (``dispatch.backward_plan``).

Measured (H100, bf16, causal, fwd+bwd × SDPA cuDNN, B2 N8K / B8 N4K; docs/results/
2026-11-26-gluon-ssa, call 6), the Gluon kernels off → on (this one and the Gluon forward): softmax D128 1.23 /
1.16 → 1.04 / 1.05, SSA D128 1.46 / 1.43 → 1.22 / 1.20, softmax D64 1.06 / 1.07 → 1.03 / 1.03,
SSA D64 1.42 / 1.41 → 1.39 / 1.34. Spill stores in the consumers' loop decided most of it: SSA
at D128 with 93 of them ran at 1.57 (call 4), with 10 at 1.27 (call 5) -- the statistics read
from shared memory and the score gradients in one function (``_grad_scores``) freed the
registers the per-element global loads and their 64-bit addresses held.

Same contract as ``bwd.attention_bwd`` (any forward writing ``o`` and ``M`` under it; SSA's
``dn`` also needs ``C``). ``gluon_bwd_config`` takes it only where it applies and was measured
faster; the Triton backward is its reference, CPU path and fallback (``NEMO_SSA_GLUON=0``).
Gluon has no interpreter: the CPU suite compiles the kernel for sm_90 and checks the dispatch;
the GPU suite checks its gradients.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
import triton

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.gluon_math import HAVE_GLUON
from nemo_ssa.ops.common.tma import MIN_SCORES, tma_ready, wgmma_capable

if HAVE_GLUON:  # Triton 3.6 exactly (gluon_math.GLUON_TRITON)
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from nemo_ssa.ops.common.gluon_math import abs_fast, rcp, ssa_parts

__all__ = ["GluonBwdConfig", "GLUON_BWD", "HAVE_GLUON", "gluon_bwd_capable", "gluon_bwd_config", "gluon_key_blocks",
           "launch_gluon_bwd"]


class GluonBwdConfig(NamedTuple):
    block_m: int  # query rows per block
    num_warps: int  # the consumer partition (64 keys per warpgroup: BLOCK_N = 16 * num_warps)
    stages: int  # depth of the Q/dO ring
    maxnreg: int  # registers per thread at launch (the workers hand theirs to the consumers)
    pipeline: int = 0  # 1: the consumers overlap a block's score gradients with the previous block's products
    fold_rcp: int = 0  # SSA: 1/t folded into the exp2 (P/t = exp2(z - M - log2 t), P = (P/t) t): no MUFU rcp
    ds_smem: int = 0  # pipelined: dK += dS^T Q reads dS^T from its shared buffer, not from registers carried a block


#: (head dim, transform) -> tiles, measured on an H100 (docs/results/2026-11-26-gluon-ssa, call 5;
#: fwd+bwd x SDPA cuDNN, B2 N8K / B8 N4K, against the Triton backward): softmax D128 1.10 / 1.04
#: (Triton 1.28 / 1.16), SSA D128 1.27 / 1.20 (1.55 / 1.43), softmax D64 1.01 / 1.02 (1.08 /
#: 1.08), SSA D64 pipelined with three stages 1.34 / 1.34 (1.41 / 1.42). Three stages do not fit in
#: shared memory at D128 (246 KB); the pipelined consumers at D128 spill (59-83 stores) and ran
#: slower; at D64 with two stages they wait on every load (1.57). SSA D64 then took the folded
#: reciprocal and dS^T from shared memory (docs/results/2026-11-26-ssa-d64-mufu, calls 3-5):
#: 3.22 -> 3.03-3.05 ms (B2 N8K) and 3.34 -> 3.17-3.18 (B8 N4K) fwd+bwd; at D128 the fold was
#: within noise (+0.8 / -0.7 %), so that row keeps the reciprocal.
GLUON_BWD: Dict[tuple, GluonBwdConfig] = {
    (128, "softmax"): GluonBwdConfig(64, 8, 2, 168),
    (128, "ssa"): GluonBwdConfig(64, 8, 2, 168),
    (64, "softmax"): GluonBwdConfig(64, 8, 2, 168),
    (64, "ssa"): GluonBwdConfig(64, 8, 3, 168, pipeline=1, fold_rcp=1, ds_smem=1),
}


def gluon_bwd_capable(transform: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool,
                      dropout: bool, fast_log2: int = 1) -> bool:
    """Whether the backward of this call can take the Gluon kernel, from what the forward
    knows (``o`` and ``dO`` are checked again in ``gluon_bwd_config``). SSA needs the
    ``log2`` mode the kernel recomputes ``z`` with (``FAST_LOG2 = 1``, as the forward's)."""
    if (q.shape[-1], transform) not in GLUON_BWD or not HAVE_GLUON or varlen or dropout:
        return False
    if transform == "ssa" and int(fast_log2) != 1:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not env.gluon():
        return False
    bz, hq, sq, _ = q.shape
    if bz * hq * sq * k.shape[2] < MIN_SCORES or not wgmma_capable(q.device):
        return False
    return all(tma_ready(t) for t in (q, k, v)) and k.dtype == v.dtype == q.dtype


def gluon_bwd_config(transform: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                     o: torch.Tensor, *, varlen: bool, dropout: bool, fast_log2: int = 1) -> Optional[GluonBwdConfig]:
    """The Gluon tiles for this backward call, or None (the Triton kernels run)."""
    if not gluon_bwd_capable(transform, q, k, v, varlen=varlen, dropout=dropout, fast_log2=fast_log2):
        return None
    if not (tma_ready(do) and tma_ready(o) and do.dtype == q.dtype):
        return None
    return GLUON_BWD[(q.shape[-1], transform)]


if HAVE_GLUON:

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """``cp.reduce.async.bulk.tensor.add``: add the shared tile ``src`` into global memory
        at ``coord`` (Gluon 3.6 builds the op but has no wrapper for it)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    @gluon.jit
    def _coords(it, lo, n_blk, BLOCK_M: gl.constexpr):
        """(query head offset in the group, first row) of flat iteration ``it``: heads
        outer, the ``n_blk`` query blocks from ``lo`` inner."""
        g = it // gl.maximum(n_blk, 1)
        j = lo // BLOCK_M + it - g * n_blk
        return g, j * BLOCK_M

    @gluon.jit
    def _producer(q_desc, do_desc, q_smem, do_smem, stat_smem, ready, empty, M, Delta, CS, m_base, s_mh, s_ms,
                  z, h0, lo, n_blk, total, SEQ_Q, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  DN_KV: gl.constexpr):
        """Producer warp: Q and dO (TMA) and the rows' statistics M, delta and (``DN_KV``) C
        (``cp.async``, zero past ``SEQ_Q``, where Q and dO are zero too) of every iteration
        into the ring, each slot refilled once the consumers have released it (``empty``; a
        fresh barrier counts as released). The ``cp.async`` arrive goes first, so the slot's
        phase cannot complete on the TMA bytes alone."""
        lanes = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
        for it in range(total):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            g, start_m = _coords(it, lo, n_blk, BLOCK_M)
            bar = ready.index(s)
            ok = start_m + lanes < SEQ_Q
            off = m_base + (h0 + g).to(gl.int64) * s_mh + start_m.to(gl.int64) * s_ms + lanes * s_ms
            NSTAT: gl.constexpr = 3 if DN_KV else 2
            async_copy.async_copy_global_to_shared(stat_smem.index(s * NSTAT), M + off, mask=ok)
            async_copy.async_copy_global_to_shared(stat_smem.index(s * NSTAT + 1), Delta + off, mask=ok)
            if DN_KV:
                async_copy.async_copy_global_to_shared(stat_smem.index(s * NSTAT + 2), CS + off, mask=ok)
            async_copy.mbarrier_arrive(bar)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [z, h0 + g, start_m, 0], bar, q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [z, h0 + g, start_m, 0], bar, do_smem.index(s))

    @gluon.jit
    def _dq_writer(dq_desc, dq_smem, dq_ready, dq_empty, z, h0, lo, n_blk, total, BLOCK_M: gl.constexpr):
        """Writer warp: each staged dq tile (double-buffered) added into the fp32
        accumulator by one bulk tensor reduce, its buffer released once the reduce has read it."""
        for it in range(total):
            b = it % 2
            mbarrier.wait(dq_ready.index(b), (it // 2) & 1)
            g, start_m = _coords(it, lo, n_blk, BLOCK_M)
            _tma_reduce_add(dq_desc, [z, h0 + g, start_m, 0], dq_smem.index(b))
            tma.store_wait(pendings=0)
            mbarrier.arrive(dq_empty.index(b), count=1)

    @gluon.jit
    def _grad_scores(sT, dpT, dnk, rows, stat_smem, s, cols, SEQ_K, off_c, c0, c1, dtype: gl.constexpr,
                     sT_layout: gl.constexpr, a_layout: gl.constexpr, TRANSFORM: gl.constexpr,
                     DN_KV: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr, FOLD_RCP: gl.constexpr):
        """``(Pᵀ, dSᵀ)`` of one block as MMA operands (registers), ``dSᵀ`` also in 16 bits for
        shared memory, and ``dnk`` updated: ``Pᵀ = exp2(z - M)``, ``dZᵀ = Pᵀ (dPᵀ - delta)``,
        ``dSᵀ = dZᵀ`` (softmax) or ``dZᵀ / t`` (SSA, ``z2``, ``smag`` and ``t = 1 + b|s|`` as
        ``transforms.score_bwd_parts``); ``DN_KV``: ``dnk`` (per key) adds
        ``sum_i dz (smag - C_i)``, ``bwd_kernels._bwd_dkv_inner``'s ``dn`` split. The rows'
        statistics come from the ring slot ``s`` (the producer's copies)."""
        NSTAT: gl.constexpr = 3 if DN_KV else 2
        m_row = stat_smem.index(s * NSTAT).load(gl.SliceLayout(0, sT_layout))
        d_row = stat_smem.index(s * NSTAT + 1).load(gl.SliceLayout(0, sT_layout))
        if TRANSFORM == 1:
            z2, smag, t = ssa_parts(sT, c0, c1)
        else:
            z2 = sT * c0
        if MASKED:
            keep = gl.expand_dims(cols < SEQ_K, 1)
            if CAUSAL:
                keep = keep & (gl.expand_dims(cols, 1) <= gl.expand_dims(rows + off_c, 0))
            z2 = gl.where(keep, z2, float("-inf"))
        if TRANSFORM == 1 and FOLD_RCP:
            # P/t = exp2(z2 - M - log2 t) (|smag| = log2 t): one MUFU exp2 instead of exp2 and rcp;
            # then P = (P/t) t, dS = (P/t)(dP - delta), dZ = P (dP - delta)
            qT = gl.exp2(z2 - gl.expand_dims(m_row, 0) - abs_fast(smag))  # masked, padding, empty rows -> 0
            pT = qT * t
            gT = dpT - gl.expand_dims(d_row, 0)
            dsT = qT * gT
            if DN_KV:
                c_row = stat_smem.index(s * NSTAT + 2).load(gl.SliceLayout(0, sT_layout))
                dnk += gl.sum((pT * gT) * (smag - gl.expand_dims(c_row, 0)), axis=1)
        else:
            pT = gl.exp2(z2 - gl.expand_dims(m_row, 0))  # masked, padding, empty rows (M = +inf) -> 0
            dzT = pT * (dpT - gl.expand_dims(d_row, 0))
            if TRANSFORM == 1:
                dsT = dzT * rcp(t)
                if DN_KV:
                    c_row = stat_smem.index(s * NSTAT + 2).load(gl.SliceLayout(0, sT_layout))
                    dnk += gl.sum(dzT * (smag - gl.expand_dims(c_row, 0)), axis=1)
            else:
                dsT = dzT
        pa = gl.convert_layout(pT.to(dtype), a_layout)
        ds_lp = dsT.to(dtype)
        dsa = gl.convert_layout(ds_lp, a_layout)
        return pa, dsa, ds_lp, dnk

    @gluon.jit
    def _consume_step(dk, dv, dnk, it, g, start_m, k_smem, v_smem, q_smem, do_smem, stat_smem, ready, empty,
                      dsT_smem, dq_smem, dq_ready, dq_empty, cols, SEQ_K, off_c,
                      c0, c1, g_s, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                      STAGES: gl.constexpr, sT_layout: gl.constexpr, a_layout: gl.constexpr,
                      dq_layout: gl.constexpr, TRANSFORM: gl.constexpr, DN_KV: gl.constexpr,
                      CAUSAL: gl.constexpr, MASKED: gl.constexpr, FOLD_RCP: gl.constexpr):
        """One query block in the consumer warpgroups: the five products, ``dq`` staged for
        the writer and the Q/dO slot released. ``MASKED``: the causal band or a ragged tail."""
        dtype: gl.constexpr = k_smem.dtype
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sT_layout))
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        z0 = it >> 30  # 0, but not provably: the operand descriptors are rebuilt per block, not hoisted
        k2 = k_smem.index(z0).reshape([BLOCK_N, HEAD_D])
        v2 = v_smem.index(z0).reshape([BLOCK_N, HEAD_D])
        q2 = q_smem.index(s).reshape([BLOCK_M, HEAD_D])
        do2 = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sT_layout)
        sT = warpgroup_mma(k2, q2.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v2, do2.permute((1, 0)), zero, use_acc=False, is_async=True)
        sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
        pa, dsa, ds_lp, dnk = _grad_scores(sT, dpT, dnk, rows, stat_smem, s, cols, SEQ_K, off_c, c0, c1, dtype,
                                           sT_layout, a_layout, TRANSFORM, DN_KV, CAUSAL, MASKED, FOLD_RCP)
        dv = warpgroup_mma(pa, do2, dv, is_async=True)
        dk = warpgroup_mma(dsa, q2, dk, is_async=True)
        b = it % 2
        mbarrier.wait(dq_empty.index(b), ((it // 2) & 1) ^ 1)
        ds_s = dsT_smem.index(z0)
        ds_s.store(ds_lp)
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups' dS^T rows are in shared memory
        dq = warpgroup_mma(ds_s.permute((1, 0)), k2, gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
        dq, dk, dv, pa, dsa = warpgroup_mma_wait(0, deps=(dq, dk, dv, pa, dsa))
        dq_smem.index(b).reshape([BLOCK_M, HEAD_D]).store(dq * g_s)
        fence_async_shared()
        gl.thread_barrier()  # dq staged; every read of this Q/dO slot and of dS^T is done
        mbarrier.arrive(dq_ready.index(b), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        return dk, dv, dnk

    @gluon.jit
    def _consumers(k_smem, v_smem, q_smem, do_smem, stat_smem, ready, empty, dsT_smem, dq_smem, dq_ready, dq_empty,
                   kv_bar, NP, BP, lo, n_blk, n_mask, GROUP, start_n, SEQ_K, off_c, scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                   STAGES: gl.constexpr, TRANSFORM: gl.constexpr, DN_KV: gl.constexpr, CAUSAL: gl.constexpr,
                   FOLD_RCP: gl.constexpr, DS_SMEM: gl.constexpr, num_warps: gl.constexpr):
        """The default partition (two consumer warpgroups, 64 keys each): every query head of
        the group, masked blocks then unmasked ones; returns ``(dK * g_s, dV, dn_k)`` with
        ``g_s`` = ``scale`` (softmax) or ``n b scale`` (SSA) and ``dn_k`` the ``dn`` of each
        key (``ln 2`` applied, 0 past ``SEQ_K``; zeros unless ``DN_KV``)."""
        sT_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, HEAD_D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                            instr_shape=[16, HEAD_D // (num_warps // 4), 16])
        if TRANSFORM == 1:  # transforms.transform_consts / grad_consts
            n = gl.load(NP).to(gl.float32)
            b = gl.load(BP).to(gl.float32)
            c0 = scale * b
            c1 = n
            g_s = n * b * scale
        else:
            c0 = scale * 1.4426950408889634
            c1 = 0.0
            g_s = scale
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sT_layout))
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
        dnk = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, sT_layout))
        mbarrier.wait(kv_bar, 0)
        it = 0
        for g in range(GROUP):
            for jm in range(n_mask):
                dk, dv, dnk = _consume_step(dk, dv, dnk, it, g, lo + jm * BLOCK_M, k_smem, v_smem, q_smem, do_smem,
                                            stat_smem, ready, empty, dsT_smem, dq_smem, dq_ready, dq_empty, cols,
                                            SEQ_K, off_c, c0, c1, g_s, BLOCK_M, BLOCK_N,
                                            HEAD_D, STAGES, sT_layout, a_layout, dq_layout, TRANSFORM, DN_KV,
                                            CAUSAL, True, FOLD_RCP)
                it += 1
            for ju in range(n_mask, n_blk):
                dk, dv, dnk = _consume_step(dk, dv, dnk, it, g, lo + ju * BLOCK_M, k_smem, v_smem, q_smem, do_smem,
                                            stat_smem, ready, empty, dsT_smem, dq_smem, dq_ready, dq_empty, cols,
                                            SEQ_K, off_c, c0, c1, g_s, BLOCK_M, BLOCK_N,
                                            HEAD_D, STAGES, sT_layout, a_layout, dq_layout, TRANSFORM, DN_KV,
                                            CAUSAL, False, FOLD_RCP)
                it += 1
        dnk = gl.where(cols < SEQ_K, dnk * 0.6931471805599453, 0.0)  # grad_consts' g_n
        return dk * g_s, dv, dnk

    @gluon.jit
    def _pp_issue_prev(dk, dv, pa_p, dsa_p, it, k2, q_smem, do_smem, dsT_smem, BLOCK_M: gl.constexpr,
                       HEAD_D: gl.constexpr, STAGES: gl.constexpr, dq_layout: gl.constexpr,
                       DS_SMEM: gl.constexpr):
        """The pipelined consumers' products of block ``it - 1``: ``dV += Pᵀ dO``, ``dK += dSᵀ Q``
        (``Pᵀ`` from registers, ``dSᵀ`` from registers or, ``DS_SMEM``, from its shared buffer;
        Q/dO still in their slot) and ``dQ = dS K`` (dSᵀ of both warpgroups in its shared
        buffer), all asynchronous."""
        sp = (it - 1) % STAGES
        qp = q_smem.index(sp).reshape([BLOCK_M, HEAD_D])
        dop = do_smem.index(sp).reshape([BLOCK_M, HEAD_D])
        dv = warpgroup_mma(pa_p, dop, dv, is_async=True)
        if DS_SMEM:
            dk = warpgroup_mma(dsT_smem.index((it - 1) % 2), qp, dk, is_async=True)
        else:
            dk = warpgroup_mma(dsa_p, qp, dk, is_async=True)
        dq = warpgroup_mma(dsT_smem.index((it - 1) % 2).permute((1, 0)), k2,
                           gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout), use_acc=False, is_async=True)
        return dk, dv, dq

    @gluon.jit
    def _pp_retire_prev(dq, it, dq_smem, dq_ready, dq_empty, empty, g_s, BLOCK_M: gl.constexpr,
                        HEAD_D: gl.constexpr, STAGES: gl.constexpr):
        """Block ``it - 1``'s dq staged for the writer (its products done)."""
        b = (it - 1) % 2
        mbarrier.wait(dq_empty.index(b), (((it - 1) // 2) & 1) ^ 1)
        dq_smem.index(b).reshape([BLOCK_M, HEAD_D]).store(dq * g_s)

    @gluon.jit
    def _pp_step(dk, dv, dnk, pa_p, dsa_p, it, start_m, k_smem, v_smem, q_smem, do_smem, stat_smem, ready, empty,
                 dsT_smem, dq_smem, dq_ready, dq_empty, cols, SEQ_K, off_c, c0, c1, g_s, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, sT_layout: gl.constexpr,
                 a_layout: gl.constexpr, dq_layout: gl.constexpr, TRANSFORM: gl.constexpr, DN_KV: gl.constexpr,
                 CAUSAL: gl.constexpr, MASKED: gl.constexpr, FIRST: gl.constexpr, FOLD_RCP: gl.constexpr,
                 DS_SMEM: gl.constexpr):
        """One block of the pipelined consumers: ``Sᵀ``, ``dPᵀ`` of block ``it`` issued ahead of
        block ``it - 1``'s three products, and the score gradients of ``it`` computed while
        those run on the tensor cores (FA3's intra-warpgroup overlap, in the backward). Then
        ``it - 1`` retires (dq staged, its slot released) and ``it``'s dSᵀ goes to shared
        memory (two buffers: the other warpgroup may still read the previous one); one
        barrier per block. ``FIRST``: no block before."""
        dtype: gl.constexpr = k_smem.dtype
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sT_layout))
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        z0 = it >> 30  # 0, but not provably: the operand descriptors are rebuilt per block, not hoisted
        k2 = k_smem.index(z0).reshape([BLOCK_N, HEAD_D])
        v2 = v_smem.index(z0).reshape([BLOCK_N, HEAD_D])
        q2 = q_smem.index(s).reshape([BLOCK_M, HEAD_D])
        do2 = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sT_layout)
        sT = warpgroup_mma(k2, q2.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v2, do2.permute((1, 0)), zero, use_acc=False, is_async=True)
        if FIRST:
            sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
        else:
            dk, dv, dq = _pp_issue_prev(dk, dv, pa_p, dsa_p, it, k2, q_smem, do_smem, dsT_smem, BLOCK_M, HEAD_D,
                                        STAGES, dq_layout, DS_SMEM)
            sT, dpT = warpgroup_mma_wait(3, deps=(sT, dpT))  # block it - 1's products may still run
        pa, dsa, ds_lp, dnk = _grad_scores(sT, dpT, dnk, rows, stat_smem, s, cols, SEQ_K, off_c, c0, c1, dtype,
                                           sT_layout, a_layout, TRANSFORM, DN_KV, CAUSAL, MASKED, FOLD_RCP)
        if not FIRST:
            dq, dk, dv, pa_p, dsa_p = warpgroup_mma_wait(0, deps=(dq, dk, dv, pa_p, dsa_p))
            _pp_retire_prev(dq, it, dq_smem, dq_ready, dq_empty, empty, g_s, BLOCK_M, HEAD_D, STAGES)
        dsT_smem.index(it % 2).store(ds_lp)
        if DS_SMEM:
            dsa = dsa_p  # unused: dK reads dS^T from shared memory (no registers carried, no moves)
        fence_async_shared()
        gl.thread_barrier()  # dS^T of block it from both warpgroups; block it - 1 done everywhere
        if not FIRST:
            mbarrier.arrive(dq_ready.index((it - 1) % 2), count=1)
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        return dk, dv, dnk, pa, dsa

    @gluon.jit
    def _consumers_pipelined(k_smem, v_smem, q_smem, do_smem, stat_smem, ready, empty, dsT_smem, dq_smem, dq_ready,
                             dq_empty, kv_bar, NP, BP, lo, n_blk, n_mask, GROUP, start_n, SEQ_K, off_c, scale,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                             STAGES: gl.constexpr, TRANSFORM: gl.constexpr, DN_KV: gl.constexpr,
                             CAUSAL: gl.constexpr, FOLD_RCP: gl.constexpr, DS_SMEM: gl.constexpr,
                             num_warps: gl.constexpr):
        """``_consumers`` software-pipelined by one block (``_pp_step``): the first block
        (always masked), then the rest, then the last block's products. Same results."""
        sT_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, HEAD_D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                            instr_shape=[16, HEAD_D // (num_warps // 4), 16])
        if TRANSFORM == 1:  # transforms.transform_consts / grad_consts
            n = gl.load(NP).to(gl.float32)
            b = gl.load(BP).to(gl.float32)
            c0 = scale * b
            c1 = n
            g_s = n * b * scale
        else:
            c0 = scale * 1.4426950408889634
            c1 = 0.0
            g_s = scale
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sT_layout))
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
        dnk = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, sT_layout))
        mbarrier.wait(kv_bar, 0)
        total = GROUP * n_blk
        if total > 0:
            pa = gl.zeros([BLOCK_N, BLOCK_M], k_smem.dtype, a_layout)
            dsa = gl.zeros([BLOCK_N, BLOCK_M], k_smem.dtype, a_layout)
            dk, dv, dnk, pa, dsa = _pp_step(dk, dv, dnk, pa, dsa, 0, lo, k_smem, v_smem, q_smem, do_smem, stat_smem,
                                            ready, empty, dsT_smem, dq_smem, dq_ready, dq_empty, cols, SEQ_K, off_c,
                                            c0, c1, g_s, BLOCK_M, BLOCK_N, HEAD_D, STAGES, sT_layout, a_layout,
                                            dq_layout, TRANSFORM, DN_KV, CAUSAL, True, True, FOLD_RCP, DS_SMEM)
            it = 1
            for g in range(GROUP):
                first = (g == 0).to(gl.int32)  # block 0 of head 0 ran above (masked or not)
                for jm in range(first, n_mask):
                    dk, dv, dnk, pa, dsa = _pp_step(dk, dv, dnk, pa, dsa, it, lo + jm * BLOCK_M, k_smem, v_smem,
                                                    q_smem, do_smem, stat_smem, ready, empty, dsT_smem, dq_smem,
                                                    dq_ready, dq_empty, cols, SEQ_K, off_c, c0, c1, g_s, BLOCK_M,
                                                    BLOCK_N, HEAD_D, STAGES, sT_layout, a_layout, dq_layout,
                                                    TRANSFORM, DN_KV, CAUSAL, True, False, FOLD_RCP, DS_SMEM)
                    it += 1
                for ju in range(n_mask + first * (n_mask == 0).to(gl.int32), n_blk):
                    dk, dv, dnk, pa, dsa = _pp_step(dk, dv, dnk, pa, dsa, it, lo + ju * BLOCK_M, k_smem, v_smem,
                                                    q_smem, do_smem, stat_smem, ready, empty, dsT_smem, dq_smem,
                                                    dq_ready, dq_empty, cols, SEQ_K, off_c, c0, c1, g_s, BLOCK_M,
                                                    BLOCK_N, HEAD_D, STAGES, sT_layout, a_layout, dq_layout,
                                                    TRANSFORM, DN_KV, CAUSAL, False, False, FOLD_RCP, DS_SMEM)
                    it += 1
            # the last block's products
            z0 = it >> 30
            k2 = k_smem.index(z0).reshape([BLOCK_N, HEAD_D])
            dk, dv, dq = _pp_issue_prev(dk, dv, pa, dsa, it, k2, q_smem, do_smem, dsT_smem, BLOCK_M, HEAD_D, STAGES,
                                        dq_layout, DS_SMEM)
            dq, dk, dv, pa, dsa = warpgroup_mma_wait(0, deps=(dq, dk, dv, pa, dsa))
            _pp_retire_prev(dq, it, dq_smem, dq_ready, dq_empty, empty, g_s, BLOCK_M, HEAD_D, STAGES)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(dq_ready.index((it - 1) % 2), count=1)
            mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        dnk = gl.where(cols < SEQ_K, dnk * 0.6931471805599453, 0.0)  # grad_consts' g_n
        return dk * g_s, dv, dnk

    @gluon.jit
    def _hopper_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, M, Delta, CS, NP, BP,
                              DN, s_mz, s_mh, s_ms, s_nz, s_nh, HKV, GROUP, SEQ_Q, SEQ_K, scale,
                              TRANSFORM: gl.constexpr, DN_KV: gl.constexpr, CAUSAL: gl.constexpr,
                              STAGES: gl.constexpr, PIPELINE: gl.constexpr, FOLD_RCP: gl.constexpr,
                              DS_SMEM: gl.constexpr, num_warps: gl.constexpr):
        """One program per (key block, batch * kv head); rank-4 ``[B, H, S, D]`` descriptors
        (``dq_desc``: the fp32 accumulator). K and V load once, then the three partitions run;
        dK and dV leave through K's and V's tiles. SSA: ``NP``, ``BP`` hold ``n``, ``b``;
        ``DN_KV``: ``CS`` the forward's row means ``C`` (M's layout), ``DN`` a float64
        ``[B, HKV, key blocks]`` (strides ``s_nz``, ``s_nh``, 1) for one ``dn`` partial per
        program (its keys summed in a fixed order)."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)

        pid_n = gl.program_id(0)
        pid_zh = gl.program_id(1)
        z = pid_zh // HKV
        h_kv = pid_zh % HKV
        h0 = h_kv * GROUP
        start_n = pid_n * BLOCK_N
        off_c = SEQ_K - SEQ_Q
        q_end = ((SEQ_Q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        if CAUSAL:
            first = gl.maximum(start_n - off_c, 0)
            lo = (first // BLOCK_M) * BLOCK_M
            full = gl.maximum(start_n + BLOCK_N - 1 - off_c, 0)
            mid = ((full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        else:
            lo = 0
            mid = 0
        mid = gl.where(start_n + BLOCK_N > SEQ_K, q_end, mid)
        mid = gl.minimum(mid, q_end)
        lo = gl.minimum(lo, mid)
        n_blk = (q_end - lo) // BLOCK_M
        n_mask = (mid - lo) // BLOCK_M
        total = GROUP * n_blk

        k_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
        dsT_smem = gl.allocate_shared_memory(dtype, [2 if PIPELINE else 1, BLOCK_N, BLOCK_M], ds_layout)
        NSTAT: gl.constexpr = 3 if DN_KV else 2  # M, delta (, C) rows per ring slot
        stat_smem = gl.allocate_shared_memory(gl.float32, [STAGES * NSTAT, BLOCK_M],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, HEAD_D], dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(dq_ready.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        fence_async_shared()
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [z, h_kv, start_n, 0], kv_bar, k_smem.index(0))
        tma.async_copy_global_to_shared(v_desc, [z, h_kv, start_n, 0], kv_bar, v_smem.index(0))
        m_base = z.to(gl.int64) * s_mz

        dk, dv, dnk = gl.warp_specialize([
            (_consumers_pipelined if PIPELINE else _consumers,
             (k_smem, v_smem, q_smem, do_smem, stat_smem, ready, empty, dsT_smem, dq_smem, dq_ready,
                          dq_empty, kv_bar, NP, BP, lo, n_blk, n_mask, GROUP, start_n, SEQ_K, off_c, scale,
                          BLOCK_M, BLOCK_N, HEAD_D, STAGES, TRANSFORM, DN_KV, CAUSAL, FOLD_RCP, DS_SMEM, num_warps)),
            (_producer, (q_desc, do_desc, q_smem, do_smem, stat_smem, ready, empty, M, Delta, CS, m_base, s_mh, s_ms,
                         z, h0, lo, n_blk, total, SEQ_Q, BLOCK_M, STAGES, DN_KV)),
            (_dq_writer, (dq_desc, dq_smem, dq_ready, dq_empty, z, h0, lo, n_blk, total, BLOCK_M)),
        ], [1, 1], [24, 24])

        k2 = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
        v2 = v_smem.index(0).reshape([BLOCK_N, HEAD_D])
        k2.store(dk.to(dtype))
        v2.store(dv.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dk_desc, [z, h_kv, start_n, 0], k_smem.index(0))
        tma.async_copy_shared_to_global(dv_desc, [z, h_kv, start_n, 0], v_smem.index(0))
        if DN_KV:  # one float64 dn partial per key block (bwd_kernels.attn_bwd_kernel_dkv's DN_KV)
            gl.store(DN + z.to(gl.int64) * s_nz + h_kv.to(gl.int64) * s_nh + pid_n, gl.sum(dnk.to(gl.float64), axis=0))
        tma.store_wait(pendings=0)


def _descriptor(t: torch.Tensor, rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]
    block = [1, 1, int(rows), int(t.shape[-1])]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, elem))


def launch_gluon_bwd(q, k, v, do, dk, dv, dqa, M, delta, *, causal: bool, scale: float,
                     config: GluonBwdConfig, transform_id: int = 0, n_ptr: Optional[torch.Tensor] = None,
                     b_ptr: Optional[torch.Tensor] = None, cstat: Optional[torch.Tensor] = None,
                     dn_part: Optional[torch.Tensor] = None) -> None:
    """dK, dV into ``dk``, ``dv``; dq added into the zeroed fp32 accumulator ``dqa`` (q's
    shape, dense). ``delta = rowsum(o * dO)`` (``M``'s layout) precomputed. SSA
    (``transform_id`` 1): ``n_ptr``, ``b_ptr`` the parameters; with ``cstat`` (the forward's
    ``C``), one float64 ``dn`` partial per key block into ``dn_part`` (``[B, Hkv,
    gluon_key_blocks(Sk, config)]``, contiguous)."""
    bz, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    block_n = 16 * config.num_warps
    grid = (triton.cdiv(sk, block_n), bz * hkv)
    dn_kv = cstat is not None
    if dn_kv and (dn_part is None or dn_part.dtype != torch.float64 or dn_part.numel() < bz * hkv * grid[0]):
        raise ValueError(f"dn_part must be float64 with {bz * hkv * grid[0]} elements ([B, Hkv, key blocks])")
    _hopper_bwd_ws_kernel[grid](
        _descriptor(q, config.block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        _descriptor(do, config.block_m), _descriptor(dk, block_n), _descriptor(dv, block_n),
        _descriptor(dqa, config.block_m), M, delta, cstat if dn_kv else M, M if n_ptr is None else n_ptr,
        M if b_ptr is None else b_ptr, dn_part if dn_kv else M, M.stride(0), M.stride(1), M.stride(2),
        hkv * grid[0] if dn_kv else 0, grid[0] if dn_kv else 0, hkv, hq // hkv, sq, sk, float(scale),
        TRANSFORM=int(transform_id), DN_KV=dn_kv, CAUSAL=bool(causal), STAGES=config.stages,
        PIPELINE=bool(config.pipeline), FOLD_RCP=int(config.fold_rcp) if int(transform_id) == 1 else 0,
        DS_SMEM=bool(config.ds_smem), num_warps=config.num_warps, maxnreg=config.maxnreg)


def gluon_key_blocks(sk: int, config: GluonBwdConfig) -> int:
    """Key blocks (programs per batch and kv head) of the Gluon backward: its ``dn`` partials."""
    return triton.cdiv(sk, 16 * config.num_warps)
