"""Probe: a Gluon (Hopper) dK/dV kernel for the two-kernel backward (the Triton dQ kernel
computes dq and delta first), softmax and SSA, with its products overlapped.

One program (one warpgroup) per (key block of BLOCK_N keys, batch, kv head); loops over the
GQA group's query heads and their query blocks of BLOCK_M rows (a STAGES-deep TMA ring of Q
and dO). Iteration i issues S^T_i = K Q_i^T and dP^T_i = V dO_i^T, then the previous block's
dV += P^T_{i-1} dO_{i-1} and dK += dS^T_{i-1} Q_{i-1} (operands from registers), waits for
S^T_i / dP^T_i only and computes P^T_i, dS^T_i while the tensor cores run the previous
block's two products.
"""
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from nemo_ssa.ops.attention.hopper import _abs_fast, _flip_sign, _lg2  # noqa: E402


@gluon.jit
def _rcp(x):
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _load_qdo(q_desc, do_desc, q_smem, do_smem, bars, z, h0, it, lo, n_blk, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, pred):
    g = it // gl.maximum(n_blk, 1)
    j = lo // BLOCK_M + it - g * n_blk
    s = it % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(q_desc, [z, h0 + g, j * BLOCK_M, 0], bar, q_smem.index(s), pred)
    tma.async_copy_global_to_shared(do_desc, [z, h0 + g, j * BLOCK_M, 0], bar, do_smem.index(s), pred)


@gluon.jit
def _dkv_step(dk, dv, pa, dsa, it, g, start_m, k2, v2, q_smem, do_smem, bars,
              q_desc, do_desc, M, Delta, m_base, s_mh, s_ms,
              z, h0, lo, n_blk, total, cols, SEQ_Q, SEQ_K, off_c, c0, c1,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              sT_layout: gl.constexpr, a_layout: gl.constexpr, TRANSFORM: gl.constexpr,
              CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sT_layout))
    row_ok = rows < SEQ_Q
    m_off = m_base + (h0 + g).to(gl.int64) * s_mh + rows.to(gl.int64) * s_ms
    m_row = gl.load(M + m_off, mask=row_ok, other=float("inf"))
    d_row = gl.load(Delta + m_off, mask=row_ok, other=0.0)
    s = it % STAGES
    mbarrier.wait(bars.index(s), (it // STAGES) & 1)
    q2 = q_smem.index(s).reshape([BLOCK_M, HEAD_D])
    do2 = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, sT_layout)
    sT = warpgroup_mma(k2, q2.permute((1, 0)), zero, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v2, do2.permute((1, 0)), zero, use_acc=False, is_async=True)
    # the previous block's products (at it == 0: zero operands against this block's tiles)
    sp = gl.where(it == 0, s, (it + STAGES - 1) % STAGES)
    qp = q_smem.index(sp).reshape([BLOCK_M, HEAD_D])
    dop = do_smem.index(sp).reshape([BLOCK_M, HEAD_D])
    dv = warpgroup_mma(pa, dop, dv, is_async=True)
    dk = warpgroup_mma(dsa, qp, dk, is_async=True)
    sT, dpT = warpgroup_mma_wait(2, deps=(sT, dpT))
    if TRANSFORM == 1:  # transforms.score_bwd_parts, FAST_LOG2 = 1
        t = _abs_fast(sT) * c0 + 1.0
        z2 = c1 * _flip_sign(_lg2(t), sT)
        rinv = _rcp(t)
    else:
        z2 = sT * c0
    if MASKED:
        keep = gl.expand_dims(cols < SEQ_K, 1)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 1) <= gl.expand_dims(rows + off_c, 0))
        z2 = gl.where(keep, z2, float("-inf"))
    pT = gl.exp2(z2 - gl.expand_dims(m_row, 0))
    dsT = pT * (dpT - gl.expand_dims(d_row, 0))
    if TRANSFORM == 1:
        dsT = dsT * rinv
    pa_new = gl.convert_layout(pT.to(dtype), a_layout)
    dsa_new = gl.convert_layout(dsT.to(dtype), a_layout)
    dk, dv, pa, dsa = warpgroup_mma_wait(0, deps=(dk, dv, pa, dsa))
    gl.thread_barrier()  # the previous block's slot is read by every warp: refill it
    _load_qdo(q_desc, do_desc, q_smem, do_smem, bars, z, h0, it - 1 + STAGES, lo, n_blk, BLOCK_M, STAGES,
              (it >= 1) & (it - 1 + STAGES < total))
    return dk, dv, pa_new, dsa_new


