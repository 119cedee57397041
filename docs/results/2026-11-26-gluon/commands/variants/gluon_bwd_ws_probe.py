"""Probe: a warp-specialised Gluon (Hopper) single-pass attention backward, softmax (FA3's
design): a producer warp streams Q/dO through a TMA ring, a writer warp adds each dq tile
into the fp32 accumulator with a TMA bulk reduce, and the default partition (two consumer
warpgroups, 64 keys each) computes S^T, dP^T, dV, dK and dQ. Registers move from the two
one-warp partitions to the consumers (``maxnreg`` at launch, 24 for the workers).
"""
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language._core import builtin  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _coords(it, lo, n_blk, BLOCK_M: gl.constexpr):
    g = it // gl.maximum(n_blk, 1)
    j = lo // BLOCK_M + it - g * n_blk
    return g, j * BLOCK_M


@gluon.jit
def _producer(q_desc, do_desc, q_smem, do_smem, ready, empty, z, h0, lo, n_blk, total,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
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


def _lay(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                                                        torch.float32: gl.float32}[dtype])


def hopper_bwd_ws(q, k, v, o, do, M, *, causal=True, scale=None, block_m=64, stages=2, num_warps=8, maxnreg=168,
                  poison=False):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from nemo_ssa.ops.common.bwd_kernels import attn_bwd_preprocess, attn_bwd_postprocess
    bz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    block_n = 64 * (num_warps // 4)
    delta = torch.empty_like(M)
    dqa = torch.empty(bz, hq, sq, d, device=q.device, dtype=torch.float32)
    attn_bwd_preprocess[(triton.cdiv(sq, 64), bz * hq)](
        o, do, delta, M, dqa, *o.stride(), *do.stride(), *M.stride(), *dqa.stride(), hq, sq,
        HEAD_DIM=d, BLOCK_D=d, BLOCK_M=64, VARLEN=False, ZERO_DQ=True)
    dk = torch.full_like(k, float("nan")) if poison else torch.empty_like(k)
    dv = torch.full_like(v, float("nan")) if poison else torch.empty_like(v)

    def desc(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], _lay([1, 1, rows, d], t.dtype))

    grid = (triton.cdiv(sk, block_n), bz * hkv)
    _hopper_bwd_ws_kernel[grid](desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(do, block_m),
                                desc(dk, block_n), desc(dv, block_n), desc(dqa, block_m), M, delta,
                                M.stride(0), M.stride(1), M.stride(2), hkv, hq // hkv, sq, sk, float(scale),
                                CAUSAL=bool(causal), STAGES=stages, num_warps=num_warps, maxnreg=maxnreg)
    dq = torch.empty_like(q)
    numel = dqa.numel()
    attn_bwd_postprocess[(triton.cdiv(numel, 4096), )](dqa, dq, dqa, numel, 0, BLOCK=4096, DN_BLOCK=16,
                                                       CAST=True, DPARAMS=False)
    return dq, dk, dv
