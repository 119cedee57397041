"""Score transforms as Triton device functions: one transform inside every schedule.

Every kernel in ``nemo_ssa.ops`` computes a softmax over *transformed* scores. The
transform is a compile-time choice (``TRANSFORM: tl.constexpr``), so the flash, ELSA and
NSA schedules share this file instead of copying per-transform variants.

Conventions (all math in fp32 registers):

* ``qk`` is the raw dot product ``q . k`` (no scale applied).
* Forward returns ``z2 = z * log2(e)`` -- the transformed score in the log2 domain, ready
  for ``exp2``. For softmax ``z = scale * qk`` so ``z2 = qk * (scale * log2 e)`` (one
  multiply). For SSA ``s = scale * qk`` and
  ``z = n * sgn(s) * ln(1 + b|s|)``  =>  ``z2 = n * sgn(s) * log2(1 + b|s|)``
  (``ln(x) * log2(e) == log2(x)``), so no ``pow``/``exp`` is needed, only one ``log2``.
  ``sgn(+0) := +1``, ``sgn(-0) := -1`` (sign bit; the value is 0 either way). ``scale > 0`` is assumed, so
  ``sgn(s) == sgn(qk)``.
* Backward helpers return the pieces of the chain rule given ``dz`` (the gradient with
  respect to the natural-log-domain ``z``, i.e. ``p * (dp - delta)``):
  ``ds/dqk = scale``; ``dz/ds = n*b / (1 + b|s|)`` (true derivative, also at 0);
  ``dz/dn = sgn(s) * ln(1 + b|s|)``; ``dz/db = n * sgn(s) * |s| / (1 + b|s|) = n*s/(1+b|s|)``.

Two API levels:

* ``score_fwd`` / ``score_bwd`` / ``score_bwd_params``: self-contained elementwise maps
  taking ``scale, n, b`` (simple to call, used by readable kernels).
* The *hoisted* form used by the hot loops: ``transform_consts`` folds ``scale``, ``n``,
  ``b`` into two per-program constants once, ``score_fwd_hoisted`` maps a tile with one
  FMA + one ``log2`` + one select/multiply, and ``score_bwd_parts`` additionally returns
  ``sgn(s)*log2(1+b|s|)`` and ``1/(1+b|s|)`` so a backward kernel computes the ``log2``
  only once per element and folds the constant factors (``n*b*scale``, ``ln 2``,
  ``n*scale``) in after its loops (``grad_consts``).

``score_fwd`` and ``score_fwd_hoisted`` perform *the same* floating-point operations, so
a forward written with either and a backward written with ``score_bwd_parts`` recompute
bit-identical ``z2`` (a backward recomputes ``p = exp2(z2 - M)``; a different rounding of
``z2`` would leave rows that no longer sum to exactly 1). ``FAST_LOG2`` must be the same
in the forward and the backward for the same reason.

Masking is the schedule's job (``-inf`` on ``z2``, never on ``s``); these functions are
pure elementwise maps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nemo_ssa.ops.common import env

__all__ = [
    "TRANSFORM_SOFTMAX",
    "TRANSFORM_SSA",
    "TRANSFORM_IDS",
    "transform_id",
    "log2_fast",
    "log2_poly",
    "log2_mode",
    "rcp_fast",
    "flip_sign",
    "abs_fast",
    "poly_log2_enabled",
    "transform_consts",
    "grad_consts",
    "score_fwd",
    "score_fwd_hoisted",
    "score_fwd_smag",
    "score_bwd",
    "score_bwd_parts",
    "score_bwd_params",
]

TRANSFORM_SOFTMAX = 0
TRANSFORM_SSA = 1
TRANSFORM_IDS = {"softmax": TRANSFORM_SOFTMAX, "ssa": TRANSFORM_SSA}

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634


def transform_id(name: str) -> int:
    """Map a transform name to the ``TRANSFORM`` constexpr; unknown names raise."""
    try:
        return TRANSFORM_IDS[name]
    except KeyError:
        raise ValueError(f"unknown score transform {name!r}; supported: {sorted(TRANSFORM_IDS)}") from None


@triton.jit
def log2_poly(x):
    """``log2(x)``, ``x > 0`` normal fp32, on the FMA/ALU pipes only (no MUFU).

    Range reduction through the exponent bits (``x = m 2^e``, ``m`` in ``[sqrt(1/2),
    sqrt(2))``), then Cephes ``logf``'s degree-8 minimax for ``ln(1 + f)`` (~1e-7
    relative), times ``log2 e``. About 20 FMA/ALU ops instead of one MUFU ``lg2``.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126  # x = m * 2^e, m in [0.5, 1)
    m = ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    small = m < 0.70710678118654752
    e = tl.where(small, e - 1, e)
    f = tl.where(small, m + m - 1.0, m - 1.0)
    z = f * f
    y = 7.0376836292e-2 * f - 1.1514610310e-1
    y = y * f + 1.1676998740e-1
    y = y * f - 1.2420140846e-1
    y = y * f + 1.4249322787e-1
    y = y * f - 1.6668057665e-1
    y = y * f + 2.0000714765e-1
    y = y * f - 2.4999993993e-1
    y = y * f + 3.3333331174e-1
    y = y * f * z - 0.5 * z
    return (f + y) * 1.4426950408889634 + e.to(tl.float32)


