"""Fused attention backward shared by every single-softmax schedule (flash, ELSA scan).

Given the forward's output ``o`` and its per-row statistic ``M`` (the log2-domain
log-sum-exp of the transformed scores, see ``attention_bwd``'s *M contract*), this
backward is independent of how the forward was scheduled: a single-pass online softmax
(flash), a two-pass scan over key partitions (ELSA), or split-K all produce the same
``(o, M)`` and can call ``attention_bwd``. It recomputes ``p = exp2(z2 - M)`` tile by
tile, never materialising ``[Sq, Sk]``; the kernels and their math are in
``bwd_kernels``, the tile tables and the choice of backward in ``bwd_config``.

Two host paths share one argument builder (``_BwdCall`` and the ``_*_args`` helpers):
the two-kernel backward (dQ kernel, then dK/dV kernel; every gradient bit-identical run
to run) and the single pass (``dispatch.backward_plan``: one dK/dV kernel that also adds ``dq``
with fp32 atomics). On sm_90 the single pass at D64 and D128 is the warp-specialised Gluon
kernel of ``hopper_bwd`` (``_attention_bwd_gluon``), where ``gluon_bwd_config`` allows.

Layouts: dense ``[B, H, S, D]`` with arbitrary strides on all four dims (views such as
Megatron's ``[s, b, h, d]`` permuted to ``[b, h, s, d]`` work without copies), or packed
THD ``[T, H, D]`` with ``cu_seqlens``. All addressing of rows uses int64.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton

from nemo_ssa.ops.common.alloc import new_output, new_output_like
from nemo_ssa.ops.common.bwd_config import (
    BWD_TUNE_DQ,
    BWD_TUNE_KV,
    BwdConfig,
    bwd_config,
    fused_delta,
    pointer_bwd_config,
    pointer_single_config,
    single_config,
)
from nemo_ssa.ops.common.bwd_kernels import (
    attn_bwd_kernel_dkv,
    attn_bwd_kernel_dq,
    attn_bwd_postprocess,
    attn_bwd_preprocess,
)
from nemo_ssa.ops.common.device import dropout_rng_layout
from nemo_ssa.ops.common.dispatch import SINGLE, backward_plan, note_call
from nemo_ssa.ops.common.hopper_bwd import gluon_bwd_config, gluon_key_blocks, launch_gluon_bwd
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
    stat_strides,
    zhsd_stride_fn,
)
from nemo_ssa.ops.common.target import use_fast_math
from nemo_ssa.ops.common.tma import descriptor, use_tma
from nemo_ssa.ops.common.validate import KERNEL_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM  # noqa: F401 (re-exported)
from nemo_ssa.ops.common.transforms import TRANSFORM_SSA, log2_mode, transform_id

__all__ = ["attention_bwd", "attention_bwd_op", "SUPPORTED_DTYPES", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]

SUPPORTED_DTYPES = KERNEL_DTYPES  # the names the flash module imports


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
            ``None``: what ``dispatch.backward_plan`` decides for the call (as the flash
            forward does; env ``NEMO_SSA_BWD``).

    Returns:
        ``(dq, dk, dv, dn, db)``: ``dq/dk/dv`` with the dtype and (dense) layout of
        ``q/k/v`` (``empty_like``); ``dn``, ``db`` fp32 ``[1]`` (summed in float64 over a
        fixed-size buffer of partials -- per query row (two kernels) or per key block
        (single pass) -- in a fixed order, bit-identical run to run), or ``None`` for
        softmax / ``need_dparams=False``.
    """
    _check_bwd_shapes(do, q, k, v, o, M, cu_seqlens_q is not None)
    return attention_bwd_trusted(do, q, k, v, o, M, transform, n, b, causal, scale, dropout_p, rng_state,
                                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, input_precision, fast_math,
                                 need_dparams, config, need_db, cstat, deterministic)


