"""Fused flash attention with a compile-time score transform (SSA or softmax), in Triton.

Computes, without materialising ``[Sq, Sk]``::

    s = scale * q k^T;  z = n sgn(s) log1p(b|s|) (SSA) | s (softmax);  z[masked] = -inf
    o = dropout(softmax_rows(z)) @ v

Forward (this file): one program per (query block, batch, query head); online softmax in
the log2 domain (``z2 = z * log2 e`` from ``ops.common.transforms``, ``exp2`` only, no
``pow``); key blocks that every row of the query block may see run unmasked, only the
causal diagonal band and the ragged tail of ``Sk`` run with masks; masked entries weigh
exactly 0. It stores ``M = m2 + log2(l)`` per row (fp32) -- ``+inf`` for rows that see no
key, whose output is 0 -- and the backward (``ops.common.bwd.attention_bwd``,
shared with the ELSA scan) recomputes ``p = exp2(z2 - M)``.

Layouts: dense ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` with **arbitrary strides on
all four dims** (Megatron's ``[s, b, h, d]`` tensors ``.permute(1, 2, 0, 3)``-ed are used
in place; ``force_contiguous_qkv=True`` copies first), or packed THD ``[T, H, D]`` with
``cu_seqlens`` (``flash_attention_varlen``). GQA natively: query head ``h`` reads kv head
``h // (Hq // Hkv)``; no K/V expansion. Any ``Sq``, ``Sk`` (no divisibility), ``Sq != Sk``
with bottom-right causal alignment, head dims 16..256 (padded to a power of two inside
with masked loads), fp16 / bf16 / fp32 (fp32 uses IEEE dots by default).

Dropout on ``p`` (before ``@ v``) is generated in-kernel by Philox (``tl.rand``) from an
int64 ``[2]`` ``(seed, offset)`` tensor; the backward regenerates the identical mask.

Autograd: eager calls go through a plain ``torch.autograd.Function`` (``_FlashAttnFn``,
lowest host cost); under ``torch.compile`` (``torch.compiler.is_compiling()``) the same
kernels are reached through ``torch.library.custom_op`` (``nemo_ssa::flash_attn_fwd`` /
``nemo_ssa::attention_bwd``, the backward op shared with ELSA, in ``ops.common.bwd``; with
fake impls) so models trace without graph breaks. Both paths give bitwise-identical outputs
and gradients. The eager Function stays beside the custom op for two reasons: it lets the
kernel write a caller's strided ``out=`` buffer in place and return an alias that carries
autograd (a functional custom op can only copy into it), and it skips the custom-op dispatch
on every call. ``n`` and ``b`` are tensors (never
Python floats) and get gradients.

Differences from ``naive.attention_naive``: no ``keep_mask`` (raises); dropout masks come
from Philox, not torch's RNG stream (same distribution, different draws); ``n``, ``b``
are read as fp32; fp64 inputs are rejected.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors with 16x16 blocks -- that is how CI tests them.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from nemo_ssa.ops.attention.hopper import gluon_fwd, gluon_fwd_config
from nemo_ssa.ops.common.alloc import new_cstat, new_output, new_output_like
from nemo_ssa.ops.common.bwd import MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES, attention_bwd_trusted
from nemo_ssa.ops.common.bwd_config import d_bucket
from nemo_ssa.ops.common.dispatch import SINGLE, backward_plan, note_call
from nemo_ssa.ops.common.device import (
    dropout_keep,
    dropout_rng_layout,
    dropout_state,
    kv_range_for_q_block,
    load_kv_tile,
    load_params,
    make_rng_state,
    mask_scores,
    online_softmax_step,
    seq_info,
    tile_ptrs,
    tma_store,
    tma_tile,
)
from nemo_ssa.ops.common.launch import (
    autotune_enabled,
    autotuned,
    bind_kw,
    block_d as tile_d,
    cdiv,
    default_input_precision,
    for_lengths,
    is_interpreter,
    launch_kw,
    param_ptrs,
    presence_flags,
    stat_strides,
    zhsd_stride_fn,
)
from nemo_ssa.ops.common.target import use_fast_math
from nemo_ssa.ops.common.tma import descriptor, use_tma
from nemo_ssa.ops.common.transforms import (
    log2_mode,
    score_fwd_hoisted,
    score_fwd_smag,
    transform_consts,
    transform_id,
)
from nemo_ssa.ops.common.validate import Capabilities, check_deterministic, validate_attention_args

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_fwd",
    "ssa_attention_triton",
    "softmax_attention_triton",
    "ssa_attention_triton_varlen",
    "softmax_attention_triton_varlen",
    "FwdConfig",
    "FWD_CONFIGS",
    "fwd_config",
]


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, c_i, q,
    k_base, v_base, s_ks, s_kd, s_vs, s_vd, s_ks64, s_vs64,
    offs_m, lo, hi, k_len, off_c,
    c0, c1, seed, rbase, RSTRIDE, dropout_p,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRANSFORM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    SAVE_C: tl.constexpr = False, TMA: tl.constexpr = 0, off_z=0, off_h=0,
):
    """Key blocks ``lo .. hi`` of one query block. ``TMA`` (dense only; ``k_base``,
    ``v_base`` are then rank-4 tensor descriptors, ``off_z``/``off_h`` the batch and kv
    head): tiles come through the tensor-memory accelerator, zero-filled past ``Sk`` and
    ``HEAD_DIM``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kT_off = offs_n[None, :] * s_ks + offs_d[:, None] * s_kd  # [BLOCK_D, BLOCK_N]
    v_off = offs_n[:, None] * s_vs + offs_d[None, :] * s_vd  # [BLOCK_N, BLOCK_D]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if TMA:
            kT = tl.trans(tma_tile(k_base, off_z, off_h, start_n, BLOCK_N, BLOCK_D))
        else:
            k_ptrs = k_base + start_n * s_ks64 + kT_off  # int64 block base, int32 in-tile offsets
            kT = load_kv_tile(k_ptrs, cols, k_len, offs_d, HEAD_DIM, BLOCK_D, MASKED, True)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if SAVE_C:
            z2, smag = score_fwd_smag(qk, c0, c1, TRANSFORM, FAST_LOG2)
        else:
            z2 = score_fwd_hoisted(qk, c0, c1, TRANSFORM, FAST_LOG2)
        if MASKED:
            z2 = mask_scores(z2, offs_m, cols, k_len, off_c, CAUSAL, False)
        p, alpha, m_new, l_i = online_softmax_step(z2, m_i, l_i, MASKED)  # p: [BLOCK_M, BLOCK_N]
        if SAVE_C:  # sum_j p smag (undropped p; masked keys have p = 0, finite smag)
            c_i = c_i * alpha + tl.sum(p * smag, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = tma_tile(v_base, off_z, off_h, start_n, BLOCK_N, BLOCK_D)
        else:
            v = load_kv_tile(v_base + start_n * s_vs64 + v_off, cols, k_len, offs_d, HEAD_DIM, BLOCK_D, MASKED,
                             False)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rbase, offs_m, cols, RSTRIDE, dropout_p, False)
            p = tl.where(keep, p, 0.0)  # l_i keeps the undropped normaliser
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i, c_i


