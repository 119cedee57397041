"""The flash forward's Hopper kernel, written in Gluon (``triton.experimental.gluon``).

Same contract as ``flash._attn_fwd_kernel`` (``o`` and the log2 row statistic ``M``, ``+inf``
for rows without a visible key; softmax or SSA; causal bottom-right aligned; GQA), which
stays its reference and its path everywhere else (CPU interpreter, other GPUs, packed
sequences, dropout, ...). What Gluon gives that Triton's compiler does not: FA3's
*intra-warpgroup overlap*. Per key block ``j`` the kernel issues ``S_j = Q K_j^T`` and
``O += P_{j-1} V_{j-1}`` as asynchronous warpgroup MMAs, waits for ``S_j`` only, and runs
the score transform and the online softmax of block ``j`` while the tensor cores still work
on ``P_{j-1} V_{j-1}``. K and V arrive through a ``STAGES``-deep ring of TMA copies with one
mbarrier per slot; ``P`` feeds its product from registers.

Measured (H100, bf16, causal, ``benchmarks/bench_attention.py --wide``, forward ms, Triton →
Gluon; docs/results/2026-11-26-gluon): D128 softmax 0.624 → 0.565 (B2 N8K H8) and 0.645 →
0.593 (B8 N4K), SSA 0.698 → 0.656 and 0.705 → 0.666. At D64 it was no faster (softmax
0.648 → 0.656 and 0.723 → 0.747; SSA likewise), so D64 keeps the Triton kernel -- except for
SSA with the row means ``C`` (``SAVE_C``: ``C_i = sum_j p_ij smag_ij``, what the single-pass
backward's ``dn`` needs), where it is 4-5 % faster (docs/results/2026-11-26-gluon-ssa).

Taken (``gluon_fwd_config``) only where it applies and was measured faster: compute
capability exactly 9.0 (``wgmma`` is sm_90a-only), a table row for (head dim, transform)
(D128; SSA at D64 with ``C`` only), 16-bit dense ``[B, H, S, D]`` inputs the TMA can address,
no dropout, the SSA ``log2`` mode the backward recomputes (PTX ``lg2.approx``, no polynomial
split), at least ``tma.MIN_SCORES`` scores, no explicit Triton config; ``NEMO_SSA_GLUON=0``
turns it off. Gluon has no interpreter: the CPU suite
compiles these kernels for sm_90 and checks the dispatch; the GPU suite checks results.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import triton

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.gluon_math import HAVE_GLUON
from nemo_ssa.ops.common.tma import MIN_SCORES, tma_ready, wgmma_capable

if HAVE_GLUON:  # Triton 3.6 exactly (gluon_math.GLUON_TRITON)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from nemo_ssa.ops.common.gluon_math import score, ssa_parts

__all__ = ["GluonFwdConfig", "GLUON_FWD", "HAVE_GLUON", "gluon_fwd_config", "gluon_fwd"]


class GluonFwdConfig(NamedTuple):
    block_m: int  # query rows per program (64 per warpgroup)
    block_n: int  # keys per block
    stages: int  # depth of the K/V ring
    num_warps: int
    c_only: bool = False  # taken only where the forward also writes C (SSA's single-pass backward)


#: (head dim, transform) -> tiles, measured on an H100 (docs/results/2026-11-26-gluon):
#: one warpgroup per program (two programs per SM) beat 128 rows on two warpgroups
#: (a program-wide barrier per block for the ring and no second program to overlap it),
#: 64-key blocks with three stages beat 128-key blocks. At D64 the Gluon kernel is no faster than
#: the Triton one except with SSA's row means C (the single-pass backward's forward): 0.953 against
#: 0.997 ms (B2 N8K H16) and 0.968 against 1.018 (B8 N4K; docs/results/2026-11-26-gluon-ssa, call 6).
#: There 128-key blocks with two stages (249 registers, still two programs per SM) then beat 64-key
#: ones under the folded-reciprocal backward: fwd+bwd 3.050 -> 3.009 ms (B2) and 3.171 -> 3.147
#: (B8), medians of three interleaved rounds (docs/results/2026-11-26-ssa-d64-mufu, call 7).
GLUON_FWD: Dict[Tuple[int, str], GluonFwdConfig] = {
    (128, "softmax"): GluonFwdConfig(64, 64, 3, 4),
    (128, "ssa"): GluonFwdConfig(64, 64, 3, 4),
    (64, "ssa"): GluonFwdConfig(64, 128, 2, 4, c_only=True),
}


def gluon_fwd_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *, transform: str,
                     varlen: bool, dropout: bool, save_c: bool, fast_log2: int,
                     explicit_config: bool) -> Optional[GluonFwdConfig]:
    """The Gluon tiles for this call, or None (the Triton kernel runs). See the module
    docstring for the conditions; every one is a measured or a correctness limit."""
    cfg = GLUON_FWD.get((q.shape[-1], transform))  # first: the recipe's D32 calls stop here
    if cfg is None or not HAVE_GLUON or varlen or dropout or explicit_config or (cfg.c_only and not save_c):
        return None
    if q.dtype not in (torch.bfloat16, torch.float16) or not env.gluon():
        return None
    if transform == "ssa" and fast_log2 != 1:  # the backward recomputes z with this log2
        return None
    bz, hq, sq, _ = q.shape
    if bz * hq * sq * k.shape[2] < MIN_SCORES or not wgmma_capable(q.device):
        return None
    if not all(tma_ready(t) for t in (q, k, v, o)) or not (k.dtype == v.dtype == o.dtype == q.dtype):
        return None
    return cfg


if HAVE_GLUON:

    @gluon.jit
    def _load_kv(desc, smem, bars, z, h, j, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred):
        """TMA copy of key block ``j`` into ring slot ``j % STAGES`` (skipped where ``pred``
        is false); rows past the sequence read as 0."""
        s = j % STAGES
        bar = bars.index(s)
        mbarrier.expect(bar, desc.block_type.nbytes, pred)
        tma.async_copy_global_to_shared(desc, [z, h, j * BLOCK_N, 0], bar, smem.index(s), pred)

    @gluon.jit
    def _softmax_step(s, m_i, l_i, c_i, rows, j, SEQ_K, off_c, c0, c1,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr, TRANSFORM: gl.constexpr,
                      CAUSAL: gl.constexpr, MASKED: gl.constexpr, SAVE_C: gl.constexpr):
        """Online softmax of one score tile: ``(p, m_new, l, c, alpha)``, as the Triton
        kernel's inner loop (rows without a visible key keep ``m = -inf`` and ``p = 0``).
        ``SAVE_C`` (SSA): ``c`` also sums ``p * smag`` (masked keys: ``p = 0``, finite ``smag``)."""
        if SAVE_C:
            z2, smag, _ = ssa_parts(s, c0, c1)
        else:
            z2 = score(s, c0, c1, TRANSFORM)
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
        if SAVE_C:
            c_i = c_i * alpha + gl.sum(p * smag, 1)
        return p, m_new, l_i, c_i, alpha

    @gluon.jit
    def _pipelined_blocks(o, p, m_i, l_i, c_i, q2, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, off_z, off_h,
                          lo, hi, n_blocks, rows, SEQ_K, off_c, c0, c1,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEAD_D: gl.constexpr,
                          s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                          TRANSFORM: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                          SAVE_C: gl.constexpr):
        """Key blocks ``lo .. hi - 1`` (``lo >= 1``); ``p`` holds block ``lo - 1``'s
        probabilities, whose PV product is issued in the first iteration."""
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
            s = warpgroup_mma_wait(1, deps=(s, ))  # S_j done; P_{j-1} V_{j-1} may still run
            p, m_i, l_i, c_i, alpha = _softmax_step(s, m_i, l_i, c_i, rows, j, SEQ_K, off_c, c0, c1, BLOCK_N,
                                                    s_layout, TRANSFORM, CAUSAL, MASKED, SAVE_C)
            o, pa = warpgroup_mma_wait(0, deps=(o, pa))
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            gl.thread_barrier()  # every warp is done with K_j and V_{j-1}: refill their slots
            _load_kv(k_desc, k_smem, k_bars, off_z, off_h, j + STAGES, BLOCK_N, STAGES, j + STAGES < n_blocks)
            _load_kv(v_desc, v_smem, v_bars, off_z, off_h, jv + STAGES, BLOCK_N, STAGES, jv + STAGES < n_blocks)
        return o, p, m_i, l_i, c_i

    @gluon.jit
    def _hopper_fwd_kernel(q_desc, k_desc, v_desc, o_desc, M, CS, NP, BP,
                           s_mz, s_mh, s_ms, HQ, GROUP, SEQ_Q, SEQ_K, scale,
                           TRANSFORM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                           SAVE_C: gl.constexpr, num_warps: gl.constexpr):
        """One program per (query block, batch * query head). ``*_desc``: rank-4 TMA
        descriptors of ``[B, H, S, D]`` tensors with ``[1, 1, rows, D]`` boxes. ``SAVE_C``
        (SSA): the row means ``C = sum_j p smag`` into ``CS`` (M's layout), as the Triton
        kernel writes them for the single-pass backward's ``dn``."""
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
            pid_m = gl.num_programs(0) - 1 - pid_m  # longest rows first (tail balance)
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
        # block 0 always runs (masked): rows that see no key come out empty (M = +inf)
        n_blocks = gl.maximum((hi + BLOCK_N - 1) // BLOCK_N, 1)
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
        if TRANSFORM == 1:  # transforms.transform_consts
            c0 = scale * gl.load(BP).to(gl.float32)
            c1 = gl.load(NP).to(gl.float32)
        else:
            c0 = scale * 1.4426950408889634
            c1 = 0.0

        rows = start_m + gl.arange(0, BLOCK_M, layout=row_l)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_l)
        c_i = gl.zeros([BLOCK_M], gl.float32, row_l)
        mbarrier.wait(q_bar, 0)
        q2 = q_smem.reshape([BLOCK_M, HEAD_D])
        mbarrier.wait(k_bars.index(0), 0)
        k2 = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
        s = warpgroup_mma(q2, k2.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
        p, m_i, l_i, c_i, alpha = _softmax_step(s, m_i, l_i, c_i, rows, 0, SEQ_K, off_c, c0, c1, BLOCK_N,
                                                s_layout, TRANSFORM, CAUSAL, True, SAVE_C)
        o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
        gl.thread_barrier()
        _load_kv(k_desc, k_smem, k_bars, off_z, off_hkv, STAGES, BLOCK_N, STAGES, STAGES < n_blocks)
        # blocks every row sees in full need no mask; the causal diagonal band and the
        # ragged tail of Sk do
        lo_masked = gl.maximum(full, 1)
        o, p, m_i, l_i, c_i = _pipelined_blocks(o, p, m_i, l_i, c_i, q2, k_smem, v_smem, k_bars, v_bars, k_desc,
                                                v_desc, off_z, off_hkv, 1, lo_masked, n_blocks, rows, SEQ_K, off_c,
                                                c0, c1, BLOCK_N, STAGES, HEAD_D, s_layout, o_layout, p_layout,
                                                TRANSFORM, CAUSAL, False, SAVE_C)
        o, p, m_i, l_i, c_i = _pipelined_blocks(o, p, m_i, l_i, c_i, q2, k_smem, v_smem, k_bars, v_bars, k_desc,
                                                v_desc, off_z, off_hkv, lo_masked, n_blocks, n_blocks, rows, SEQ_K,
                                                off_c, c0, c1, BLOCK_N, STAGES, HEAD_D, s_layout, o_layout,
                                                p_layout, TRANSFORM, CAUSAL, True, SAVE_C)
        jv = n_blocks - 1
        sv = jv % STAGES
        mbarrier.wait(v_bars.index(sv), (jv // STAGES) & 1)
        v2 = v_smem.index(sv).reshape([BLOCK_N, HEAD_D])
        o = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v2, o)

        empty = l_i == 0.0  # no visible key: o = 0, M = +inf (the backward then gets p = 0)
        l_safe = gl.where(empty, 1.0, l_i)
        m_out = gl.where(empty, float("inf"), m_i + gl.log2(l_safe))
        o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout)), 1)
        m_off = off_z.to(gl.int64) * s_mz + off_hq.to(gl.int64) * s_mh + rows.to(gl.int64) * s_ms
        gl.store(M + m_off, m_out, mask=rows < SEQ_Q)
        if SAVE_C:  # C = E_p[smag] per row (0 for rows without a key)
            gl.store(CS + m_off, c_i / l_safe, mask=rows < SEQ_Q)
        gl.thread_barrier()  # every warp's last read of Q is done: stage O in its tile
        q2.store(o.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [off_z, off_hq, start_m, 0], q_smem)  # rows past Sq dropped
        tma.store_wait(pendings=0)
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))


def _descriptor(t: torch.Tensor, rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    block = [1, 1, int(rows), int(t.shape[-1])]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, elem))


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, M: torch.Tensor,
              n_ptr: torch.Tensor, b_ptr: torch.Tensor, *, transform_id: int, causal: bool, scale: float,
              config: GluonFwdConfig, cstat: Optional[torch.Tensor] = None) -> None:
    """Launch the Gluon forward into ``o`` and ``M`` (``[B, Hq, Sq]`` fp32) and, given
    ``cstat`` (SSA; M's layout), the row means ``C``; the call must have passed
    ``gluon_fwd_config``."""
    bz, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(sq, config.block_m), bz * hq)
    _hopper_fwd_kernel[grid](
        _descriptor(q, config.block_m), _descriptor(k, config.block_n), _descriptor(v, config.block_n),
        _descriptor(o, config.block_m), M, M if cstat is None else cstat, n_ptr, b_ptr,
        M.stride(0), M.stride(1), M.stride(2), hq, hq // hkv, sq, sk, float(scale),
        TRANSFORM=int(transform_id), CAUSAL=bool(causal), STAGES=config.stages,
        SAVE_C=cstat is not None and int(transform_id) == 1, num_warps=config.num_warps)