def _check_bwd_shapes(do, q, k, v, o, M, varlen: bool) -> None:
    """What :func:`attention_bwd` checks of a caller's tensors. The flash forward's own
    backward calls :func:`attention_bwd_trusted` instead: its ``q``, ``k``, ``v`` passed the
    forward's validation, ``o`` and ``M`` are the forward's, and autograd hands ``do`` in
    ``o``'s shape."""
    if varlen:
        _, hq, d = q.shape
        m_shape = (hq, q.shape[0])
    else:
        bz, hq, sq, d = q.shape
        m_shape = (bz, hq, sq)
    hkv = k.shape[1]
    if do.shape != q.shape or o.shape != q.shape:
        raise ValueError(f"do {tuple(do.shape)} and o {tuple(o.shape)} must have q's shape {tuple(q.shape)}")
    if M.dtype != torch.float32 or tuple(M.shape) != m_shape:
        raise ValueError(f"M must be fp32 of shape {m_shape}, got {M.dtype} {tuple(M.shape)}")
    if k.shape != v.shape or k.shape[-1] != d or hkv == 0 or hq % hkv != 0:
        raise ValueError(f"bad k/v shapes {tuple(k.shape)}, {tuple(v.shape)} for q {tuple(q.shape)}: k, v must "
                         f"match, share q's head dim, and Hq must be a multiple of Hkv")


def attention_bwd_trusted(do, q, k, v, o, M, transform, n, b, causal, scale, dropout_p, rng_state, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, input_precision, fast_math, need_dparams, config,
                          need_db, cstat, deterministic):
    """:func:`attention_bwd` past its shape checks, its arguments by position (in its order):
    for a forward's own backward, whose tensors are that forward's."""
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
    if scale is None:
        scale = d ** -0.5
    if input_precision is None:
        input_precision = default_input_precision(q.dtype)
    if fast_math is None:
        fast_math = use_fast_math(q.device)
    has_dropout = dropout_p > 0.0
    if has_dropout and rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state (int64 [2] seed, offset)")
    # unused without dropout (constexpr branch): zeros keep them out of the launch key
    rz, rh, rs = dropout_rng_layout(hq, sq, sk, varlen, total_q) if has_dropout else (0, 0, 0)
    n_ptr, b_ptr = param_ptrs(n, b, M) if is_ssa else (M, M)
    block_d = tile_d(d)
    # positional, in _BwdCall's field order: by keyword the 19 fields cost ~0.6 us more on
    # every backward call
    call = _BwdCall(
        varlen, is_ssa, bz, hq, hkv, sq, sk, d, block_d,  # varlen .. block_d
        float(scale), float(dropout_p), rng_state if has_dropout else None, (rz, rh, rs),  # scale .. rng_strides
        n_ptr, b_ptr, cu_seqlens_q if varlen else None, cu_seqlens_k if varlen else None,  # n_ptr .. cu_k
        stat_strides(M, varlen),  # ms
        {"HEAD_DIM": d, "BLOCK_D": block_d, "TRANSFORM": tid, "CAUSAL": bool(causal),  # meta
         "INPUT_PRECISION": input_precision, "FAST_LOG2": log2_mode(fast_math) if is_ssa else int(bool(fast_math))})
    tune = config is None and autotune_enabled()
    if deterministic is None:
        deterministic = backward_plan(transform, q, k, v, varlen=varlen, dropout=has_dropout,
                                      fast_log2=call.meta["FAST_LOG2"] if is_ssa else 1,
                                      scores=bz * hq * sq * sk, causal=causal).path != SINGLE
    # the kernels that run (the schedule above, unless the call needs what only the two
    # kernels give), said once per distinct call
    facts = (transform, d, q.dtype, varlen, causal, has_dropout)  # the record's call (dispatch.note_call)
    if not deterministic and not tune and not want_db and (not dparams or cstat is not None):
        gcfg = None if config is not None else gluon_bwd_config(transform, q, k, v, do, o, varlen=varlen,
                                                                dropout=has_dropout,
                                                                fast_log2=call.meta["FAST_LOG2"])
        if gcfg is not None:  # the Gluon single pass (ops.common.hopper_bwd): D64/D128 on sm_90
            note_call("attention.bwd.kernels", "gluon-single-pass", "sm_90 and a Gluon row for the call", *facts)
            return _attention_bwd_gluon(call, do, q, k, v, o, M, cstat if dparams else None, causal, gcfg)
        note_call("attention.bwd.kernels", "triton-single-pass",
                  "tiles given by the caller" if config is not None else "no Gluon row or layout for the call", *facts)
        return _attention_bwd_single(call, do, q, k, v, o, M, cstat if dparams else None,
                                     config or single_config(d, q.dtype), table=config is None)
    note_call("attention.bwd.kernels", "triton-two-kernel",
              "the two-kernel schedule" if deterministic else "NEMO_SSA_AUTOTUNE=1" if tune
              else "db wanted (b learnable): the dQ kernel's row sums" if want_db
              else "dn wanted without the forward's row statistic C", *facts)
    return _attention_bwd_two_kernels(call, do, q, k, v, o, M, config or bwd_config(d, causal, q.dtype),
                                      dparams=dparams, want_db=want_db, tune=tune, table=config is None)