@triton.jit
def _log2_mufu(x, FAST: tl.constexpr):
    if FAST:
        # .ftz: the inputs here are t = 1 + b|s| >= 1, never subnormal, so flushing changes
        # no result -- and it drops the subnormal rescue ptxas wraps around a plain
        # lg2.approx (FSETP + FMUL + FSEL + predicated FADD per element: 4 of the ~29
        # instructions per score in the dK/dV loop, sm_90, benchmarks/sass_mix.py)
        y = tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = tl.log2(x)
    return y


@triton.jit
def rcp_fast(x, FAST: tl.constexpr):
    """``1 / x`` for ``x >= 1`` (the SSA ``t = 1 + b|s|``).

    ``FAST`` (any nonzero ``FAST_LOG2`` mode on CUDA): one MUFU ``rcp.approx.ftz`` (~1 ulp).
    Triton lowers ``1.0 / x`` to ``div.full.f32``, which ptxas expands with range checks
    for huge and subnormal divisors (6 instructions per element). Otherwise ``1.0 / x``.
    """
    if FAST == 1 or FAST == 3:
        y = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = 1.0 / x
    return y


@triton.jit
def abs_fast(x, FAST: tl.constexpr = 0):
    """``|x|``. ``FAST`` (CUDA): PTX ``abs.f32`` as inline asm, which ptxas folds into
    the consuming FFMA as a free ``|x|`` operand. ``tl.abs`` is rewritten by LLVM into an
    integer AND in some kernels (the forward and dK/dV ones on sm_90: one extra LOP3 per
    score, benchmarks/sass_mix.py)."""
    if FAST == 1 or FAST == 3:
        y = tl.inline_asm_elementwise("abs.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.abs(x)
    return y


@triton.jit
def flip_sign(x, s, FAST: tl.constexpr = 0):
    """``x`` with its sign flipped where ``s``'s sign bit is set: ``x * sgn(s)`` as one
    LOP3 (``x ^ (s & 0x80000000)``) instead of a compare, a select and a multiply.

    ``sgn(-0.0) = -1`` here (``where(s >= 0, x, -x)`` gives +1); only ``x = log2(1 +
    b|s|) = 0`` meets ``s = -0.0``, and ``-0.0`` and ``+0.0`` are the same score.
    ``FAST`` (CUDA): the LOP3 as inline PTX. Written with bitcasts instead, LLVM turns the
    ``|qk|`` of ``t = |qk| c0 + 1`` into an integer AND as well (one more instruction
    per element, the FFMA's free ``|x|`` operand modifier lost); the interpreter takes
    the bitcast form (same bits)."""
    if FAST == 1 or FAST == 3:
        y = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, 0x80000000, 0x78;", "=r,r,r",
            [x.to(tl.uint32, bitcast=True), s.to(tl.uint32, bitcast=True)],
            dtype=tl.uint32, is_pure=True, pack=1,
        ).to(tl.float32, bitcast=True)
    else:
        xb = x.to(tl.uint32, bitcast=True)
        sb = s.to(tl.uint32, bitcast=True) & 0x80000000
        y = (xb ^ sb).to(tl.float32, bitcast=True)
    return y


