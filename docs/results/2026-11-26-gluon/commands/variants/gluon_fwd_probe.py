"""Probe: a Gluon (Hopper) attention forward with FA3's intra-warpgroup overlap.

One program: BLOCK_M query rows (num_warps // 4 warpgroups), K/V tiles in a STAGES-deep
TMA ring. Per key block j: issue S_j = Q K_j^T (async wgmma), issue O += P_{j-1} V_{j-1}
(async, P from registers), wait for S_j only, run the score transform + online softmax on
S_j while the PV product runs, then wait for it and rescale O.
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




@gluon.jit
def _abs_fast(x):
    return gl.inline_asm_elementwise("abs.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _lg2(x):
    return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _flip_sign(x, s):
    return gl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, 0x80000000, 0x78;", "=r,r,r",
        [x.to(gl.uint32, bitcast=True), s.to(gl.uint32, bitcast=True)],
        dtype=gl.uint32, is_pure=True, pack=1).to(gl.float32, bitcast=True)


@gluon.jit
def _score(qk, c0, c1, TRANSFORM: gl.constexpr):
    # the same operations as transforms.score_fwd_hoisted with FAST_LOG2 = 1
    if TRANSFORM == 1:
        mag = _lg2(_abs_fast(qk) * c0 + 1.0)
        z2 = c1 * _flip_sign(mag, qk)
    else:
        z2 = qk * c0
    return z2


@gluon.jit
def _load_kv(desc, smem, bars, z, h, j, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred):
    s = j % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(desc, [z, h, j * BLOCK_N, 0], bar, smem.index(s), pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, j, SEQ_K, off_c, c0, c1,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr, TRANSFORM: gl.constexpr,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    z2 = _score(s, c0, c1, TRANSFORM)
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < SEQ_K, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + off_c, 1))
        z2 = gl.where(keep, z2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(z2, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, gl.max(z2, 1))
        m_use = m_new
    p = gl.exp2(z2 - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _pipelined_blocks(o, p, m_i, l_i, q2, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, off_z, row_kv,
                      lo, hi, n_blocks, rows, SEQ_K, off_c, c0, c1,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEAD_D: gl.constexpr,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                      TRANSFORM: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """Blocks ``lo .. hi - 1`` (``lo >= 1``); ``p`` holds block ``lo - 1``'s probabilities."""
    dtype: gl.constexpr = k_desc.dtype
    BLOCK_M: gl.constexpr = q2.shape[0]
    for j in range(lo, hi):
        sk = j % STAGES
        mbarrier.wait(k_bars.index(sk), (j // STAGES) & 1)
        k2 = k_smem.index(sk).reshape([BLOCK_N, HEAD_D])
        s = warpgroup_mma(q2, k2.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        jv = j - 1
        sv = jv % STAGES
        mbarrier.wait(v_bars.index(sv), (jv // STAGES) & 1)
        v2 = v_smem.index(sv).reshape([BLOCK_N, HEAD_D])
        pa = gl.convert_layout(p.to(dtype), p_layout)
        o = warpgroup_mma(pa, v2, o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, j, SEQ_K, off_c, c0, c1, BLOCK_N, s_layout,
                                           TRANSFORM, CAUSAL, MASKED)
        o, pa = warpgroup_mma_wait(0, deps=(o, pa))
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        gl.thread_barrier()  # every warpgroup is done with K_j and V_{j-1}: refill their slots
        _load_kv(k_desc, k_smem, k_bars, off_z, row_kv, j + STAGES, BLOCK_N, STAGES, j + STAGES < n_blocks)
        _load_kv(v_desc, v_smem, v_bars, off_z, row_kv, jv + STAGES, BLOCK_N, STAGES, jv + STAGES < n_blocks)
    return o, p, m_i, l_i


@gluon.jit
def _hopper_fwd_kernel(q_desc, k_desc, v_desc, o_desc, M, NP, BP,
                       s_mz, s_mh, s_ms, HQ, GROUP, SEQ_Q, SEQ_K, scale,
                       TRANSFORM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                       num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m  # longest rows first
    pid_zh = gl.program_id(1)
    off_z = pid_zh // HQ
    off_hq = pid_zh % HQ
    off_hkv = off_hq // GROUP
    start_m = pid_m * BLOCK_M
    off_c = SEQ_K - SEQ_Q
    if CAUSAL:
        hi = gl.minimum(SEQ_K, start_m + BLOCK_M + off_c)
        full = gl.maximum(gl.minimum((start_m + off_c + 1) // BLOCK_N, SEQ_K // BLOCK_N), 0)
    else:
        hi = SEQ_K
        full = SEQ_K // BLOCK_N
    n_blocks = gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1)  # block 0 always (masked) -> empty rows
    full = gl.minimum(full, n_blocks)

    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_z, off_hq, start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, k_smem, k_bars, off_z, off_hkv, i, BLOCK_N, STAGES, i < n_blocks)
        _load_kv(v_desc, v_smem, v_bars, off_z, off_hkv, i, BLOCK_N, STAGES, i < n_blocks)
    n, b = 1.0, 1.0
    if TRANSFORM == 1:
        n = gl.load(NP)
        b = gl.load(BP)
        c0 = scale * b
        c1 = n
    else:
        c0 = scale * 1.4426950408889634
        c1 = n

    rows = start_m + gl.arange(0, BLOCK_M, layout=row_l)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_l)
    mbarrier.wait(q_bar, 0)
    q2 = q_smem.reshape([BLOCK_M, HEAD_D])
    # block 0, masked (cheap once; covers rows that see no key)
    mbarrier.wait(k_bars.index(0), 0)
    k2 = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
    s = warpgroup_mma(q2, k2.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, rows, 0, SEQ_K, off_c, c0, c1, BLOCK_N, s_layout,
                                       TRANSFORM, CAUSAL, True)
    o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    gl.thread_barrier()
    _load_kv(k_desc, k_smem, k_bars, off_z, off_hkv, STAGES, BLOCK_N, STAGES, STAGES < n_blocks)
    lo_masked = gl.maximum(full, 1)
    o, p, m_i, l_i = _pipelined_blocks(o, p, m_i, l_i, q2, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
                                       off_z, off_hkv, 1, lo_masked, n_blocks, rows, SEQ_K, off_c, c0, c1,
                                       BLOCK_N, STAGES, HEAD_D, s_layout, o_layout, p_layout,
                                       TRANSFORM, CAUSAL, False)
    o, p, m_i, l_i = _pipelined_blocks(o, p, m_i, l_i, q2, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
                                       off_z, off_hkv, lo_masked, n_blocks, n_blocks, rows, SEQ_K, off_c, c0, c1,
                                       BLOCK_N, STAGES, HEAD_D, s_layout, o_layout, p_layout,
                                       TRANSFORM, CAUSAL, True)
    jv = n_blocks - 1
    sv = jv % STAGES
    mbarrier.wait(v_bars.index(sv), (jv // STAGES) & 1)
    v2 = v_smem.index(sv).reshape([BLOCK_N, HEAD_D])
    o = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v2, o)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    m_out = gl.where(empty, float("inf"), m_i + gl.log2(l_safe))
    o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout)), 1)
    gl.store(M + off_z.to(gl.int64) * s_mz + off_hq.to(gl.int64) * s_mh + rows * s_ms, m_out, mask=rows < SEQ_Q)
    gl.thread_barrier()  # every warpgroup's last read of Q is done
    q2.store(o.to(dtype))  # Q's tile is free now: stage O there
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [off_z, off_hq, start_m, 0], q_smem)
    tma.store_wait(pendings=0)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


def _layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def hopper_fwd(q, k, v, *, transform="softmax", n=None, b=None, causal=True, scale=None,
               block_m=128, block_n=128, stages=2, num_warps=8, poison=False):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    bz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    o = torch.full_like(q, float('nan')) if poison else torch.empty_like(q)
    M = torch.empty(bz, hq, sq, device=q.device, dtype=torch.float32)
    lq = _layout([1, 1, block_m, d], q.dtype)
    lk = _layout([1, 1, block_n, d], q.dtype)
    qd = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, block_m, d], lq)
    od = TensorDescriptor(o, list(o.shape), list(o.stride()), [1, 1, block_m, d], lq)
    kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, block_n, d], lk)
    vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, block_n, d], lk)
    tid = 1 if transform == "ssa" else 0
    np_ = n if n is not None else M
    bp_ = b if b is not None else M
    grid = (triton.cdiv(sq, block_m), bz * hq)
    _hopper_fwd_kernel[grid](qd, kd, vd, od, M, np_, bp_, M.stride(0), M.stride(1), M.stride(2),
                             hq, hq // hkv, sq, sk, float(scale), TRANSFORM=tid, CAUSAL=bool(causal),
                             STAGES=stages, num_warps=num_warps)
    return o, M