@presence_flags(VARLEN=("CU_Q", "CU_K"), HAS_DROPOUT="RNG", SAVE_C="CS")
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, M, CS, NP, BP, RNG, CU_Q, CU_K,
    s_qz, s_qh, s_qs, s_qd,
    s_kz, s_kh, s_ks, s_kd,
    s_vz, s_vh, s_vs, s_vd,
    s_oz, s_oh, s_os, s_od,
    s_mz, s_mh, s_ms,
    HQ, GROUP, SEQ_Q, SEQ_K,
    scale, dropout_p, RNG_SZ, RNG_SH, RNG_SS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSFORM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_LOG2: tl.constexpr,
    SAVE_C: tl.constexpr = False, TMA: tl.constexpr = 0,
):
    """``TMA`` (``FwdConfig.tma``; dense inputs only): ``Q``, ``K``, ``V``, ``O`` are rank-4
    ``[B, H, S, D]`` tensor descriptors (``ops.common.tma``) instead of pointers."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # longest rows first (tail balance)
    pid_zh = tl.program_id(1)
    off_z = pid_zh // HQ
    off_hq = pid_zh % HQ
    off_hkv = off_hq // GROUP
    q_start, q_len, k_start, k_len = seq_info(CU_Q, CU_K, off_z, SEQ_Q, SEQ_K, VARLEN)
    start_m = pid_m * BLOCK_M
    if not TMA:  # (dense: the grid has no block past Sq; no early exit for the TMA path's loops)
        if start_m >= q_len:
            return
    z64 = off_z.to(tl.int64)
    hq64 = off_hq.to(tl.int64)
    hkv64 = off_hkv.to(tl.int64)
    zero64 = z64 * 0  # promotes strides to int64 for block-base offsets
    offs_mb = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_mb
    offs_d = tl.arange(0, BLOCK_D)
    row = q_start + start_m  # int64
    row_ok = offs_m < q_len
    ld = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    if TMA:
        q = tma_tile(Q, off_z, off_hq, start_m, BLOCK_M, BLOCK_D)
        k_base = K
        v_base = V
    else:
        q = tl.load(tile_ptrs(Q, z64, hq64, row, s_qz, s_qh, s_qs, s_qd, offs_mb, offs_d), mask=ld, other=0.0)
        k_base = K + z64 * s_kz + hkv64 * s_kh + k_start * s_ks
        v_base = V + z64 * s_vz + hkv64 * s_vh + k_start * s_vs

    n, b = load_params(NP, BP, TRANSFORM)
    c0, c1 = transform_consts(scale, n, b, TRANSFORM)
    seed, rng_off, inv_keep = dropout_state(RNG, dropout_p, HAS_DROPOUT)
    rbase = rng_off + z64 * RNG_SZ + hq64 * RNG_SH + q_start * RNG_SS
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    c_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    full, hi = kv_range_for_q_block(start_m, q_len, k_len, BLOCK_M, BLOCK_N, CAUSAL)
    off_c = k_len - q_len
    # stage 1: key blocks every row of this block sees -> no masks at all
    acc, l_i, m_i, c_i = _attn_fwd_inner(
        acc, l_i, m_i, c_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, s_ks + zero64, s_vs + zero64, offs_m, 0, full, k_len, off_c,
        c0, c1, seed, rbase, RNG_SS, dropout_p, HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL,
        TRANSFORM, HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, SAVE_C, TMA, off_z, off_hkv)
    # stage 2: causal diagonal band and the ragged tail of Sk
    acc, l_i, m_i, c_i = _attn_fwd_inner(
        acc, l_i, m_i, c_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, s_ks + zero64, s_vs + zero64, offs_m, full, hi, k_len, off_c,
        c0, c1, seed, rbase, RNG_SS, dropout_p, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL,
        TRANSFORM, HAS_DROPOUT, INPUT_PRECISION, FAST_LOG2, SAVE_C, TMA, off_z, off_hkv)

    empty = l_i == 0.0  # no visible key: o = 0, M = +inf (backward then gets p = 0)
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc * (inv_keep / l_safe)[:, None]
    m_out = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    if TMA:
        tma_store(O, off_z, off_hq, start_m, o.to(q.dtype), BLOCK_M, BLOCK_D)
    else:
        tl.store(tile_ptrs(O, z64, hq64, row, s_oz, s_oh, s_os, s_od, offs_mb, offs_d),
                 o.to(O.dtype.element_ty), mask=ld)
    tl.store(M + z64 * s_mz + hq64 * s_mh + (q_start + offs_m) * s_ms, m_out, mask=row_ok)
    if SAVE_C:  # C = E_p[smag] per row (0 for rows without a key), M's layout
        tl.store(CS + z64 * s_mz + hq64 * s_mh + (q_start + offs_m) * s_ms, c_i / l_safe, mask=row_ok)


# ----------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------


class FwdConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: int = 0  # 1: tiles through TMA tensor descriptors where the layout allows (ops.common.tma)


# (BLOCK_D bucket, causal, "16bit" | "fp32") -> FwdConfig. 16-bit rows 32/64/128: measured
# winners of benchmarks/tune_tiles.py (bf16, causal SSA; results in docs/results; the D64
# and D128 rows on the Hopper path, ``tune_tiles --tma``, SSA and softmax: 2026-11-26-hopper)
# (D=32: best for both B4 N4K and N=16K; D=32/64 re-tuned after the SSA instruction diet).
# 256 and fp32: compile-time estimates (largest tiles without spills; fp32 runs IEEE dots
# on FMA units, exactness tests only, small tiles). Tune with NEMO_SSA_AUTOTUNE=1
# (candidates: _FWD_TUNE).
_FWD_16 = {32: FwdConfig(64, 64, 4, 2),     # tuned on B4 N4K and B32 N1K, SSA and softmax
           64: FwdConfig(64, 128, 4, 2, 1),  # TMA; tuned on B2 N8K H16 (softmax 1.14x, SSA 1.06x the pointers)
           128: FwdConfig(64, 64, 4, 3, 1),  # TMA; B2 N8K H8 (SSA 1.03x; softmax 0.99x)
           256: FwdConfig(64, 32, 8, 2)}   # estimate: 181 regs
_FWD_32 = {32: FwdConfig(64, 32, 4, 2), 64: FwdConfig(32, 32, 4, 2),
           128: FwdConfig(32, 32, 8, 2), 256: FwdConfig(16, 16, 4, 2)}
# the rows a table entry with ``tma`` falls back to where the call cannot take the TMA path
# (pre-Hopper GPU, packed THD, unaligned strides, short call): the pointer kernels' winners
_FWD_16_POINTERS = {64: FwdConfig(64, 128, 4, 3), 128: FwdConfig(64, 64, 4, 3)}
FWD_CONFIGS: Dict[Tuple[int, bool, str], FwdConfig] = {}
for _causal in (False, True):
    for _bd in (32, 64, 128, 256):
        FWD_CONFIGS[(_bd, _causal, "16bit")] = _FWD_16[_bd]
        FWD_CONFIGS[(_bd, _causal, "fp32")] = _FWD_32[_bd]
INTERPRETER_FWD_CONFIG = FwdConfig(16, 16, 1, 1)
_FWD_TUNE = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def fwd_config(head_dim: int, causal: bool, dtype: torch.dtype, interpret: Optional[bool] = None) -> FwdConfig:
    """Forward block sizes: table above on GPU, 16x16 under the interpreter."""
    if interpret is None:
        interpret = is_interpreter()
    if interpret:
        return INTERPRETER_FWD_CONFIG
    kind = "fp32" if dtype == torch.float32 else "16bit"
    return FWD_CONFIGS[(d_bucket(head_dim), bool(causal), kind)]


def pointer_fwd_config(cfg: FwdConfig, head_dim: int) -> FwdConfig:
    """The table's row for a call that cannot take the TMA path ``cfg`` asks for."""
    return _FWD_16_POINTERS.get(d_bucket(head_dim), cfg._replace(tma=0)) if cfg.tma else cfg