class _BwdCall(NamedTuple):
    """What both backward paths pass to the kernels, resolved once per call."""

    varlen: bool
    is_ssa: bool
    bz: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    block_d: int
    scale: float
    dropout_p: float
    rng: Optional[torch.Tensor]  # None: no dropout (HAS_DROPOUT follows in launch_kw)
    rng_strides: Tuple[int, int, int]
    n_ptr: torch.Tensor
    b_ptr: torch.Tensor
    cu_q: Optional[torch.Tensor]  # None: dense (VARLEN follows)
    cu_k: Optional[torch.Tensor]
    ms: Tuple[int, int, int]
    meta: dict  # the constexprs the dQ and dK/dV kernels share, but the presence flags


_NO_STRIDES4 = (0, 0, 0, 0)


def _preprocess(c: _BwdCall, o, do, delta, M, dqa=None) -> None:
    """``attn_bwd_preprocess``: ``delta``, and (``dqa`` given) the fp32 dq accumulator zeroed."""
    pre_bm = _pre_block_m(c.block_d)
    zs = zhsd_stride_fn(c.varlen)
    launch_kw(for_lengths(attn_bwd_preprocess, c.sq), (cdiv(c.sq, pre_bm), c.bz * c.hq),
              {"O": o, "DO": do, "Delta": delta, "CU_Q": c.cu_q, "DQA": dqa},
              {"s_o": zs(o), "s_do": zs(do), "s_m": c.ms, "s_a": zs(dqa) if dqa is not None else _NO_STRIDES4,
               "HQ": c.hq, "SEQ_Q": c.sq},
              {"HEAD_DIM": c.d, "BLOCK_D": c.block_d, "BLOCK_M": pre_bm}, absent=M)


def _dq_args(c: _BwdCall, q, k, v, do, o, dq, M, delta, dn_part, db_part) -> Tuple[dict, dict]:
    """``(tensors, scalars)`` of ``attn_bwd_kernel_dq`` by name (``launch_kw``); ``dn_part``
    None: no dn/db partials (``DPARAMS`` off). (The launchers' argument sets are dict
    literals: ``dict(...)`` with keywords costs twice as much per call.)"""
    zs = zhsd_stride_fn(c.varlen)
    return ({"Q": q, "K": k, "V": v, "DO": do, "O": o, "DQ": dq, "M": M, "Delta": delta, "NP": c.n_ptr, "BP": c.b_ptr,
             "RNG": c.rng, "CU_Q": c.cu_q, "CU_K": c.cu_k, "DN": dn_part, "DBP": db_part},
            {"s_q": zs(q), "s_k": zs(k), "s_v": zs(v), "s_do": zs(do), "s_o": zs(o), "s_dq": zs(dq), "s_m": c.ms,
             "HQ": c.hq, "GROUP": c.hq // c.hkv, "SEQ_Q": c.sq, "SEQ_K": c.sk, "scale": c.scale,
             "dropout_p": c.dropout_p, "RNG_S": c.rng_strides})


