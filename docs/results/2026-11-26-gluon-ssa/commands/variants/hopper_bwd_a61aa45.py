"""The attention backward's Hopper kernel, written in Gluon: FA3's warp-specialised single pass.

One program per (key block of 128 keys, batch, kv head) loops over the GQA group's query
heads and their 64-row query blocks in three *partitions* (``gl.warp_specialize``):

* a producer warp streams Q and dO through a ``STAGES``-deep ring of TMA copies
  (``ready`` / ``empty`` mbarriers per slot);
* the default partition, two consumer warpgroups of 64 keys each, computes per block
  ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` (asynchronous warpgroup MMAs), ``Pᵀ = exp2(z - M)``,
  ``dSᵀ = Pᵀ (dPᵀ - delta)``, ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` with ``Pᵀ`` and ``dSᵀ``
  from registers, then ``dQ = dS K`` from ``dSᵀ`` staged in shared memory (a transposed view),
  scaled and staged in fp32;
* a writer warp adds each staged dq tile into the fp32 accumulator with one TMA bulk reduce
  (``cp.reduce.async.bulk.tensor``; Gluon 3.6 has the op in its builder but no wrapper).

The two one-warp partitions run at 24 registers, which ``setmaxnreg`` gives to the consumers
(240 each at ``maxnreg=168``). Five products per block against the two-kernel backward's seven;
``dq`` is summed by fp32 atomics in the L2, so it is not bit-identical run to run: the kernel
runs only where the backward may be non-deterministic (``bwd_config.use_single_pass``).

Measured (H100, bf16, causal, softmax; docs/results/2026-11-26-gluon, call 9), backward ms,
Triton two kernels → this kernel: D128 B2 N8192 H8 1.770 → 1.619, B8 N4096 1.829 → 1.695;
with the Gluon forward, fwd+bwd × SDPA cuDNN 1.24 → 1.14 and 1.20 → 1.13 (call 10).
At D64 it was no faster (1.866 → 1.921, 2.036 → 2.044) and the Triton kernels keep D64.
Softmax only: SSA's single pass needs the forward's row means ``C`` and the ``dn`` partials.

Same contract as ``bwd.attention_bwd`` (any forward writing ``o`` and ``M`` under it).
``gluon_bwd_config`` takes it only where it applies and was measured faster; the Triton
backward is its reference, CPU path and fallback (``NEMO_SSA_GLUON=0``). Gluon has no
interpreter: the CPU suite compiles the kernel for sm_90 and checks the dispatch; the GPU
suite checks its gradients.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
import triton

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.tma import MIN_SCORES, tma_ready, wgmma_capable

try:  # Gluon ships with Triton >= 3.5; the package pins 3.6
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

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels run
    HAVE_GLUON = False

__all__ = ["GluonBwdConfig", "GLUON_BWD", "HAVE_GLUON", "gluon_bwd_capable", "gluon_bwd_config", "launch_gluon_bwd"]


class GluonBwdConfig(NamedTuple):
    block_m: int  # query rows per block
    num_warps: int  # the consumer partition (64 keys per warpgroup: BLOCK_N = 16 * num_warps)
    stages: int  # depth of the Q/dO ring
    maxnreg: int  # registers per thread at launch (the workers hand theirs to the consumers)


#: (head dim, transform) -> tiles (H100, docs/results/2026-11-26-gluon, call 9). Three stages
#: do not fit in shared memory at D128 (246 KB).
GLUON_BWD: Dict[tuple, GluonBwdConfig] = {
    (128, "softmax"): GluonBwdConfig(64, 8, 2, 168),
}


def gluon_bwd_capable(transform: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool,
                      dropout: bool) -> bool:
    """Whether the backward of this call can take the Gluon kernel, from what the forward
    knows (``o`` and ``dO`` are checked again in ``gluon_bwd_config``)."""
    if (q.shape[-1], transform) not in GLUON_BWD or not HAVE_GLUON or varlen or dropout:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not env.gluon():
        return False
    bz, hq, sq, _ = q.shape
    if bz * hq * sq * k.shape[2] < MIN_SCORES or not wgmma_capable(q.device):
        return False
    return all(tma_ready(t) for t in (q, k, v)) and k.dtype == v.dtype == q.dtype


def gluon_bwd_config(transform: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                     o: torch.Tensor, *, varlen: bool, dropout: bool) -> Optional[GluonBwdConfig]:
    """The Gluon tiles for this backward call, or None (the Triton kernels run)."""
    if not gluon_bwd_capable(transform, q, k, v, varlen=varlen, dropout=dropout):
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
    def _producer(q_desc, do_desc, q_smem, do_smem, ready, empty, z, h0, lo, n_blk, total,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """Producer warp: Q and dO of every iteration into the ring, each slot refilled once
        the consumers have released it (``empty``; a fresh barrier counts as released)."""
        for it in range(total):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            g, start_m = _coords(it, lo, n_blk, BLOCK_M)
            bar = ready.index(s)
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
    def _consume_step(dk, dv, it, g, start_m, k_smem, v_smem, q_smem, do_smem, ready, empty, dsT_smem, dq_smem,
                      dq_ready, dq_empty, M, Delta, m_base, s_mh, s_ms, h0, cols, SEQ_Q, SEQ_K, off_c, c0, g_s,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                      sT_layout: gl.constexpr, a_layout: gl.constexpr, dq_layout: gl.constexpr,
                      CAUSAL: gl.constexpr, MASKED: gl.constexpr):
        """One query block in the consumer warpgroups: the five products, ``dq`` staged for
        the writer and the Q/dO slot released. ``MASKED``: the causal band or a ragged tail."""
        dtype: gl.constexpr = k_smem.dtype
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sT_layout))
        row_ok = rows < SEQ_Q
        m_off = m_base + (h0 + g).to(gl.int64) * s_mh + rows.to(gl.int64) * s_ms
        m_row = gl.load(M + m_off, mask=row_ok, other=float("inf"))
        d_row = gl.load(Delta + m_off, mask=row_ok, other=0.0)
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
        z2 = sT * c0
        if MASKED:
            keep = gl.expand_dims(cols < SEQ_K, 1)
            if CAUSAL:
                keep = keep & (gl.expand_dims(cols, 1) <= gl.expand_dims(rows + off_c, 0))
            z2 = gl.where(keep, z2, float("-inf"))
        pT = gl.exp2(z2 - gl.expand_dims(m_row, 0))
        dsT = pT * (dpT - gl.expand_dims(d_row, 0))
        pa = gl.convert_layout(pT.to(dtype), a_layout)
        ds_lp = dsT.to(dtype)
        dsa = gl.convert_layout(ds_lp, a_layout)
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
        return dk, dv

    @gluon.jit
    def _consumers(k_smem, v_smem, q_smem, do_smem, ready, empty, dsT_smem, dq_smem, dq_ready, dq_empty, kv_bar,
                   M, Delta, m_base, s_mh, s_ms, h0, lo, n_blk, n_mask, GROUP, start_n, SEQ_Q, SEQ_K, off_c, scale,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """The default partition (two consumer warpgroups, 64 keys each): every query head of
        the group, masked blocks then unmasked ones; returns ``(dK * scale, dV)``."""
        sT_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, HEAD_D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                            instr_shape=[16, HEAD_D // (num_warps // 4), 16])
        c0 = scale * 1.4426950408889634
        g_s = scale
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sT_layout))
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
        mbarrier.wait(kv_bar, 0)
        it = 0
        for g in range(GROUP):
            for jm in range(n_mask):
                dk, dv = _consume_step(dk, dv, it, g, lo + jm * BLOCK_M, k_smem, v_smem, q_smem, do_smem, ready, empty,
                                       dsT_smem, dq_smem, dq_ready, dq_empty, M, Delta, m_base, s_mh, s_ms, h0, cols,
                                       SEQ_Q, SEQ_K, off_c, c0, g_s, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                                       sT_layout, a_layout, dq_layout, CAUSAL, True)
                it += 1
            for ju in range(n_mask, n_blk):
                dk, dv = _consume_step(dk, dv, it, g, lo + ju * BLOCK_M, k_smem, v_smem, q_smem, do_smem, ready, empty,
                                       dsT_smem, dq_smem, dq_ready, dq_empty, M, Delta, m_base, s_mh, s_ms, h0, cols,
                                       SEQ_Q, SEQ_K, off_c, c0, g_s, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                                       sT_layout, a_layout, dq_layout, CAUSAL, False)
                it += 1
        return dk * g_s, dv

    @gluon.jit
    def _hopper_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, M, Delta,
                              s_mz, s_mh, s_ms, HKV, GROUP, SEQ_Q, SEQ_K, scale,
                              CAUSAL: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """One program per (key block, batch * kv head); rank-4 ``[B, H, S, D]`` descriptors
        (``dq_desc``: the fp32 accumulator). K and V load once, then the three partitions run;
        dK and dV leave through K's and V's tiles."""
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
        dsT_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
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

        dk, dv = gl.warp_specialize([
            (_consumers, (k_smem, v_smem, q_smem, do_smem, ready, empty, dsT_smem, dq_smem, dq_ready, dq_empty, kv_bar,
                          M, Delta, m_base, s_mh, s_ms, h0, lo, n_blk, n_mask, GROUP, start_n, SEQ_Q, SEQ_K, off_c, scale,
                          BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, num_warps)),
            (_producer, (q_desc, do_desc, q_smem, do_smem, ready, empty, z, h0, lo, n_blk, total, BLOCK_M, STAGES)),
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
        tma.store_wait(pendings=0)


def _descriptor(t: torch.Tensor, rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]
    block = [1, 1, int(rows), int(t.shape[-1])]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, elem))


def launch_gluon_bwd(q, k, v, do, dk, dv, dqa, M, delta, *, causal: bool, scale: float,
                     config: GluonBwdConfig) -> None:
    """dK, dV into ``dk``, ``dv``; dq added into the zeroed fp32 accumulator ``dqa`` (q's
    shape, dense). ``delta = rowsum(o * dO)`` (``M``'s layout) precomputed."""
    bz, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    block_n = 16 * config.num_warps
    grid = (triton.cdiv(sk, block_n), bz * hkv)
    _hopper_bwd_ws_kernel[grid](
        _descriptor(q, config.block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        _descriptor(do, config.block_m), _descriptor(dk, block_n), _descriptor(dv, block_n),
        _descriptor(dqa, config.block_m), M, delta, M.stride(0), M.stride(1), M.stride(2),
        hkv, hq // hkv, sq, sk, float(scale),
        CAUSAL=bool(causal), STAGES=config.stages, num_warps=config.num_warps, maxnreg=config.maxnreg)