def _flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, n: Optional[Tensor], b: Optional[Tensor],
    rng_state: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    transform: str, causal: bool, scale: float, dropout_p: float, max_seqlen_q: int,
    max_seqlen_k: int, input_precision: str, fast_math: bool, config: Optional[FwdConfig] = None,
    out: Optional[Tensor] = None, save_c: bool = False, fast_log2: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Launch the forward kernel; returns ``(o, M, C)`` (no autograd). ``out`` (validated
    by the caller): the tensor ``o`` is written into, any strides. ``save_c`` (SSA only;
    else ``C`` is None): also write ``C_i = sum_j p_ij smag_ij`` (fp32, ``M``'s layout),
    the row mean of ``dz/dn`` the single-pass backward needs for ``dn``
    (``bwd.attention_bwd(cstat=C)``). ``fast_log2``: SSA's ``log2_mode(fast_math)`` where the
    caller has read it already (None: read here)."""
    varlen = cu_seqlens_q is not None
    tid = transform_id(transform)
    dev = q.device
    if varlen:
        total_q, hq, d = q.shape
        hkv = k.shape[1]
        bz = cu_seqlens_q.numel() - 1
        sq, sk = int(max_seqlen_q), int(max_seqlen_k)
        M = new_output((hq, total_q), torch.float32, dev)
    else:
        bz, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        total_q = None
        M = new_output((bz, hq, sq), torch.float32, dev)
    # keeps q's memory order when q is a dense permuted view
    o = new_output_like(q) if out is None else out
    has_dropout = dropout_p > 0.0
    # unused without dropout (constexpr branch): zeros keep them out of the launch key
    rz, rh, rs = dropout_rng_layout(hq, sq, sk, varlen, total_q) if has_dropout else (0, 0, 0)
    block_d = tile_d(d)
    save_c = bool(save_c) and tid == 1
    cstat = new_cstat(M) if save_c else None
    n_ptr, b_ptr = param_ptrs(n, b, M) if tid == 1 else (M, M)
    # None: absent (VARLEN, HAS_DROPOUT, SAVE_C follow); launch_kw passes M in their place
    # dict literals, not dict(...) with keywords: half the host cost per launch argument set
    tensors = {"Q": q, "K": k, "V": v, "O": o, "M": M, "CS": cstat, "NP": n_ptr, "BP": b_ptr,
               "RNG": rng_state if has_dropout else None, "CU_Q": cu_seqlens_q,
               "CU_K": cu_seqlens_k if varlen else None}
    zs = zhsd_stride_fn(varlen)
    scalars = {"s_q": zs(q), "s_k": zs(k), "s_v": zs(v), "s_o": zs(o), "s_m": stat_strides(M, varlen), "HQ": hq,
               "GROUP": hq // hkv, "SEQ_Q": sq, "SEQ_K": sk, "scale": float(scale), "dropout_p": float(dropout_p),
               "RNG_S": (rz, rh, rs)}
    meta = {"HEAD_DIM": d, "BLOCK_D": block_d, "TRANSFORM": tid, "CAUSAL": bool(causal),
            "INPUT_PRECISION": input_precision,
            "FAST_LOG2": (log2_mode(fast_math) if fast_log2 is None else fast_log2) if tid == 1
            else int(bool(fast_math))}
    tune = config is None and autotune_enabled()  # (an environment read: once per call)
    gcfg = gluon_fwd_config(q, k, v, o, transform="ssa" if tid == 1 else "softmax", varlen=varlen,
                            dropout=has_dropout, save_c=save_c, fast_log2=meta["FAST_LOG2"],
                            explicit_config=config is not None or tune)
    facts = (transform, d, q.dtype, varlen, causal, has_dropout)  # the record's call (dispatch.note_call)
    if gcfg is not None:  # the Hopper kernel (ops.attention.hopper): same contract
        note_call("flash.fwd", "gluon", "sm_90, and gluon_fwd_config has a row for the call", *facts)
        gluon_fwd(q, k, v, o, M, n_ptr, b_ptr, transform_id=tid, causal=causal, scale=scale, config=gcfg,
                  cstat=cstat)
    elif tune:
        note_call("flash.fwd", "triton-autotune", "NEMO_SSA_AUTOTUNE=1", *facts)
        kern = autotuned("fwd", _attn_fwd_kernel, _FWD_TUNE, ("BLOCK_M", "BLOCK_N"),
                         ["HQ", "GROUP", "SEQ_Q", "SEQ_K", "HEAD_DIM", "TRANSFORM", "CAUSAL", "VARLEN", "HAS_DROPOUT"])
        args, meta = bind_kw(_attn_fwd_kernel, tensors, scalars, meta, absent=M)
        kern[lambda m: (triton.cdiv(sq, m["BLOCK_M"]), bz * hq)](*args, **meta)
    else:
        cfg = config or fwd_config(d, causal, q.dtype)
        cfg_tma = bool(cfg.tma)
        tma = use_tma(cfg.tma, varlen, q, k, v, o, scores=None if config else bz * hq * sq * sk)
        if not tma and config is None:
            cfg = pointer_fwd_config(cfg, d)
        note_call("flash.fwd", "triton-tma" if tma else "triton-pointers",
                  lambda: "tiles given by the caller" if config is not None else
                  f"table row D{d_bucket(d)}" + ("" if tma or not cfg_tma else
                                                  ": TMA row, the call's layout or size cannot take it"), *facts)
        if tma:
            tensors.update(Q=descriptor(q, cfg.block_m, block_d), K=descriptor(k, cfg.block_n, block_d),
                           V=descriptor(v, cfg.block_n, block_d), O=descriptor(o, cfg.block_m, block_d))
            meta["TMA"] = tma
        launch_kw(for_lengths(_attn_fwd_kernel, sq, sk), (cdiv(sq, cfg.block_m), bz * hq), tensors, scalars,
                  {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "num_warps": cfg.num_warps,
                   "num_stages": cfg.num_stages, **meta}, absent=M, cached=not tma)
    return o, M, cstat


# ----------------------------------------------------------------------------------------
# torch.library custom ops (+ autograd, + fake impls for torch.compile)
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("nemo_ssa::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, n: Optional[Tensor], b: Optional[Tensor],
    rng_state: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    transform: str, causal: bool, scale: float, dropout_p: float,
    max_seqlen_q: int, max_seqlen_k: int, input_precision: str, fast_math: bool,
    save_c: bool = False, deterministic: bool = True,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(o, M, C)``; ``C`` is an empty tensor unless ``save_c``. ``deterministic`` is
    read by the autograd formula (which backward runs), not here."""
    o, M, C = _flash_fwd(q, k, v, n, b, rng_state, cu_seqlens_q, cu_seqlens_k, transform, causal,
                         scale, dropout_p, max_seqlen_q, max_seqlen_k, input_precision, fast_math,
                         save_c=save_c)
    return o, M, (C if C is not None else M.new_empty((0,)))


@_flash_attn_fwd_op.register_fake
def _(q, k, v, n, b, rng_state, cu_seqlens_q, cu_seqlens_k, transform, causal, scale, dropout_p,
      max_seqlen_q, max_seqlen_k, input_precision, fast_math, save_c=False, deterministic=True):
    if cu_seqlens_q is not None:
        m_shape = (q.shape[1], q.shape[0])
    else:
        m_shape = (q.shape[0], q.shape[1], q.shape[2])
    c_shape = m_shape if (save_c and transform == "ssa") else (0,)
    return (torch.empty_like(q), q.new_empty(m_shape, dtype=torch.float32),
            q.new_empty(c_shape, dtype=torch.float32))


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, n, b, rng_state, cu_q, cu_k, transform, causal, scale, dropout_p,
     max_q, max_k, input_precision, fast_math, save_c, deterministic) = inputs
    o, M, C = output
    ctx.save_for_backward(q, k, v, o, M, n, b, rng_state, cu_q, cu_k, C if save_c else None)
    ctx.scalars = (transform, causal, scale, dropout_p, max_q, max_k, input_precision, fast_math, deterministic)