def _dkv_args(c: _BwdCall, q, k, v, do, dk, dv, M, delta, dqa=None, cstat=None, dnk=None,
              dn_strides=(0, 0, 0)) -> Tuple[dict, dict]:
    """``(tensors, scalars)`` of ``attn_bwd_kernel_dkv`` by name (``launch_kw``). The single
    pass's ``dqa`` (atomic dq), ``cstat`` and ``dnk`` (dn partials) are None, with zero
    strides, in the two-kernel backward (``ATOMIC_DQ`` and ``DN_KV`` follow)."""
    zs = zhsd_stride_fn(c.varlen)
    return ({"Q": q, "K": k, "V": v, "DO": do, "DK": dk, "DV": dv, "M": M, "Delta": delta, "NP": c.n_ptr, "BP": c.b_ptr,
             "RNG": c.rng, "CU_Q": c.cu_q, "CU_K": c.cu_k, "DQA": dqa, "CS": cstat, "DNK": dnk},
            {"s_q": zs(q), "s_k": zs(k), "s_v": zs(v), "s_do": zs(do), "s_dk": zs(dk), "s_dv": zs(dv), "s_m": c.ms,
             "s_a": zs(dqa) if dqa is not None else _NO_STRIDES4, "s_n": dn_strides, "HKV": c.hkv,
             "GROUP": c.hq // c.hkv, "SEQ_Q": c.sq, "SEQ_K": c.sk, "scale": c.scale, "dropout_p": c.dropout_p,
             "RNG_S": c.rng_strides})


def _scores(c: _BwdCall) -> int:
    """``B * Hq * Sq * Sk`` of the call (``tma.MIN_SCORES``)."""
    return c.bz * c.hq * c.sq * c.sk


def _tma_modes(c: _BwdCall, cfg: BwdConfig, table: bool, single: bool, q, k, v, do, o
               ) -> Tuple[BwdConfig, int, int]:
    """``(cfg, tma_dq, tma_kv)`` of one backward call: the config's TMA modes where the
    device, the layout of the inputs (the outputs are allocated like them) and, for a
    ``table`` config, the call's size allow (``ops.common.tma``); a table config that
    cannot take the TMA path falls back to the pointer kernels' rows."""
    if not (cfg.tma_dq or cfg.tma_kv):  # (the D32 rows: no stride checks on the host)
        return cfg, 0, 0
    ok = use_tma(1, c.varlen, q, k, v, do, o, scores=_scores(c) if table else None)
    if ok:
        return cfg, cfg.tma_dq, cfg.tma_kv
    if table:
        if single:
            cfg = pointer_single_config(cfg, c.d)
        else:
            cfg = pointer_bwd_config(pointer_bwd_config(cfg, c.d, dq=True), c.d, dq=False)
    return cfg, 0, 0


def _launch_dkv(c: _BwdCall, cfg: BwdConfig, tma: int, kv_args: Tuple[dict, dict], M, meta: dict) -> None:
    """``attn_bwd_kernel_dkv`` with ``kv_args`` (``_dkv_args``); with ``tma`` its six tiled
    tensors (and the single pass's fp32 ``DQA``, off the interpreter) go as tensor
    descriptors (``ops.common.tma``)."""
    tensors, scalars = kv_args
    if tma:
        bm, bn, bd = cfg.block_m_kv, cfg.block_n_kv, c.block_d
        t = tensors
        tensors = {**t, "Q": descriptor(t["Q"], bm, bd), "K": descriptor(t["K"], bn, bd),
                   "V": descriptor(t["V"], bn, bd), "DO": descriptor(t["DO"], bm, bd),
                   "DK": descriptor(t["DK"], bn, bd), "DV": descriptor(t["DV"], bn, bd)}
        meta = {**meta, "TMA": tma}
        if t["DQA"] is not None and not is_interpreter():  # the interpreter has no descriptor reduce
            tensors["DQA"] = descriptor(t["DQA"], bm, bd)
            meta["TMA_REDUCE"] = True
    launch_kw(for_lengths(attn_bwd_kernel_dkv, c.sq, c.sk), (cdiv(c.sk, cfg.block_n_kv), c.bz * c.hkv),
              tensors, scalars, meta, absent=M, cached=not tma)


