"""SSA attention through PyTorch FlexAttention (``attention=ssa_flex``).

What it computes: exactly ``ssa_attention_naive`` (see ``naive.py`` / ``README.md``)::

    s = (q @ k^T) * scale;  z = n * sgn(s) * log1p(b|s|);  z[masked] = -inf
    o = softmax(z) @ v                                  # rows with no visible key -> 0

Layout ``[B, H, S, D]``, GQA through ``enable_gqa`` (query head ``h`` reads kv head
``h // (Hq // Hkv)``, as in the reference), bottom-right-aligned causal mask
(``kv <= q + Sk - Sq``), and, the point of this path, any FlexAttention ``mask_mod``
(documents, prefixes, windows) AND-ed with it. No dropout (FlexAttention has none).

Why a separate path: FlexAttention fuses any score transform and any mask without a
hand-written attention kernel. Seed 000 (section 2) tried it and hit three problems,
each handled here:

1. *n detached.* ``float(n)`` in the score_mod made ``n`` a constant. ``ssa_score_mod``
   keeps ``n`` and ``b`` as tensors (indexed ``n[0]`` from a 1-element tensor: a 0-d
   captured tensor fails to compile, measured on torch 2.11); a CPU gradcheck runs
   the score_mod itself through autograd and fails if ``n`` is detached.
2. *Kernel options leaking from AUTO.* ``backend="auto"`` passes **no** kernel options;
   an explicit backend is validated against the installed torch and needs the
   compiled path, with a clear ``ValueError`` otherwise.
3. *Compiled backward with a learnable capture.* It compiles with a 1-element tensor
   but is slow: flex's backward accumulates the gradient of a captured tensor with
   ``atomic_add`` at the index the score_mod read, i.e. every (i, j) of every head adds
   into the same address. Measured on an H200, torch 2.11, model shape (B=4, N=4096,
   Hq=24, Hkv=8, D=32, causal, bf16): fwd+bwd 1,365 ms with learnable n vs 9.9 ms with
   n constant. See "How dn and db are computed" below.

How dn and db are computed (``dn_mode``)
----------------------------------------
With ``dz = p (dp - delta)``, ``dp_ij = do_i . v_j``, ``delta_i = do_i . o_i``:
``dn = sum_ij dz_ij * sgn(s) ln(1 + b|s|)``, ``db = sum_ij dz_ij * n s / (1 + b|s|)``.

* ``"triton"`` (default on CUDA without a custom mask): flex runs with ``n``, ``b``
  captured *detached* (no captured-gradient atomics; dq, dk, dv come from flex's own
  backward, which is exact for fixed n, b) and returns its log-sum-exp. An identity
  ``autograd.Function`` on the output adds ``dn``, ``db`` in backward with one extra
  Triton pass, ``_ssa_flex_dparams_kernel``: per (batch, head, query block) it
  recomputes ``s`` and ``p = exp(z - lse)`` tile by tile (never the N x N matrix),
  ``dp = do @ v^T`` and ``dz``, and writes one fp32 partial (row sums over its key
  loop) per program; the host sums the partials in fp64 in a fixed order, so dn/db are
  deterministic. Like the flash dQ kernel it uses the *exact* row delta
  ``sum_j p dp`` (accumulated in the same loop), not ``do . o`` of the stored 16-bit
  ``o``: ``dn`` carries ``-sum_i (delta error)_i sum_j p g`` otherwise, up to ~4x the
  eager error in fp16. Cost ~ one forward pass (2 GEMMs + the transform).
  Causal/full masks only.
* ``"flex"`` (default on CUDA with ``mask_mod``/``keep_mask``): the same identity
  Function, but the extra pass is one more *FlexAttention forward* in fp32, so any mask
  works and flex's block sparsity is reused. Trick: with weights ``w >= 0``,
  ``sum_j p_ij w_ij v_j = exp(lse'_i - lse_i) * o'_i`` where ``(o', lse')`` is flex
  with score ``z + ln w``; ``g`` and ``h`` are split into positive and negative parts,
  stacked as 2 (or 4, when db is needed) extra "heads" of one call. Then
  ``dn = sum_i do_i . (A+ - A-)_i - delta_i (c+ - c-)_i``. For 16-bit inputs one more
  head with ``w = 1`` gives the fp32 output and the exact ``delta`` (not the stored
  ``o``'s). Deterministic; costs 2-5 fp32 forward heads.
* ``"chunked"``: the same sums in plain torch over query chunks (fp32; fp64 for fp64
  inputs; exact row delta), masks evaluated with ``create_mask`` per chunk. Slow, any device; the CPU
  default and the ground truth the others are checked against.
* ``"capture"``: the naive path (n, b captured with grad; flex's captured-grad
  atomics). Kept for the benchmark. Non-deterministic (atomics).
* ``"capture_rows"``: n, b expanded to materialised ``[B, Hq, Sq]`` tensors so the
  atomics of different rows do not collide, then summed by autograd. Still
  ``atomic_add`` within a row, so non-deterministic. Kept for the benchmark.

Also considered, not used: (i) feeding flex's ``(o, lse * log2 e)`` to the shared fused
backward ``nemo_ssa.ops.common.bwd.attention_bwd`` (dq, dk, dv, dn, db in one pass)
-- that is the flash path's backward with flex's forward: it drops flex's backward and
its mask support, the reason to use this path; (ii) a 0-d captured ``n`` (fails to
compile); (iii) bf16 for the ``flex`` weight call (``dn`` is a difference of two
per-row terms of similar size; bf16 ``o'`` would cost ~3 significant digits). Timings of
every strategy: ``benchmarks/bench_flex.py`` (results in ``docs/results/``).

Compile gating (``compile="auto"`` | True | False)
---------------------------------------------------
Compiled flex is used when it is safe; otherwise eager flex (which materialises the
scores) with the reason logged once per reason at WARNING -- never silently. Known
unsafe: CPU with autograd or LSE needed (compiled CPU flex is inference-only, no LSE);
CPU with an 8-lane vector ISA (AVX2, NEON) at head dim 8 or 16, where inductor's CPU
micro-GEMM overruns its score tile and the output depends on memory past K (issue 47,
``_cpu_microgemm_overrun``); CUDA with head dim < 16 (flex's ``tl.dot`` minimum). ``compile="auto"`` also falls back
(logged) when the first compiled call of a kind raises. ``compile=True`` raises instead
of falling back. Inside an outer ``torch.compile`` flex is called directly.

Limits / differences from the reference: no dropout; ``b >= 0``; ``softmax_scale > 0``
(the shared Triton transforms take ``sgn(s) = sgn(q.k)``); ``mask_mod`` is
evaluated on a ``[B or 1, Hq or 1, Sq, Sk]`` grid (``mask_per_batch`` /
``mask_per_head`` say which indices it uses -- a head-dependent mask_mod with
``mask_per_head=False`` is evaluated for head 0 only); CPU has no q/k/v backward
(FlexAttention has none), but dn/db work on CPU. Dynamo's recompile limit applies per
compiled kind; many distinct shapes in one process can hit it (torch then warns and
runs eager).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from collections import OrderedDict
from typing import Callable, Optional, Tuple

import torch
from torch.nn.attention import flex_attention as _fa
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask, flex_attention

from nemo_ssa.ops.common.validate import MAX_HEAD_DIM, Capabilities
from nemo_ssa.ops.attention.naive import _validate

try:  # triton (and the shared transform helpers) are needed only for dn_mode="triton"
    import triton
    import triton.language as tl

    from nemo_ssa.ops.common.transforms import TRANSFORM_SSA, grad_consts, score_bwd_parts, transform_consts

    _TRITON_IMPORT_ERROR: Optional[str] = None
except Exception as _e:  # pragma: no cover - depends on the environment
    _TRITON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

__all__ = [
    "ssa_attention_flex",
    "ssa_score_mod",
    "DN_MODES",
    "BACKENDS",
    "supported_backends",
    "resolve_compile",
    "resolve_dn_mode",
    "ssa_flex_param_grads",
]

logger = logging.getLogger(__name__)

DN_MODES = ("auto", "triton", "flex", "chunked", "capture", "capture_rows")
BACKENDS = ("auto", "triton", "flash", "triton_decode")  # names torch knows (any version)
# FlexAttention has no dropout; masks of any kind are the point of this path
FLEX_CAPS = Capabilities(name="ssa_flex", transforms=("ssa",), dropout=False)
_INJECT_MODES = ("triton", "flex", "chunked")  # dn/db added by _SSAParamGrad
_HAS_AUX = hasattr(_fa, "AuxRequest")  # return_aux API (return_lse is deprecated there)


# ----------------------------------------------------------------------------- kernels

if _TRITON_IMPORT_ERROR is None:

    @triton.jit
    def _ssa_flex_dparams_kernel(
        Q, K, V, DO, LSE, DELTA, N_PTR, B_PTR, PART,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        scale, H_Q, GQA_RATIO, SQ, SK, D, NUM_M,
        CAUSAL: tl.constexpr,
        TRANSFORM: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        FAST_LOG2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Partial (dn, db) of one (batch, q-head, query block); LSE/DELTA: [B*Hq, SQ] fp32."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = pid_bh // H_Q
        off_hq = pid_bh % H_Q
        off_hkv = off_hq // GQA_RATIO  # GQA: query head h reads kv head h // group

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < SQ
        d_ok = offs_d < D

        q_base = Q + off_b.to(tl.int64) * stride_qb + off_hq.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_ob + off_hq.to(tl.int64) * stride_oh
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
        md_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                    mask=md_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        do = tl.load(do_base + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od,
                     mask=md_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        row = pid_bh.to(tl.int64) * SQ + offs_m
        lse = tl.load(LSE + row, mask=m_ok, other=float("-inf"))  # natural log, [BLOCK_M]
        delta = tl.load(DELTA + row, mask=m_ok, other=0.0)  # [BLOCK_M]
        row_ok = lse > float("-inf")  # rows that see no key have lse = -inf: p = 0
        lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)  # log2 domain for exp2

        n = tl.load(N_PTR).to(tl.float32)
        b = tl.load(B_PTR).to(tl.float32)
        c0, c1 = transform_consts(scale, n, b, TRANSFORM)
        acc_n = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum_j dz * sgn(s) log2(1 + b|s|)
        acc_b = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum_j dz * qk / (1 + b|s|)
        # for the exact row delta (as in the flash dQ kernel): sum_j p g, sum_j p h, sum_j p dp
        acc_gn = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_gb = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_de = tl.zeros([BLOCK_M], dtype=tl.float32)

        if CAUSAL:  # bottom-right: key j visible from query i iff j <= i + SK - SQ
            hi = tl.minimum((pid_m + 1) * BLOCK_M + SK - SQ, SK)
        else:
            hi = SK
        for start_n in range(0, hi, BLOCK_N):
            offs_kn = start_n + offs_n
            n_ok = offs_kn < SK
            nd_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_kn[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                        mask=nd_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_base + offs_kn[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd,
                        mask=nd_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
            valid = row_ok[:, None] & m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_kn[None, :] <= offs_m[:, None] + (SK - SQ))
            z2, smag, rinv = score_bwd_parts(qk, c0, c1, TRANSFORM, FAST_LOG2)  # one log2
            # mask the exponent (a masked score may exceed the row lse: exp2 would overflow)
            p = tl.exp2(tl.where(valid, z2 - lse2[:, None], float("-inf")))  # [BLOCK_M, BLOCK_N]
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
            dz = p * (dp - delta[:, None])  # dL/dz, natural domain; 0 where masked
            h = qk * rinv
            acc_n += tl.sum(dz * smag, axis=1)
            acc_b += tl.sum(dz * h, axis=1)
            acc_gn += tl.sum(p * smag, axis=1)
            acc_gb += tl.sum(p * h, axis=1)
            acc_de += tl.sum(p * dp, axis=1)

        # DELTA = do . o comes from the stored o (rounded to bf16/fp16): dn, db carry its
        # error times sum_j p g (the flash dQ kernel's fix, README "exact row delta");
        # acc_de = sum_j p dp is the exact delta of this row, so correct by the difference.
        corr = delta - acc_de
        acc_n += corr * acc_gn
        acc_b += corr * acc_gb
        _g_s, g_n, g_b = grad_consts(scale, n, b, TRANSFORM)  # ln 2, n * scale
        out = PART + (pid_bh.to(tl.int64) * NUM_M + pid_m) * 2
        tl.store(out, g_n * tl.sum(acc_n, axis=0))
        tl.store(out + 1, g_b * tl.sum(acc_b, axis=0))


# ---------------------------------------------------------------------- host launchers


def _triton_usable(device: torch.device) -> Optional[str]:
    """None when the Triton dn kernel can run on ``device``, else the reason it cannot."""
    if _TRITON_IMPORT_ERROR is not None:
        return f"triton / nemo_ssa.ops.common.transforms unavailable ({_TRITON_IMPORT_ERROR})"
    if _kernel_interpreted():
        if device.type == "cpu":
            return None  # TRITON_INTERPRET=1 at import: CPU tests of the kernel
        return "the Triton dn kernel was built for the interpreter (TRITON_INTERPRET=1 at import)"
    if device.type == "cuda":
        return None
    return f"the Triton dn kernel needs CUDA (or TRITON_INTERPRET=1 before import), got device {device.type}"


def _kernel_interpreted() -> bool:
    """True when the kernel was decorated under TRITON_INTERPRET=1 (read at decoration)."""
    return _TRITON_IMPORT_ERROR is None and type(_ssa_flex_dparams_kernel).__name__ == "InterpretedFunction"


def _dparams_triton(q, k, v, do, lse, delta, n_c, b_c, scale: float, causal: bool):
    """(dn, db) as fp64 0-d tensors from the fused Triton pass. lse/delta: [B, Hq, Sq] fp32."""
    bsz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    # Elementwise-heavy tiles (log2, exp2, reciprocal per score): 128 x 64 with 8 warps on
    # GPU for D <= 64 (not autotuned); 64 x 64 elsewhere and in the interpreter, so the
    # CPU tests cover several query blocks and ragged tails.
    if q.device.type == "cuda" and d <= 64:
        block_m, block_n, warps = 128, 64, 8
    else:
        block_m, block_n, warps = 64, 64, 4
    block_d = max(16, triton.next_power_of_2(d))
    num_m = triton.cdiv(sq, block_m)
    part = torch.empty(bsz * hq, num_m, 2, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 flag is ignored for bf16/fp16
    _ssa_flex_dparams_kernel[(num_m, bsz * hq)](
        q, k, v, do, lse, delta, n_c, b_c, part,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        float(scale), hq, hq // hkv, sq, sk, d, num_m,
        CAUSAL=bool(causal), TRANSFORM=TRANSFORM_SSA, INPUT_PRECISION=precision,
        FAST_LOG2=q.device.type == "cuda" and torch.version.hip is None and not _kernel_interpreted(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=warps, num_stages=2,
    )
    tot = part.to(torch.float64).sum(dim=(0, 1))  # fixed-order reduction: deterministic
    return tot[0], tot[1]


def _ssa_z_parts(t: torch.Tensor, n: torch.Tensor, b: torch.Tensor):
    """``(z, L, a)`` with ``a = |t|``, ``L = log1p(b a)``, ``z = n sgn(t) L``; sgn(0) := +1.

    ``|t|`` is written ``where(t >= 0, t, -t)`` so autograd gives ``dz/dt = n b / (1 + b|t|)``
    also at ``t = 0`` (like ``naive.ssa_transform``) and the dtype of ``t`` is kept.
    """
    pos = t >= 0
    a = torch.where(pos, t, -t)
    mag = torch.log1p(b * a)
    return n * torch.where(pos, mag, -mag), mag, a


def _dparams_chunked(q, k, v, do, lse, delta, n_c, b_c, scale, dense_mask, need_b: bool,
                     chunk: Optional[int] = None):
    """(dn, db) in plain torch, one query chunk at a time (never the full N x N).

    ``dense_mask(q0, q1)`` -> bool ``[B|1, Hq|1, q1-q0, Sk]`` (True = visible) or None.
    """
    bsz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if chunk is None:  # ~32M scores per temporary
        chunk = max(16, min(sq, (1 << 25) // max(1, bsz * hq * sk)))
    kt = k.to(cdt)[:, :, None].transpose(-1, -2)  # [B, Hkv, 1, D, Sk]
    vt = v.to(cdt)[:, :, None].transpose(-1, -2)
    n_, b_ = n_c.to(cdt).reshape(()), b_c.to(cdt).reshape(())
    tot_n = torch.zeros((), dtype=torch.float64, device=q.device)
    tot_b = torch.zeros((), dtype=torch.float64, device=q.device)
    for q0 in range(0, sq, chunk):
        q1 = min(sq, q0 + chunk)
        c = q1 - q0
        qc = q[:, :, q0:q1].to(cdt).reshape(bsz, hkv, g, c, d)
        s = (torch.matmul(qc, kt) * scale).reshape(bsz, hq, c, sk)  # [B, Hq, C, Sk]
        z, mag, a = _ssa_z_parts(s, n_, b_)
        lse_c = lse[:, :, q0:q1, None].to(cdt)
        ok = torch.isfinite(lse_c)
        vis = dense_mask(q0, q1)
        keep = ok if vis is None else (ok & vis)
        p = torch.where(keep, torch.exp(z - torch.where(ok, lse_c, 0.0)), 0.0)
        doc = do[:, :, q0:q1].to(cdt).reshape(bsz, hkv, g, c, d)
        dp = torch.matmul(doc, vt).reshape(bsz, hq, c, sk)
        # exact row delta sum_j p dp (the whole row is here), not do . o from the stored o,
        # whose 16-bit rounding dn/db would inherit (see _ssa_flex_dparams_kernel)
        dz = p * (dp - (p * dp).sum(-1, keepdim=True))
        tot_n += (dz * torch.where(s >= 0, mag, -mag)).sum(dtype=torch.float64)
        if need_b:
            tot_b += (dz * (n_ * s / (1.0 + b_ * a))).sum(dtype=torch.float64)
    return tot_n, tot_b


def _weight_score_mod(n_c, b_c, modes: int, ones: bool = False):
    """score_mod for dn_mode='flex': head ``h*M + m`` gets ``z + ln w_m`` (see docstring),
    ``M = modes + ones``.

    m = 0: g+ = ln(1+b|s|) where s > 0;  m = 1: g- = ln(1+b|s|) where s < 0;
    m = 2: h+ = max(n s/(1+b|s|), 0);    m = 3: h- = max(-n s/(1+b|s|), 0);
    m = modes (when ``ones``): w = 1, i.e. the fp32 output itself (for the exact delta).
    ``ln 0 = -inf`` drops the entry, exactly like a mask.
    """
    total = modes + int(bool(ones))

    def score_mod(score, batch, head, q_idx, kv_idx):
        n_, b_ = n_c[0], b_c[0]
        z, mag, a = _ssa_z_parts(score, n_, b_)
        mode = head % total
        w = torch.where(mode == 0, torch.where(score > 0, mag, 0.0), torch.where(score < 0, mag, 0.0))
        if modes == 4:
            hb = n_ * score / (1.0 + b_ * a)
            w = torch.where(mode == 2, torch.clamp(hb, min=0.0), torch.where(mode == 3, torch.clamp(-hb, min=0.0), w))
        if ones:
            w = torch.where(mode == modes, torch.ones_like(w), w)
        return z + torch.log(w)

    return score_mod


def _dparams_flex(q, k, v, do, lse, delta, n_c, b_c, scale, cfg: "_Cfg", need_b: bool,
                  exact_delta: bool = False):
    """(dn, db) from one extra fp32 FlexAttention forward with 2 or 4 weight "heads" (+1
    with ``exact_delta``: the fp32 output, so ``delta`` does not inherit the rounding of a
    16-bit stored ``o``)."""
    bsz, hq, sq, d = q.shape
    base = 4 if need_b else 2
    modes = base + int(bool(exact_delta))
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_aug = q.to(cdt)[:, :, None].expand(bsz, hq, modes, sq, d).reshape(bsz, hq * modes, sq, d)
    block_mask = cfg.block_mask_for(modes)
    o_aug, lse_aug = _flex_call(
        q_aug, k.to(cdt), v.to(cdt), _weight_score_mod(n_c, b_c, base, exact_delta), block_mask, scale,
        return_lse=True, cfg=cfg, kind="weights",
    )
    o_aug = o_aug.to(cdt).reshape(bsz, hq, modes, sq, d)
    lse_aug = lse_aug.to(cdt).reshape(bsz, hq, modes, sq)
    lse_ = lse.to(cdt)[:, :, None]
    ok = torch.isfinite(lse_)
    c = torch.where(ok, torch.exp(lse_aug - torch.where(ok, lse_, 0.0)), 0.0)  # sum_j p w
    dof = do.to(cdt)[:, :, None]
    apw = (dof * o_aug).sum(-1) * c  # do_i . sum_j p w v_j  [B, Hq, modes, Sq]
    if exact_delta:  # the w = 1 head: do_i . sum_j p_ij v_j = sum_j p dp, in fp32
        delta = apw[:, :, base]
    # sum_i do_i . (sum_j p w v_j) - delta_i * sum_j p w, per mode
    per_mode = apw - delta.to(cdt)[:, :, None] * c
    tot = per_mode.sum(dim=(0, 1, 3), dtype=torch.float64)
    dn = tot[0] - tot[1]
    db = tot[2] - tot[3] if need_b else torch.zeros((), dtype=torch.float64, device=q.device)
    return dn, db


def ssa_flex_param_grads(q, k, v, o, do, lse, n, b, *, causal=False, softmax_scale=None,
                         mode="chunked", mask_mod=None, keep_mask=None, mask_per_batch=True,
                         mask_per_head=False, need_b=True, compile=False):
    """dL/dn, dL/db of SSA attention from saved forward quantities (no flex backward).

    The pass the autograd path runs, as a stand-alone entry point (tests, benchmark).
    ``o`` and ``lse`` (natural log, ``[B, Hq, Sq]``, ``-inf`` for rows with no visible
    key) are the forward's output and log-sum-exp; ``do`` = dL/do. Masks as in
    ``ssa_attention_flex``.

    Args:
        mode: ``"triton"``, ``"flex"`` or ``"chunked"`` (see module docstring).
        compile: for ``mode="flex"`` only: compile its FlexAttention call.
    Returns:
        ``(dn, db)``: float64 0-d tensors (``db`` is 0 when ``need_b`` is False for "flex").
    """
    if mode not in _INJECT_MODES:
        raise ValueError(f"mode must be one of {_INJECT_MODES}, got {mode!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    compiled = False
    if mode == "flex":
        compiled, _ = resolve_compile(compile, q.device, q.shape[-1], True, kind="weights")
    cfg = _make_cfg(q, k, mode=mode, scale=scale, causal=causal, mask_mod=mask_mod, keep_mask=keep_mask,
                    mask_per_batch=mask_per_batch, mask_per_head=mask_per_head, compiled=compiled,
                    kernel_options=None, compile_request=compile)
    return _param_grads(cfg, q, k, v, o, do, lse, n, b, need_b)


def _param_grads(cfg: "_Cfg", q, k, v, o, do, lse, n, b, need_b: bool):
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_c = n.detach().to(cdt).reshape(1)
    b_c = b.detach().to(cdt).reshape(1)
    delta = (o.to(cdt) * do.to(cdt)).sum(-1)  # [B, Hq, Sq] = rowsum(o * do)
    if cfg.mode == "triton":
        reason = _triton_usable(q.device)
        if reason is not None:
            raise RuntimeError(f"dn_mode='triton': {reason}")
        return _dparams_triton(q, k, v, do, lse, delta, n_c, b_c, cfg.scale, cfg.causal)
    if cfg.mode == "flex":
        return _dparams_flex(q, k, v, do, lse, delta, n_c, b_c, cfg.scale, cfg, need_b,
                             exact_delta=o.dtype in (torch.float16, torch.bfloat16))
    return _dparams_chunked(q, k, v, do, lse, delta, n_c, b_c, cfg.scale, cfg.dense_mask, need_b)


# ---------------------------------------------------------------------- masks, options


def _causal_mask_mod(sq: int, sk: int):
    offset = sk - sq

    def causal(b, h, q_idx, kv_idx):  # bottom-right aligned (flash-attn convention)
        return kv_idx <= q_idx + offset

    return causal


def _keep_mask_mod(keep: torch.Tensor):
    """A bool tensor broadcastable to [B, Hq, Sq, Sk] as a mask_mod (broadcast dims read 0)."""
    keep4 = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    per_b, per_h = keep4.shape[0] > 1, keep4.shape[1] > 1
    per_q, per_k = keep4.shape[2] > 1, keep4.shape[3] > 1

    def keep_mod(b, h, q_idx, kv_idx):
        return keep4[b if per_b else 0, h if per_h else 0, q_idx if per_q else 0, kv_idx if per_k else 0]

    return keep_mod


@dataclasses.dataclass
class _Cfg:
    """Everything backward needs besides tensors (lives on ctx; never a tensor input)."""

    mode: str
    scale: float
    causal: bool
    mask_mod: Optional[Callable]
    keep_mask: Optional[torch.Tensor]
    mask_per_batch: bool
    mask_per_head: bool
    compiled: bool
    kernel_options: Optional[dict]
    shape: Tuple[int, int, int, int]  # (B, Hq, Sq, Sk)
    device: torch.device
    compile_request: object = "auto"  # the caller's compile= (True: never fall back)

    @property
    def has_user_mask(self) -> bool:
        return self.mask_mod is not None or self.keep_mask is not None

    def mask_fn(self, head_repeat: int = 1):
        """The combined mask_mod (causal AND keep_mask AND mask_mod), or None."""
        bsz, hq, sq, sk = self.shape
        mods = []
        if self.causal:
            mods.append(_causal_mask_mod(sq, sk))
        if self.keep_mask is not None:
            mods.append(_keep_mask_mod(self.keep_mask))
        if self.mask_mod is not None:
            mods.append(self.mask_mod)
        if not mods:
            return None
        fn = mods[0] if len(mods) == 1 else and_masks(*mods)
        if head_repeat > 1 and self.has_user_mask and self.mask_per_head:
            inner = fn

            def fn(b, h, q_idx, kv_idx):  # stacked heads h*M + m read the mask of head h
                return inner(b, h // head_repeat, q_idx, kv_idx)

        return fn

    def _grid(self, head_repeat: int = 1):
        bsz, hq = self.shape[0], self.shape[1]
        user = self.has_user_mask
        mb = bsz if (user and self.mask_per_batch) else None
        mh = hq * head_repeat if (user and self.mask_per_head) else None
        return mb, mh

    def block_mask_for(self, head_repeat: int = 1):
        fn = self.mask_fn(head_repeat)
        if fn is None:
            return None
        mb, mh = self._grid(head_repeat)
        return _cached_block_mask(fn, self, mb, mh, head_repeat)

    def dense_mask(self, q0: int, q1: int):
        """Bool ``[B|1, Hq|1, q1-q0, Sk]`` for the chunked pass, or None."""
        bsz, hq, sq, sk = self.shape
        if not self.has_user_mask:
            if not self.causal:
                return None
            i = torch.arange(q0, q1, device=self.device)[:, None]
            j = torch.arange(sk, device=self.device)[None, :]
            return (j <= i + (sk - sq))[None, None]
        fn = self.mask_fn()
        mb, mh = self._grid()

        def shifted(b, h, q_idx, kv_idx):
            return fn(b, h, q_idx + q0, kv_idx)

        return create_mask(shifted, mb, mh, q1 - q0, sk, device=self.device)


def _make_cfg(q, k, *, mode, scale, causal, mask_mod, keep_mask, mask_per_batch, mask_per_head,
              compiled, kernel_options, compile_request) -> _Cfg:
    if keep_mask is not None:  # a keep_mask that varies along batch / heads widens the grid
        km = keep_mask.reshape((1,) * (4 - keep_mask.dim()) + tuple(keep_mask.shape))
        mask_per_batch = mask_per_batch or km.shape[0] > 1
        mask_per_head = mask_per_head or km.shape[1] > 1
    return _Cfg(mode=mode, scale=float(scale), causal=bool(causal), mask_mod=mask_mod, keep_mask=keep_mask,
                mask_per_batch=bool(mask_per_batch), mask_per_head=bool(mask_per_head), compiled=compiled,
                kernel_options=kernel_options, shape=(q.shape[0], q.shape[1], q.shape[2], k.shape[2]),
                device=q.device, compile_request=compile_request)


_BLOCK_MASKS: "OrderedDict[tuple, tuple]" = OrderedDict()
_BLOCK_MASK_CACHE_SIZE = 8


def _cached_block_mask(fn, cfg: _Cfg, mb, mh, head_repeat: int):
    """create_block_mask, cached on shapes and the *identity* of the user's mask objects.

    Strong references to the user's mask_mod / keep_mask live in the entry, so an id cannot
    be recycled while its entry exists; layers of one step share one BlockMask.
    """
    bsz, hq, sq, sk = cfg.shape
    key = (cfg.causal, sq, sk, str(cfg.device), mb, mh, head_repeat,
           id(cfg.mask_mod), id(cfg.keep_mask))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0] is cfg.mask_mod and hit[1] is cfg.keep_mask:
        _BLOCK_MASKS.move_to_end(key)
        return hit[2]
    bm = create_block_mask(fn, mb, mh, sq, sk, device=cfg.device)
    _BLOCK_MASKS[key] = (cfg.mask_mod, cfg.keep_mask, bm)
    while len(_BLOCK_MASKS) > _BLOCK_MASK_CACHE_SIZE:
        _BLOCK_MASKS.popitem(last=False)
    return bm


def supported_backends() -> Tuple[str, ...]:
    """Backends the installed torch accepts in ``kernel_options["BACKEND"]`` (lower case).

    Always contains "auto". Older torch without the ``BACKEND`` option: only "auto".
    """
    lit = getattr(_fa, "_Backend", None)
    names = typing.get_args(lit) if lit is not None else ()
    return ("auto",) + tuple(sorted(x.lower() for x in names if isinstance(x, str) and x.upper() != "AUTO"))


def _kernel_options(backend) -> Optional[dict]:
    """Validate ``backend``; AUTO -> None (no kernel options at all), else {"BACKEND": NAME}."""
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a string, one of {BACKENDS}; got {type(backend).__name__}")
    name = backend.lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown FlexAttention backend {backend!r}; expected one of {BACKENDS}")
    if name == "auto":
        return None  # seed 000: AUTO must not leak kernel options
    ok = supported_backends()
    if name not in ok:
        raise ValueError(
            f"FlexAttention backend {backend!r} is not available in torch {torch.__version__} "
            f"(supported here: {ok}); use backend='auto'"
        )
    return {"BACKEND": name.upper()}


# ---------------------------------------------------------------------- compile gating

_LOGGED: set = set()
_COMPILE_BROKEN: dict = {}  # kind -> reason (compile="auto" fell back after an error)
_COMPILED: dict = {}


def _log_once(level: int, key: str, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg)


#: the oldest torch whose compiled CPU FlexAttention ran here (the locks: 2.11, 2.13)
CPU_COMPILE_TORCH = (2, 11)


def _torch_version(version: Optional[str] = None) -> Tuple[int, int]:
    return tuple(int(x) for x in (version or torch.__version__).split("+")[0].split(".")[:2])


def resolve_compile(compile, device: torch.device, head_dim: int, needs_autograd_or_lse: bool,
                    kind: str = "main") -> Tuple[bool, Optional[str]]:
    """Decide compiled vs eager FlexAttention. Returns ``(use_compiled, reason_if_not)``.

    ``compile=True`` raises ``ValueError`` when a known-unsafe condition applies;
    ``"auto"`` falls back to eager and logs the reason once (WARNING); False is eager.
    """
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    if compile is False:
        return False, "compile=False"
    reason = None
    if device.type == "cpu" and needs_autograd_or_lse:
        reason = "compiled FlexAttention on CPU is inference-only (no backward, no log-sum-exp)"
    elif device.type == "cpu" and _torch_version() < CPU_COMPILE_TORCH:
        # torch 2.9.1 (NeMo FW 25.11's) aborts the process in compiled CPU FlexAttention
        # (tests/megatron/test_module_poison.py under that stack, 2026-11-27)
        reason = (f"compiled FlexAttention on CPU needs torch >= {'.'.join(map(str, CPU_COMPILE_TORCH))} "
                  f"(torch {torch.__version__} aborts in it)")
    elif device.type == "cpu" and _cpu_microgemm_overrun(head_dim) is not None:
        reason = _cpu_microgemm_overrun(head_dim)
    elif device.type == "cuda" and head_dim < 16:
        reason = f"compiled FlexAttention needs head dim >= 16 on CUDA (got {head_dim})"
    elif device.type == "cuda" and head_dim > MAX_HEAD_DIM:
        # inductor pads D to a power of two: past 256 its fp32 tiles need more shared memory
        # than an H100/H200 has (D 291 asked for 512 KiB of 227 in the GPU ops fuzz)
        reason = f"compiled FlexAttention needs head dim <= {MAX_HEAD_DIM} on CUDA (got {head_dim})"
    elif device.type not in ("cuda", "cpu"):
        reason = f"compiled FlexAttention is untested on device {device.type!r} here"
    elif not torch._dynamo.is_dynamo_supported():
        reason = "torch.compile (dynamo) is not supported on this Python/torch"
    elif compile == "auto" and kind in _COMPILE_BROKEN:
        reason = _COMPILE_BROKEN[kind]
    if reason is None:
        return True, None
    if compile is True:
        raise ValueError(f"compile=True is not possible here: {reason}")
    _log_once(logging.WARNING, f"compile:{reason}",
              f"ssa_flex: running eager FlexAttention (materialises the scores) because {reason}")
    return False, reason


# Inductor's CPU FlexAttention template computes q @ k^T with a micro-GEMM of fixed
# register blocking (1 row x 16 keys). Its key-tail kernel takes the "transpose first"
# branch when head_dim % L == 0, head_dim < 24 and the tail N % L == 0 (L = float lanes
# of the vector ISA), but that branch ignores N: it reads keys N..15 past the block and
# stores 16 scores into a row of N. For N = 8 on an 8-lane ISA (AVX2, NEON, or no
# vector ISA) the last row's overrun lands in the kernel's running row maxima, so an
# output depends on whatever memory follows K: off by ~1.6 or NaN (issue 47; seen on
# torch 2.13.0 CPU, template of pytorch PR #147068). 16-lane ISAs (AVX-512) cannot meet
# N % 16 == 0 with N < 16. The guard is keyed on what we can read before compiling --
# the ISA's lanes and the head dim -- not on the key length, whose tail depends on the
# block mask's block size; eager flex is exact and CPU flex is inference-only anyway.
_MICROGEMM_BLOCK_N = 16  # GemmBlocking(1, 16, 1) in torch/_inductor/codegen/cpp_flex_attention_template.py
_MICROGEMM_TRANSPOSE_K = 24  # "24 * BLOCK_M > K" selects the overrunning branch (BLOCK_M = 1)


def _cpu_float_lanes() -> int:
    """float32 lanes of the vector ISA inductor compiles CPU kernels for.

    Without a usable vector ISA, ATen's generic ``Vectorized<float>`` is 32 bytes: 8 lanes.
    """
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        return int(isa.nelements(torch.float32)) if isa else 8
    except Exception:  # pragma: no cover - depends on the torch build
        return 8


def _cpu_microgemm_overrun(head_dim: int) -> Optional[str]:
    """Why compiled CPU flex may overrun its score buffer at this head dim, else None."""
    lanes = _cpu_float_lanes()
    if lanes < _MICROGEMM_BLOCK_N and head_dim % lanes == 0 and head_dim < _MICROGEMM_TRANSPOSE_K:
        return (f"compiled FlexAttention on this CPU ({lanes} float lanes) at head dim {head_dim} reads "
                f"past K and overwrites its row maxima when a key block ends {lanes} keys into a "
                f"{_MICROGEMM_BLOCK_N}-key tile (torch inductor's CPU micro-GEMM, issue 47 of nemo-ssa; "
                f"docs/results/2026-11-27-flex-cpu-overrun)")
    return None


def _compiled_fn(kind: str):
    fn = _COMPILED.get(kind)
    if fn is None:
        # One wrapper per kind: dynamo's recompile limit is per code object, so the main
        # call and the dn/db weight call do not share one budget of cache entries.
        def _main(*args, **kw):
            return flex_attention(*args, **kw)

        def _weights(*args, **kw):
            return flex_attention(*args, **kw)

        def _softmax(*args, **kw):
            return flex_attention(*args, **kw)

        raw = {"main": _main, "weights": _weights, "softmax": _softmax}[kind]
        fn = torch.compile(raw, dynamic=False, fullgraph=True)
        _COMPILED[kind] = fn
    return fn


def _eager_flex(q, k, v, **kw):
    """Eager flex_attention with static shapes in its internal (eager-backend) compile.

    Eager flex still traces the hop with dynamo; after calls with different head counts
    (the dn_mode='flex' weight call stacks heads) dynamo marks dims dynamic, and a later
    call with a captured tensor that requires grad then fails in fake-tensor propagation
    ("Pending unbacked symbols", torch 2.13 CPU). Static shapes avoid it.
    """
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return flex_attention(q, k, v, **kw)


def _flex_call(q, k, v, score_mod, block_mask, scale, *, return_lse: bool, cfg: _Cfg, kind: str):
    """flex_attention (compiled or eager per cfg) -> ``o`` or ``(o, lse)`` with lse natural-log."""
    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=scale,
              enable_gqa=q.shape[1] != k.shape[1])
    if cfg.kernel_options is not None:
        kw["kernel_options"] = dict(cfg.kernel_options)
    if return_lse:
        if _HAS_AUX:
            kw["return_aux"] = _fa.AuxRequest(lse=True)
        else:  # older torch: return_lse (also natural log)
            kw["return_lse"] = True

    def unpack(out):
        if not return_lse:
            return out
        o, aux = out
        return o, (aux.lse if _HAS_AUX else aux)

    if torch.compiler.is_compiling():
        return unpack(flex_attention(q, k, v, **kw))
    if not cfg.compiled:
        return unpack(_eager_flex(q, k, v, **kw))
    try:
        return unpack(_compiled_fn(kind)(q, k, v, **kw))
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        if cfg.compile_request is not True and kind not in _COMPILE_BROKEN:
            reason = f"the compiled {kind} call raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            _COMPILE_BROKEN[kind] = reason
            _log_once(logging.WARNING, f"broken:{kind}",
                      f"ssa_flex: falling back to eager FlexAttention because {reason}")
            if cfg.kernel_options is not None:
                raise
            return unpack(_eager_flex(q, k, v, **kw))
        raise


# ----------------------------------------------------------------------- autograd glue


class _SSAParamGrad(torch.autograd.Function):
    """Identity on ``o``; backward adds dL/dn, dL/db from (q, k, v, o, do, lse).

    ``o`` came from flex with n, b captured *detached*, so flex's backward gives the
    exact dq, dk, dv for fixed (n, b) and has no captured-gradient atomics; this node
    supplies the missing ``sum do . do/dn`` (and db).
    """

    @staticmethod
    def forward(ctx, o, n, b, q, k, v, lse, cfg):
        ctx.save_for_backward(o, n, b, q, k, v, lse)
        ctx.cfg = cfg
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        o, n, b, q, k, v, lse = ctx.saved_tensors
        need_n, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dn = db = None
        if need_n or need_b:
            with torch.no_grad():
                gn, gb = _param_grads(ctx.cfg, q, k, v, o, do, lse, n, b, need_b)
            dn = gn.to(n.dtype).reshape(n.shape) if need_n else None
            db = gb.to(b.dtype).reshape(b.shape) if need_b else None
        return do, dn, db, None, None, None, None, None


# ------------------------------------------------------------------------- public API


def ssa_score_mod(n: torch.Tensor, b: torch.Tensor, scale: float = 1.0):
    """FlexAttention ``score_mod`` computing ``z = n * sgn(t) * log1p(b |t|)``, ``t = scale * score``.

    ``n`` and ``b`` stay tensors (1-element or 0-d; reshaped to ``[1]`` and read as
    ``n[0]``, the form that compiles), so autograd reaches them -- the seed's
    ``float(n)`` made n a constant. Flex already multiplies ``q . k`` by its own
    ``scale`` argument before the score_mod, so ``scale`` here is 1 unless the caller
    passes ``scale=1.0`` to flex. ``sgn(0) := +1``; ``dz/dt = n b/(1 + b|t|)`` also at 0.
    """
    for name, t in (("n", n), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.numel() != 1:
            raise ValueError(f"`{name}` must be a 1-element tensor (kept in the autograd graph), got {t!r}")
    n1, b1 = n.reshape(1), b.reshape(1)
    scale = float(scale)

    def score_mod(score, batch, head, q_idx, kv_idx):
        t = score if scale == 1.0 else score * scale
        return _ssa_z_parts(t, n1[0], b1[0])[0]

    return score_mod


def _ssa_score_mod_rows(n_rows: torch.Tensor, b_rows: torch.Tensor):
    """score_mod reading n, b from materialised per-(batch, head, query) tensors."""

    def score_mod(score, batch, head, q_idx, kv_idx):
        return _ssa_z_parts(score, n_rows[batch, head, q_idx], b_rows[batch, head, q_idx])[0]

    return score_mod


def resolve_dn_mode(dn_mode: str, device: torch.device, dtype: torch.dtype, has_user_mask: bool,
                    head_dim: Optional[int] = None) -> str:
    """Pick the dn/db strategy ("auto" -> triton | flex | chunked); validate explicit ones."""
    if dn_mode not in DN_MODES:
        raise ValueError(f"unknown dn_mode {dn_mode!r}; expected one of {DN_MODES}")
    too_wide = head_dim is not None and head_dim > MAX_HEAD_DIM
    if dn_mode == "triton":
        if has_user_mask:
            raise ValueError("dn_mode='triton' handles causal/full masks only; with mask_mod or "
                             "keep_mask use dn_mode='flex' (or 'chunked')")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dn_mode='triton' supports fp32/bf16/fp16, got {dtype}")
        if too_wide:
            raise ValueError(f"dn_mode='triton' supports head dim <= {MAX_HEAD_DIM}, got {head_dim}; "
                             "use dn_mode='chunked'")
        return dn_mode
    if dn_mode != "auto":
        return dn_mode
    if device.type != "cuda":
        return "chunked"  # CPU: exact, and flex has no CPU backward anyway
    if too_wide:
        # neither the dn kernel's tiles nor compiled flex's fit a GPU's shared memory there
        _log_once(logging.WARNING, f"dn:wide{head_dim}",
                  f"ssa_flex: dn_mode 'auto' uses 'chunked' at head dim {head_dim} (> {MAX_HEAD_DIM})")
        return "chunked"
    if has_user_mask:
        return "flex"
    if dtype == torch.float64:
        return "chunked"
    reason = _triton_usable(device)
    if reason is not None:
        _log_once(logging.WARNING, f"dn:{reason}", f"ssa_flex: dn_mode 'auto' uses 'flex' because {reason}")
        return "flex"
    return "triton"


def ssa_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n: torch.Tensor,
    b: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    mask_mod: Optional[Callable] = None,
    mask_per_batch: bool = True,
    mask_per_head: bool = False,
    backend: str = "auto",
    compile="auto",
    dn_mode: str = "auto",
) -> torch.Tensor:
    """SSA attention through FlexAttention (the semantics of ``ssa_attention_naive``).

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0`` (GQA via ``enable_gqa``).
        n, b: SSA parameters, 1-element tensors (``[1]`` or 0-d); may require grad.
        causal: bottom-right-aligned causal mask (``kv <= q + Sk - Sq``).
        softmax_scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        keep_mask: optional bool tensor broadcastable to ``[B, Hq, Sq, Sk]`` (True = may
            attend), turned into a mask_mod; AND-ed with the other masks.
        dropout_p: must be 0 (FlexAttention has no dropout); kept for the registry's
            calling convention.
        mask_mod: optional FlexAttention mask_mod ``(b, h, q_idx, kv_idx) -> bool``,
            AND-ed with ``causal``. Block masks are cached on the identity of this object
            (reuse one mask_mod across layers of a step).
        mask_per_batch, mask_per_head: whether ``mask_mod`` depends on the batch / head
            index (the mask is built on a ``[B or 1, Hq or 1, Sq, Sk]`` grid).
        backend: ``"auto"`` (no kernel options passed) or an explicit FlexAttention
            backend (``"triton"``, ``"flash"``, ``"triton_decode"``), validated against
            the installed torch; an explicit backend needs the compiled path.
        compile: ``"auto"`` (compile when safe, else eager with a logged reason), True
            (compile or raise), False (eager flex, which materialises the scores).
        dn_mode: how dL/dn, dL/db are computed: ``"auto"``, ``"triton"``, ``"flex"``,
            ``"chunked"``, ``"capture"``, ``"capture_rows"`` (module docstring).

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype; rows without a visible key are 0.
    """
    _validate(q, k, v, transform="ssa", n=n, b=b, causal=causal, keep_mask=keep_mask, dropout_p=dropout_p,
              softmax_scale=softmax_scale, caps=FLEX_CAPS)
    if mask_mod is not None and not callable(mask_mod):
        raise ValueError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
    kernel_options = _kernel_options(backend)
    grad_on = torch.is_grad_enabled()
    need_qkv = grad_on and any(t.requires_grad for t in (q, k, v))
    need_param = grad_on and (n.requires_grad or b.requires_grad)
    if q.device.type == "cpu" and need_qkv:
        raise NotImplementedError(
            "ssa_flex: q/k/v on cpu with requires_grad are not supported (FlexAttention has no CPU "
            "backward); supported: CUDA tensors, or CPU inputs without requires_grad (n/b gradients "
            "work). To train on CPU use attention=ssa_reference")
    has_user_mask = mask_mod is not None or keep_mask is not None
    mode = resolve_dn_mode(dn_mode, q.device, q.dtype, has_user_mask, q.shape[-1]) if need_param else "none"
    needs_lse = need_param and mode in _INJECT_MODES
    compiled, _ = resolve_compile(compile, q.device, q.shape[-1], need_qkv or need_param or needs_lse)
    if kernel_options is not None and not compiled and not torch.compiler.is_compiling():
        raise ValueError(f"backend={backend!r} selects a compiled FlexAttention kernel, but this call "
                         f"runs eager flex (compile={compile!r}); use backend='auto' or a compiled setup")

    bsz, hq, sq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    cfg = _make_cfg(q, k, mode=mode, scale=scale, causal=causal, mask_mod=mask_mod, keep_mask=keep_mask,
                    mask_per_batch=mask_per_batch, mask_per_head=mask_per_head, compiled=compiled,
                    kernel_options=kernel_options, compile_request=compile)
    block_mask = cfg.block_mask_for(1)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32

    if mode == "capture":  # naive: learnable capture, flex's captured-grad atomics
        score_mod = ssa_score_mod(n.to(cdt), b.to(cdt))
        return _flex_call(q, k, v, score_mod, block_mask, scale, return_lse=False, cfg=cfg, kind="main")
    if mode == "capture_rows":  # per-row materialised capture, summed by autograd
        n_rows = n.to(cdt).reshape(1, 1, 1).expand(bsz, hq, sq).contiguous()
        b_rows = b.to(cdt).reshape(1, 1, 1).expand(bsz, hq, sq).contiguous()
        score_mod = _ssa_score_mod_rows(n_rows, b_rows)
        return _flex_call(q, k, v, score_mod, block_mask, scale, return_lse=False, cfg=cfg, kind="main")

    # n, b captured detached: no captured-gradient path inside flex.
    score_mod = ssa_score_mod(n.detach().to(cdt), b.detach().to(cdt))
    if not need_param:
        return _flex_call(q, k, v, score_mod, block_mask, scale, return_lse=False, cfg=cfg, kind="main")
    o, lse = _flex_call(q, k, v, score_mod, block_mask, scale, return_lse=True, cfg=cfg, kind="main")
    return _SSAParamGrad.apply(o, n, b, q.detach(), k.detach(), v.detach(), lse.detach(), cfg)