def _fwd_backward(ctx, do, dM, dC):
    q, k, v, o, M, n, b, rng_state, cu_q, cu_k, cstat = ctx.saved_tensors
    transform, causal, scale, dropout_p, max_q, max_k, input_precision, fast_math, det = ctx.scalars
    need_dparams = transform == "ssa" and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
    need_db = need_dparams and ctx.needs_input_grad[4]
    dq, dk, dv, dn, db = torch.ops.nemo_ssa.attention_bwd(
        do, q, k, v, o, M, n, b, rng_state, cu_q, cu_k, transform, causal, scale, dropout_p,
        max_q, max_k, input_precision, fast_math, need_dparams, need_db, cstat, det)
    if not need_dparams:  # the op returns placeholder zeros then
        dn = db = None
    elif not need_db:
        db = None
    return _grads_from_bwd(n, b, ctx.needs_input_grad, dq, dk, dv, dn, db) + (None,) * 13


_flash_attn_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ----------------------------------------------------------------------------------------
# Eager fast path: a plain autograd.Function (per-call host cost)
# ----------------------------------------------------------------------------------------


def _grads_from_bwd(n, b, needs_input_grad, dq, dk, dv, dn, db):
    """Shared tail of both backward paths (custom op and eager): identical casts, so the
    two paths return bitwise-identical gradients."""
    return dq, dk, dv, _param_grad(n, dn, needs_input_grad[3]), _param_grad(b, db, needs_input_grad[4])