@triton.jit
def log2_fast(x, FAST: tl.constexpr):
    """``log2(x)`` for fp32 2-D tiles. ``FAST`` (a bool or an int mode):

    * 0 / False: ``tl.log2``; 1 / True: PTX ``lg2.approx.f32`` (one MUFU op, ~2^-22
      relative error, ample for attention logits);
    * 2 / 3 (``NEMO_SSA_POLY_LOG2=1``, see ``log2_mode``): every other column of the tile
      through ``log2_poly`` (FMA pipes) and the rest through mode 0 / 1 -- the SSA
      transform is MUFU-bound (``lg2`` + ``exp2`` per score), this moves half the ``lg2``
      work to the otherwise idle FMA units (cf. FA3's partial ``exp2`` emulation).

    The mode must be the same in the forward and the backward (bit-identical ``z2``);
    modes 1 and 3 use inline PTX (not under ``TRITON_INTERPRET=1``); launchers decide.
    """
    if FAST >= 2:
        x3 = tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2])
        xa, xb = tl.split(x3)
        y3 = tl.join(log2_poly(xa), _log2_mufu(xb, FAST == 3))
        y = tl.reshape(y3, [x.shape[0], x.shape[1]])
    else:
        y = _log2_mufu(x, FAST)
    return y


def poly_log2_enabled() -> bool:
    """``NEMO_SSA_POLY_LOG2=1``: split the SSA ``log2`` between MUFU and a polynomial
    (A/B switch for GPU timing; read at every launch, fwd and bwd must agree)."""
    return env.poly_log2()


def log2_mode(fast_math: bool, poly: bool = None) -> int:
    """The ``FAST_LOG2`` constexpr: ``int(fast_math) + 2 * poly``."""
    if poly is None:
        poly = env.poly_log2()  # (poly_log2_enabled's read, a frame shorter: SSA calls ask per launch)
    return int(bool(fast_math)) + (2 if poly else 0)


@triton.jit
def transform_consts(scale, n, b, TRANSFORM: tl.constexpr):
    """Per-program constants ``(c0, c1)`` for ``score_fwd_hoisted``/``score_bwd_parts``.

    softmax: ``c0 = scale * log2(e)`` (``c1`` unused); SSA: ``c0 = scale * b``, ``c1 = n``.
    """
    if TRANSFORM == 1:
        c0 = scale * b
        c1 = n
    else:
        c0 = scale * 1.4426950408889634
        c1 = n
    return c0, c1


@triton.jit
def grad_consts(scale, n, b, TRANSFORM: tl.constexpr):
    """Factors a backward applies once, after its loops: ``(g_s, g_n, g_b)``.

    With ``ds_raw = dz * rinv`` (SSA) or ``dz`` (softmax) accumulated inside the loop,
    ``dL/dqk = g_s * ds_raw``: ``g_s = n*b*scale`` (SSA) / ``scale`` (softmax).
    ``dn = g_n * sum(dz * smag)`` with ``g_n = ln 2`` (``smag`` is in log2 units);
    ``db = g_b * sum(dz * qk * rinv)`` with ``g_b = n * scale``.
    """
    if TRANSFORM == 1:
        g_s = n * b * scale
    else:
        g_s = scale
    g_n = 0.6931471805599453
    g_b = n * scale
    return g_s, g_n, g_b


@triton.jit
def score_fwd_hoisted(qk, c0, c1, TRANSFORM: tl.constexpr, FAST_LOG2: tl.constexpr = False):
    """``qk`` (fp32 tile) -> ``z2`` with constants from ``transform_consts``."""
    if TRANSFORM == 1:
        mag = log2_fast(abs_fast(qk, FAST_LOG2) * c0 + 1.0, FAST_LOG2)  # log2(1 + b|s|) >= 0
        z2 = c1 * flip_sign(mag, qk, FAST_LOG2)  # == flip_sign(c1 * mag): sign flips are exact
    else:
        z2 = qk * c0
    return z2