@gluon.jit
def _hopper_dkv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, M, Delta, NP, BP,
                       s_mz, s_mh, s_ms, HKV, GROUP, SEQ_Q, SEQ_K, scale,
                       TRANSFORM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                       num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    sT_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)

    pid_n = gl.program_id(0)
    pid_zh = gl.program_id(1)
    z = pid_zh // HKV
    h_kv = pid_zh % HKV
    h0 = h_kv * GROUP
    start_n = pid_n * BLOCK_N
    off_c = SEQ_K - SEQ_Q
    q_end = ((SEQ_Q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if CAUSAL:  # device.q_range_for_kv_block
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

    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [z, h_kv, start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [z, h_kv, start_n, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES):
        _load_qdo(q_desc, do_desc, q_smem, do_smem, bars, z, h0, i, lo, n_blk, BLOCK_M, STAGES, i < total)

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
    m_base = z.to(gl.int64) * s_mz
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, kv_layout)
    pa = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    dsa = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    mbarrier.wait(kv_bar, 0)
    k2 = k_smem.reshape([BLOCK_N, HEAD_D])
    v2 = v_smem.reshape([BLOCK_N, HEAD_D])
    it = 0
    for g in range(GROUP):
        for jm in range(n_mask):
            dk, dv, pa, dsa = _dkv_step(dk, dv, pa, dsa, it, g, lo + jm * BLOCK_M, k2, v2, q_smem, do_smem, bars,
                                        q_desc, do_desc, M, Delta, m_base, s_mh, s_ms,
                                        z, h0, lo, n_blk, total, cols, SEQ_Q, SEQ_K, off_c, c0, c1,
                                        BLOCK_M, BLOCK_N, HEAD_D, STAGES, sT_layout, a_layout, TRANSFORM,
                                        CAUSAL, True)
            it += 1
        for ju in range(n_mask, n_blk):
            dk, dv, pa, dsa = _dkv_step(dk, dv, pa, dsa, it, g, lo + ju * BLOCK_M, k2, v2, q_smem, do_smem, bars,
                                        q_desc, do_desc, M, Delta, m_base, s_mh, s_ms,
                                        z, h0, lo, n_blk, total, cols, SEQ_Q, SEQ_K, off_c, c0, c1,
                                        BLOCK_M, BLOCK_N, HEAD_D, STAGES, sT_layout, a_layout, TRANSFORM,
                                        CAUSAL, False)
            it += 1
    if total > 0:  # the last block's two products
        sl = (total - 1) % STAGES
        dv = warpgroup_mma(pa, do_smem.index(sl).reshape([BLOCK_M, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(dsa, q_smem.index(sl).reshape([BLOCK_M, HEAD_D]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    gl.thread_barrier()
    k2.store((dk * g_s).to(dtype))  # K and V are free: stage dK, dV there
    v2.store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [z, h_kv, start_n, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [z, h_kv, start_n, 0], v_smem)
    tma.store_wait(pendings=0)
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def _lay(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype])


def launch_dkv(q, k, v, do, dk, dv, M, delta, n_ptr, b_ptr, *, transform_id, causal, scale,
               block_m=32, block_n=64, stages=3, num_warps=4):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    bz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]

    def desc(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], _lay([1, 1, rows, d], t.dtype))

    grid = (triton.cdiv(sk, block_n), bz * hkv)
    _hopper_dkv_kernel[grid](desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(do, block_m),
                             desc(dk, block_n), desc(dv, block_n), M, delta, n_ptr, b_ptr,
                             M.stride(0), M.stride(1), M.stride(2), hkv, hq // hkv, sq, sk, float(scale),
                             TRANSFORM=int(transform_id), CAUSAL=bool(causal), STAGES=stages, num_warps=num_warps)


def patch_bwd(block_m=32, block_n=64, stages=3, num_warps=4):
    """Route ops.common.bwd's dK/dV launch of the two-kernel backward to this kernel."""
    import nemo_ssa.ops.common.bwd as B
    orig = B._launch_dkv

    def _launch(c, cfg, tma, kv_args, q, k, v, do, dk, dv, meta, dqa=None):
        if dqa is not None or c.varlen or c.dropout_p > 0 or c.d not in (64, 128):
            return orig(c, cfg, tma, kv_args, q, k, v, do, dk, dv, meta, dqa)
        launch_dkv(q, k, v, do, dk, dv, kv_args[6], kv_args[7], c.n_ptr, c.b_ptr,
                   transform_id=c.meta["TRANSFORM"], causal=c.meta["CAUSAL"], scale=c.scale,
                   block_m=block_m, block_n=block_n, stages=stages, num_warps=num_warps)

    B._launch_dkv = _launch
    return orig