def _param_grad(p, g, needed):
    """``g`` (fp32 ``[1]``) in the parameter's dtype and shape; no op when they match."""
    if p is None or g is None or not needed:
        return None
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    return g if g.shape == p.shape else g.reshape(p.shape)


class _FlashAttnFn(torch.autograd.Function):
    """Eager autograd path calling ``_flash_fwd`` / ``attention_bwd`` directly.

    The ``torch.library`` custom ops cost host time on every fwd+bwd (schema dispatch,
    the generated autograd wrapper, a materialised zero gradient for the unused ``M``
    output, zero ``dn``/``db`` tensors for softmax). Eager calls do not need
    any of it; ``torch.compile`` does (fake impls, opaque op), so ``_flash_call`` takes
    this path only when ``torch.compiler.is_compiling()`` is False. Only ``o`` is an
    output (``M`` is saved, never returned), and ``set_materialize_grads(False)`` lets an
    unused output skip the backward entirely. It is also what keeps ``out=`` free in
    eager: the kernel writes the caller's buffer in place, where the functional custom op
    can only copy its result into it. Same kernels, same arguments, same casts: outputs
    and gradients are bitwise identical to the custom-op path (tested).
    """

    @staticmethod
    def forward(ctx, q, k, v, n, b, rng_state, cu_q, cu_k, out, scalars):
        # the scalars travel as one tuple: Function.apply walks every argument in Python
        (transform, causal, scale, dropout_p, max_q, max_k, input_precision, fast_math, save_c,
         deterministic, fast_log2) = scalars
        o, M, cstat = _flash_fwd(q, k, v, n, b, rng_state, cu_q, cu_k, transform, causal, scale, dropout_p,
                                 max_q, max_k, input_precision, fast_math, out=out, save_c=save_c,
                                 fast_log2=fast_log2)
        if out is not None:
            # written in place; the returned alias (same memory, own autograd identity)
            # carries the graph -- mark_dirty on a view of a no-grad buffer trips autograd
            o = out.detach()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, n, b, rng_state, cu_q, cu_k)
        ctx.stats = (M, cstat)  # internal (never user-visible, never an output): no SavedVariable
        ctx.scalars = scalars
        return o

    @staticmethod
    def backward(ctx, do):
        if do is None:
            return (None,) * 10
        q, k, v, o, n, b, rng_state, cu_q, cu_k = ctx.saved_tensors
        M, cstat = ctx.stats
        transform, causal, scale, dropout_p, max_q, max_k, input_precision, fast_math, _, det, _ = ctx.scalars
        nig = ctx.needs_input_grad
        need_dparams = transform == "ssa" and (nig[3] or nig[4])
        # past attention_bwd's shape checks (its tensors are this forward's, do in o's shape),
        # by position in attention_bwd's order: its keywords' binding and the checks are host
        # time on every backward of a host-bound call
        dq, dk, dv, dn, db = attention_bwd_trusted(
            do, q, k, v, o, M, transform, n, b, causal, scale, dropout_p, rng_state, cu_q, cu_k,  # .. cu_seqlens_k
            max_q, max_k, input_precision, fast_math, need_dparams, None, bool(nig[4]), cstat, det)  # .. deterministic
        grads = _grads_from_bwd(n, b, nig, dq, dk, dv, dn, db)
        return grads + (None,) * 5