@triton.jit
def score_fwd_smag(qk, c0, c1, TRANSFORM: tl.constexpr, FAST_LOG2: tl.constexpr = False):
    """``(z2, smag)``: ``z2`` exactly as ``score_fwd_hoisted`` (the same operations) and,
    for SSA, ``smag = sgn(s) * log2(1 + b|s|)`` as ``score_bwd_parts`` returns it. A
    forward that also accumulates the row mean of ``smag`` under ``p`` uses it (the
    single-pass backward's ``dn``, ``bwd_kernels``); softmax: ``smag`` is a placeholder."""
    if TRANSFORM == 1:
        mag = log2_fast(abs_fast(qk, FAST_LOG2) * c0 + 1.0, FAST_LOG2)
        smag = flip_sign(mag, qk, FAST_LOG2)
        z2 = c1 * smag
    else:
        z2 = qk * c0
        smag = z2
    return z2, smag


@triton.jit
def score_bwd_parts(qk, c0, c1, TRANSFORM: tl.constexpr, FAST_LOG2: tl.constexpr = False):
    """``(z2, smag, rinv)`` for a backward tile (one ``log2``, one reciprocal).

    SSA: ``z2`` exactly as ``score_fwd_hoisted``; ``smag = sgn(s) * log2(1 + b|s|)``
    (``dz/dn = ln2 * smag``); ``rinv = 1 / (1 + b|s|)`` (``dz/ds = n*b*rinv``,
    ``dz/db = n*scale*qk*rinv``). softmax: ``smag``/``rinv`` are placeholders (``z2``);
    callers guard their use with the same constexpr.
    """
    if TRANSFORM == 1:
        t = abs_fast(qk, FAST_LOG2) * c0 + 1.0
        mag = log2_fast(t, FAST_LOG2)
        smag = flip_sign(mag, qk, FAST_LOG2)
        z2 = c1 * smag  # the same operations as score_fwd_hoisted
        rinv = rcp_fast(t, FAST_LOG2)
    else:
        z2 = qk * c0
        smag = z2
        rinv = z2
    return z2, smag, rinv


@triton.jit
def score_fwd(qk, scale, n, b, TRANSFORM: tl.constexpr, FAST_LOG2: tl.constexpr = False):
    """``qk`` (fp32 tile) -> ``z2 = z * log2(e)``.  n, b: fp32 scalars (ignored for softmax).

    Same arithmetic as ``score_fwd_hoisted(qk, *transform_consts(scale, n, b))``.
    """
    c0, c1 = transform_consts(scale, n, b, TRANSFORM)
    return score_fwd_hoisted(qk, c0, c1, TRANSFORM, FAST_LOG2)


@triton.jit
def score_bwd(qk, dz, scale, n, b, TRANSFORM: tl.constexpr):
    """``dz`` = dL/dz (natural domain) -> dL/dqk (multiply by k for dq, by q for dk)."""
    if TRANSFORM == 1:
        s = qk * scale
        dqk = dz * (n * b * scale / (1.0 + b * tl.abs(s)))
    else:
        dqk = dz * scale
    return dqk


@triton.jit
def score_bwd_params(qk, dz, scale, n, b):
    """SSA only: elementwise contributions ``(dL/dn, dL/db)`` of one tile (sum them).

    ``dn = dz * sgn(s) * ln(1 + b|s|)``; ``db = dz * n * s / (1 + b|s|)`` -- the sign
    belongs in db (seed 000: dropping it trained silently wrong).
    """
    s = qk * scale
    a = tl.abs(s)
    mag = tl.log2(1.0 + b * a) * 0.6931471805599453  # ln(1 + b|s|)
    dn = dz * tl.where(s >= 0.0, mag, -mag)
    db = dz * (n * s / (1.0 + b * a))
    return dn, db