def _even_q(c: _BwdCall, cfg: BwdConfig) -> bool:
    """Whole query blocks in the dK/dV kernel's unmasked loop: its loads drop their masks."""
    return (not c.varlen) and c.sq % cfg.block_m_kv == 0 and c.d == c.block_d


def _attention_bwd_two_kernels(c: _BwdCall, do, q, k, v, o, M, cfg: BwdConfig, *, dparams: bool,
                               want_db: bool, tune: bool, table: bool = False):
    """dQ kernel (with the per-row dn/db partials), then the dK/dV kernel; every
    gradient bit-identical run to run."""
    cfg, tma_dq, tma_kv = _tma_modes(c, cfg, table, False, q, k, v, do, o)
    dq = new_output_like(q)
    dk = new_output_like(k)
    dv = new_output_like(v)
    delta = new_output_like(M)
    stacked = None
    if dparams and M.is_contiguous():
        # one partial per query row (M's layout), written by the dQ kernel; dn and db
        # partials share one buffer so a single fp64 reduction launch sums both
        stacked = new_output((1 + want_db,) + tuple(M.shape), torch.float32, q.device)
        dn_part = stacked[0]
        db_part = stacked[1] if want_db else dn_part  # never written without DB
    elif dparams:
        dn_part = new_output_like(M)
        db_part = new_output_like(M) if want_db else dn_part
    else:
        dn_part, db_part = None, M  # DPARAMS off (dn_part None): neither is written

    # delta = rowsum(o * do): folded into the dQ kernel for softmax (one launch fewer);
    # SSA keeps the separate pass (see ``fused_delta``)
    fused = fused_delta(c.is_ssa)
    if not fused:
        _preprocess(c, o, do, delta, M)
    dq_args = _dq_args(c, q, k, v, do, o, dq, M, delta, dn_part, db_part)
    if tune:
        kern = autotuned("dq", attn_bwd_kernel_dq, BWD_TUNE_DQ, ("BLOCK_M", "BLOCK_N"),
                         ["HQ", "GROUP", "SEQ_Q", "SEQ_K", "HEAD_DIM", "TRANSFORM", "DPARAMS", "DB", "CAUSAL",
                          "VARLEN", "HAS_DROPOUT"])
        args, meta = bind_kw(attn_bwd_kernel_dq, *dq_args, {"DB": want_db, "FUSED_DELTA": fused, **c.meta}, absent=M)
        kern[lambda meta: (triton.cdiv(c.sq, meta["BLOCK_M"]), c.bz * c.hq)](*args, **meta)
    else:
        tma = tma_dq
        meta = {"BLOCK_M": cfg.block_m_dq, "BLOCK_N": cfg.block_n_dq, "DB": want_db, "FUSED_DELTA": fused,
                "num_warps": cfg.warps_dq, "num_stages": cfg.stages_dq, **c.meta}
        tensors, scalars = dq_args
        if tma:
            bm, bn, bd = cfg.block_m_dq, cfg.block_n_dq, c.block_d
            tensors.update(Q=descriptor(q, bm, bd), K=descriptor(k, bn, bd), V=descriptor(v, bn, bd),
                           DO=descriptor(do, bm, bd), O=descriptor(o, bm, bd), DQ=descriptor(dq, bm, bd))
            meta["TMA"] = tma
        launch_kw(for_lengths(attn_bwd_kernel_dq, c.sq, c.sk), (cdiv(c.sq, cfg.block_m_dq), c.bz * c.hq),
                  tensors, scalars, meta, absent=M, cached=not tma)
    kv_args = _dkv_args(c, q, k, v, do, dk, dv, M, delta)
    if tune:
        kern = autotuned("dkv", attn_bwd_kernel_dkv, BWD_TUNE_KV, ("BLOCK_M", "BLOCK_N"),
                         ["HKV", "GROUP", "SEQ_Q", "SEQ_K", "HEAD_DIM", "TRANSFORM", "CAUSAL", "VARLEN",
                          "HAS_DROPOUT"])
        args, meta = bind_kw(attn_bwd_kernel_dkv, *kv_args, c.meta, absent=M)
        kern[lambda meta: (triton.cdiv(c.sk, meta["BLOCK_N"]), c.bz * c.hkv)](*args, **meta)
    else:
        _launch_dkv(c, cfg, tma_kv, kv_args, M,
                    {"BLOCK_M": cfg.block_m_kv, "BLOCK_N": cfg.block_n_kv, "EVEN_Q": _even_q(c, cfg),
                     "num_warps": cfg.warps_kv, "num_stages": cfg.stages_kv, **c.meta})
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