# False: eager calls use the custom ops too (benchmarks' before/after, the parity tests)
EAGER_FASTPATH = True


def _flash_apply(q, k, v, n, b, rng, cu_q, cu_k, transform, causal, scale, dropout_p, max_q, max_k,
                 prec, fast, out=None, deterministic=None) -> Tensor:
    """One fused call: the custom op while torch.compile traces, the eager Function otherwise.

    Both take the same backward: single pass where ``dispatch.backward_plan`` says so; with ``dn``
    wanted and ``b`` fixed (the pinned policy) the forward then also writes the row means
    ``C`` the single-pass ``dn`` needs (``b`` learnable: the two-kernel backward).
    ``deterministic=True`` always takes the two-kernel backward."""
    # a call without a backward has no backward to choose (nor to record)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (n is not None and n.requires_grad)
                                         or (b is not None and b.requires_grad))
    # SSA's log2 mode (NEMO_SSA_POLY_LOG2) read once per call: the plan and the eager
    # forward's kernel take the same answer
    fast_log2 = log2_mode(fast) if transform == "ssa" else None
    det = not grads or backward_plan(
        transform, q, k, v, varlen=cu_q is not None, dropout=dropout_p > 0.0,
        fast_log2=1 if fast_log2 is None else fast_log2, scores=q.shape[0] * q.shape[1] * max_q * max_k,
        causal=causal, deterministic=deterministic).path != SINGLE
    # (not det: grads, so grad mode is on)
    save_c = (not det and transform == "ssa" and n is not None and n.requires_grad
              and not (b is not None and b.requires_grad))
    if torch.compiler.is_compiling() or not EAGER_FASTPATH:
        o, _, _ = torch.ops.nemo_ssa.flash_attn_fwd(
            q, k, v, n, b, rng, cu_q, cu_k, transform, causal, scale, dropout_p, max_q, max_k, prec, fast,
            save_c, det)
        if out is None:
            return o
        return out.copy_(o)  # functional op: out= becomes one (differentiable) copy
    return _FlashAttnFn.apply(q, k, v, n, b, rng, cu_q, cu_k, out,
                              (transform, causal, scale, dropout_p, max_q, max_k, prec, fast, save_c, det,
                               fast_log2))


# ----------------------------------------------------------------------------------------
# Validation and public functions
# ----------------------------------------------------------------------------------------

_FLASH_SUPPORT = dict(dtypes=SUPPORTED_DTYPES, head_dims=(MIN_HEAD_DIM, MAX_HEAD_DIM), keep_mask=False,
                      triton=True, grid_limit=True)
FLASH_CAPS = Capabilities(name="flash_attention", **_FLASH_SUPPORT)
FLASH_VARLEN_CAPS = Capabilities(name="flash_attention_varlen", varlen=True, **_FLASH_SUPPORT)


def _validate_flash(q, k, v, *, transform, n, b, causal, keep_mask, dropout_p, softmax_scale, varlen,
                    input_precision, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None) -> None:
    validate_attention_args(FLASH_VARLEN_CAPS if varlen else FLASH_CAPS, q, k, v, n, b, transform=transform,
                            causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p, keep_mask=keep_mask,
                            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k)
    if input_precision not in (None, "ieee", "tf32", "tf32x3"):
        raise ValueError(f"input_precision {input_precision!r}; supported: None, 'ieee', 'tf32', 'tf32x3'")


def _resolve(q, d, softmax_scale, input_precision, fast_math):
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    prec = default_input_precision(q.dtype) if input_precision is None else input_precision
    # inline PTX only exists on CUDA: fast_math=True elsewhere is ignored
    fast = use_fast_math(q.device) and (fast_math is None or bool(fast_math))
    return scale, prec, fast


def _check_out(out, q) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"`out` must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"`out` must have q's shape {tuple(q.shape)}, dtype {q.dtype} and device {q.device}; "
                         f"got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(out) == 1:
        raise ValueError("`out` has overlapping memory (e.g. an expand()ed view); supported: any strides "
                         "without self-overlap, e.g. a permuted view of an [Sq, B, H, D] buffer")
    if out.requires_grad:
        raise ValueError("`out` requires grad; pass a plain buffer (the returned tensor carries autograd)")


def _flash_call(q, k, v, n, b, cu_q, cu_k, max_q, max_k, *, transform, causal, softmax_scale, dropout_p,
                dropout_seed, dropout_offset, force_contiguous_qkv, input_precision, fast_math,
                out=None, deterministic=None) -> Tensor:
    """Shared host-side tail of ``flash_attention`` / ``flash_attention_varlen`` (after
    validation): optional contiguous copy, scalar resolution, dropout RNG, custom-op call."""
    if force_contiguous_qkv:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale, prec, fast = _resolve(q, q.shape[-1], softmax_scale, input_precision, fast_math)
    dropout_p = float(dropout_p)
    rng = make_rng_state(q.device, dropout_seed, dropout_offset) if dropout_p > 0.0 else None
    ssa = transform == "ssa"
    return _flash_apply(q, k, v, n if ssa else None, b if ssa else None, rng, cu_q, cu_k, transform,
                        bool(causal), scale, dropout_p, max_q, max_k, prec, fast, out, deterministic)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    transform: str = "ssa",
    n: Optional[Tensor] = None,
    b: Optional[Tensor] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[int] = None,
    dropout_offset: int = 0,
    force_contiguous_qkv: bool = False,
    input_precision: Optional[str] = None,
    fast_math: Optional[bool] = None,
    out: Optional[Tensor] = None,
    deterministic: Optional[bool] = None,
) -> Tensor:
    """Fused attention ``o = dropout(softmax(transform(scale q k^T) + mask)) @ v``.

    Args:
        q: ``[B, Hq, Sq, D]``, any strides (e.g. a permuted ``[s, b, h, d]`` view).
        k, v: ``[B, Hkv, Sk, D]``, ``Hq % Hkv == 0``, any strides.
        transform: ``"ssa"`` (needs ``n``, ``b``) or ``"softmax"``.
        n, b: SSA parameters, 1-element tensors (``[1]`` or 0-d) on q's device; they may
            require grad (``dn``, ``db`` are returned through autograd).
        causal: bottom-right aligned (query i sees key j iff ``j <= i + Sk - Sq``).
        softmax_scale: positive Python number; default ``1/sqrt(D)``.
        keep_mask: not supported (raises ``ValueError``).
        dropout_p: dropout on the probabilities before ``@ v``.
        dropout_seed, dropout_offset: reproducible Philox mask; ``None`` draws the seed
            from the device's default generator (follows ``torch.manual_seed`` and
            Megatron's RNG-tracker forks, no host sync).
        force_contiguous_qkv: copy q/k/v to contiguous first (the seed-000 training
            default); the kernel itself handles any strides.
        input_precision: ``tl.dot`` precision for fp32 inputs; default ``"ieee"``.
        fast_math: PTX ``lg2.approx`` for the SSA log (default on CUDA).
        deterministic: True: every gradient bit-identical run to run (the two-kernel
            backward; Megatron's ``deterministic_mode`` sets it through the core
            attention); None / False: the faster choice of ``dispatch.backward_plan`` (the
            single pass adds ``dq`` with fp32 atomics where it pays; it also follows
            ``torch.use_deterministic_algorithms`` and the ``NEMO_SSA_BWD`` override).
        out: optional preallocated ``[B, Hq, Sq, D]`` tensor (q's dtype and device) with
            ANY strides, e.g. ``buf.view(Sq, B, Hq, D).permute(1, 2, 0, 3)`` of Megatron's
            ``[s, b, h*d]`` output buffer: the kernel writes it in place (no copy). Autograd
            flows through the RETURNED tensor (same memory and strides as ``out``; e.g.
            ``o.permute(2, 0, 1, 3).reshape(s, b, h*d)`` is then a free view of the
            buffer), not through ``out`` itself; the backward takes the strided ``dO`` as
            is. ``out`` must not require grad nor overlap q/k/v or itself. (Under
            torch.compile the custom op is functional: out= costs one copy there.)

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype (memory order of q when q is dense; ``out`` when
        given); rows without a visible key are 0 with zero gradients.

    Raises:
        ValueError (``ops.common.validate``): ``UnsupportedError`` for what this kernel
            lacks (dtype other than fp16 / bf16 / fp32, head dim outside 16..256, device,
            ``keep_mask``), ``ArgumentTypeError`` for wrong argument types, ValueError for
            malformed shapes, GQA ratio or parameters.
    """
    _validate_flash(q, k, v, transform=transform, n=n, b=b, causal=causal, keep_mask=keep_mask,
                    dropout_p=dropout_p, softmax_scale=softmax_scale, varlen=False,
                    input_precision=input_precision)
    check_deterministic(deterministic)
    if out is not None:
        _check_out(out, q)
    return _flash_call(q, k, v, n, b, None, None, q.shape[2], k.shape[2], transform=transform, causal=causal,
                       softmax_scale=softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                       dropout_offset=dropout_offset, force_contiguous_qkv=force_contiguous_qkv,
                       input_precision=input_precision, fast_math=fast_math, out=out,
                       deterministic=deterministic)