def _attention_bwd_gluon(c: _BwdCall, do, q, k, v, o, M, cstat, causal: bool, gcfg):
    """The Gluon single pass: the preprocess launch (delta, the fp32 dq accumulator zeroed),
    the warp-specialised kernel (dK, dV; dq tiles by TMA bulk reduce; with ``cstat``, SSA's
    float64 ``dn`` partial per key block), the postprocess launch (dq cast, dn sum)."""
    dqa = new_output_like(q, dtype=torch.float32)  # zeroed by the preprocess kernel
    dq = new_output_like(q)
    dk = new_output_like(k)
    dv = new_output_like(v)
    delta = new_output_like(M)
    dparams = cstat is not None
    nk, dnk, _ = _dn_partials(c, gluon_key_blocks(c.sk, gcfg), q.device, cstat, M)
    _preprocess(c, o, do, delta, M, dqa)
    launch_gluon_bwd(q, k, v, do, dk, dv, dqa, M, delta, causal=causal, scale=c.scale, config=gcfg,
                     transform_id=int(c.is_ssa), n_ptr=c.n_ptr, b_ptr=c.b_ptr, cstat=cstat,
                     dn_part=dnk[:2 * nk].view(torch.float64) if dparams else None)
    numel = dqa.numel()
    pb = _POST_BLOCK_INTERP if is_interpreter() else _POST_BLOCK
    launch_kw(attn_bwd_postprocess, (cdiv(numel, pb) + int(dparams),), {"DQA": dqa, "DQ": dq, "DNK": dnk},
              {"NUMEL": numel, "NK": nk}, {"BLOCK": pb, "DN_BLOCK": pb, "CAST": True, "num_warps": 4}, absent=M)
    return dq, dk, dv, (dnk[2 * nk:] if dparams else None), None


def _dn_partials(c: _BwdCall, nblk: int, device, cstat, M):
    """``(nk, dnk, strides)`` of a single pass's ``dn``: one float64 partial per key block
    (``[B, Hkv, nblk]``, B = sequences when packed) and, after them, the fp32 total the
    postprocess kernel writes -- one fp32 allocation (the partials are read through a
    float64 pointer), ``dn`` a view; ``(0, None, (0, 0, 0))`` without ``cstat``. Per block,
    not per key row: the postprocess kernel's single-program sum stays short."""
    if cstat is None:
        return 0, None, (0, 0, 0)
    if cstat.dtype != torch.float32 or cstat.shape != M.shape or cstat.stride() != M.stride():
        raise ValueError(f"cstat must be fp32 with M's shape {tuple(M.shape)} and strides {M.stride()}, "
                         f"got {cstat.dtype} {tuple(cstat.shape)} {cstat.stride()}")
    nk = c.bz * c.hkv * nblk
    return nk, new_output((2 * nk + 1,), torch.float32, device), (c.hkv * nblk, nblk, 1)


# elements per program of attn_bwd_postprocess (dq cast; also the dn sum's block)
_POST_BLOCK, _POST_BLOCK_INTERP = 4096, 1024