def flash_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, *, transform: str = "ssa", n: Optional[Tensor] = None,
    b: Optional[Tensor] = None, causal: bool = False, softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0, rng_state: Optional[Tensor] = None, input_precision: Optional[str] = None,
    fast_math: Optional[bool] = None, config: Optional[FwdConfig] = None,
) -> Tuple[Tensor, Tensor]:
    """Forward only, no autograd: returns ``(o, M)`` with ``M`` fp32 ``[B, Hq, Sq]``
    (``m2 + log2 l``, ``+inf`` for rows without a visible key) -- the statistic
    ``ops.common.bwd.attention_bwd`` consumes. ``rng_state`` from ``make_rng_state``."""
    _validate_flash(q, k, v, transform=transform, n=n, b=b, causal=causal, keep_mask=None,
                    dropout_p=dropout_p, softmax_scale=softmax_scale, varlen=False,
                    input_precision=input_precision)
    scale, prec, fast = _resolve(q, q.shape[-1], softmax_scale, input_precision, fast_math)
    if dropout_p > 0.0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state (make_rng_state)")
    with torch.no_grad():
        o, M, _ = _flash_fwd(q, k, v, n, b, rng_state, None, None, transform, bool(causal), scale,
                             float(dropout_p), q.shape[2], k.shape[2], prec, fast, config)
        return o, M


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    transform: str = "ssa",
    n: Optional[Tensor] = None,
    b: Optional[Tensor] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[int] = None,
    dropout_offset: int = 0,
    force_contiguous_qkv: bool = False,
    input_precision: Optional[str] = None,
    fast_math: Optional[bool] = None,
    deterministic: Optional[bool] = None,
) -> Tensor:
    """Packed (THD) variant of ``flash_attention``.

    Args:
        q: ``[T_q, Hq, D]``; k, v: ``[T_k, Hkv, D]`` (any strides).
        cu_seqlens_q, cu_seqlens_k: ``[num_seqs + 1]`` cumulative lengths (int32 or int64,
            on q's device, starting at 0, ending at ``T_q`` / ``T_k``; not checked on the
            host to avoid a sync).
        max_seqlen_q, max_seqlen_k: Python ints >= every sequence length.
        Other arguments as ``flash_attention``; causal is bottom-right aligned per sequence.

    Returns:
        ``[T_q, Hq, D]``.
    """
    _validate_flash(q, k, v, transform=transform, n=n, b=b, causal=causal, keep_mask=keep_mask,
                    dropout_p=dropout_p, softmax_scale=softmax_scale, varlen=True,
                    input_precision=input_precision, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    check_deterministic(deterministic)
    return _flash_call(q, k, v, n, b, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
                       int(max_seqlen_q), int(max_seqlen_k), transform=transform, causal=causal,
                       softmax_scale=softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                       dropout_offset=dropout_offset, force_contiguous_qkv=force_contiguous_qkv,
                       input_precision=input_precision, fast_math=fast_math, deterministic=deterministic)


def ssa_attention_triton(q, k, v, n, b, *, causal=False, softmax_scale=None, keep_mask=None,
                         dropout_p=0.0, out=None, **kw) -> Tensor:
    """SSA via the fused kernel; same keywords as ``ssa_attention_naive`` (``keep_mask``
    must be None). Extra keywords go to ``flash_attention``."""
    return flash_attention(q, k, v, transform="ssa", n=n, b=b, causal=causal, softmax_scale=softmax_scale,
                           keep_mask=keep_mask, dropout_p=dropout_p, out=out, **kw)


def softmax_attention_triton(q, k, v, *, causal=False, softmax_scale=None, keep_mask=None,
                             dropout_p=0.0, out=None, **kw) -> Tensor:
    """Softmax via the same fused kernel (``TRANSFORM=softmax``): the fused baseline."""
    return flash_attention(q, k, v, transform="softmax", causal=causal, softmax_scale=softmax_scale,
                           keep_mask=keep_mask, dropout_p=dropout_p, out=out, **kw)


def ssa_attention_triton_varlen(q, k, v, n, b, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                **kw) -> Tensor:
    """Packed SSA: ``flash_attention_varlen(..., transform="ssa", n=n, b=b, **kw)``."""
    return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  transform="ssa", n=n, b=b, **kw)


def softmax_attention_triton_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    **kw) -> Tensor:
    """Packed softmax: ``flash_attention_varlen(..., transform="softmax", **kw)``."""
    return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  transform="softmax", **kw)