def _pre_block_m(block_d: int) -> int:
    """Rows per program of ``attn_bwd_preprocess``."""
    return 16 if is_interpreter() else max(16, min(128, 8192 // block_d))


def _attention_bwd_single(c: _BwdCall, do, q, k, v, o, M, cstat, cfg: BwdConfig, table: bool = False):
    """Single-pass backward (``attention_bwd(deterministic=False)``): one preprocess launch
    (delta, and the fp32 dq accumulator zeroed), one dK/dV launch that also adds ``dq``
    with atomics and (``cstat`` given) writes one float64 ``dn`` partial per key block, and
    one tail launch (``attn_bwd_postprocess``: dq cast, dn sum) unless dq is fp32 and
    there is no dn."""
    cfg, _, tma_kv = _tma_modes(c, cfg, table, True, q, k, v, do, o)
    dparams = cstat is not None
    dqa = new_output_like(q, dtype=torch.float32)  # zeroed by the preprocess kernel
    cast = q.dtype != torch.float32
    dq = new_output_like(q) if cast else dqa  # same dense strides as dqa: a flat cast
    dk = new_output_like(k)
    dv = new_output_like(v)
    delta = new_output_like(M)
    nk, dnk, ns = _dn_partials(c, cdiv(c.sk, cfg.block_n_kv), q.device, cstat, M)
    _preprocess(c, o, do, delta, M, dqa=dqa)
    kv_args = _dkv_args(c, q, k, v, do, dk, dv, M, delta, dqa=dqa, cstat=cstat, dnk=dnk, dn_strides=ns)
    _launch_dkv(c, cfg, tma_kv, kv_args, M,
                {"BLOCK_M": cfg.block_m_kv, "BLOCK_N": cfg.block_n_kv, "EVEN_Q": _even_q(c, cfg),
                 "num_warps": cfg.warps_kv, "num_stages": cfg.stages_kv, **c.meta})
    if cast or dparams:
        # dq's cast and dn's fixed-order float64 sum: one launch
        numel = dqa.numel() if cast else 0
        pb = _POST_BLOCK_INTERP if is_interpreter() else _POST_BLOCK
        launch_kw(attn_bwd_postprocess, (cdiv(numel, pb) + int(dparams),), {"DQA": dqa, "DQ": dq, "DNK": dnk},
                  {"NUMEL": numel, "NK": nk}, {"BLOCK": pb, "DN_BLOCK": pb, "CAST": cast, "num_warps": 4}, absent=M)
    return dq, dk, dv, (dnk[2 * nk:] if dparams else None), None



# ----------------------------------------------------------------------------------------
# The backward as one torch.library custom op, shared by every forward schedule
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("nemo_ssa::attention_bwd", mutates_args=())
def attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, M: torch.Tensor,
    n: Optional[torch.Tensor], b: Optional[torch.Tensor], rng_state: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    transform: str, causal: bool, scale: float, dropout_p: float,
    max_seqlen_q: int, max_seqlen_k: int, input_precision: str, fast_math: bool, need_dparams: bool,
    need_db: bool = True, cstat: Optional[torch.Tensor] = None, deterministic: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_bwd` as an opaque node for ``torch.compile``: the backward of the
    flash forward and of the ELSA scan (both write ``o`` and ``M`` under its contract).
    ``(dq, dk, dv, dn, db)``; ``dn``/``db`` are fp32 ``[1]`` zeros where not computed
    (custom ops return tensors); ``deterministic`` is the resolved choice."""
    dq, dk, dv, dn, db = attention_bwd(
        do, q, k, v, o, M, transform=transform, n=n, b=b, causal=causal, scale=scale,
        dropout_p=dropout_p, rng_state=rng_state, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        input_precision=input_precision, fast_math=fast_math, need_dparams=need_dparams, need_db=need_db,
        cstat=cstat, deterministic=deterministic)
    if dn is None:
        dn = torch.zeros(1, dtype=torch.float32, device=q.device)
    if db is None:
        db = torch.zeros(1, dtype=torch.float32, device=q.device)
    return dq, dk, dv, dn, db


@attention_bwd_op.register_fake
def _(do, q, k, v, o, M, n, b, rng_state, cu_seqlens_q, cu_seqlens_k, transform, causal, scale,
      dropout_p, max_seqlen_q, max_seqlen_k, input_precision, fast_math, need_dparams, need_db=True,
      cstat=None, deterministic=True):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((1,), dtype=torch.float32), q.new_empty((1,), dtype=torch.float32))
