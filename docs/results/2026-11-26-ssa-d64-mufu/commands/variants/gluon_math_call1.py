"""The score transform's elementwise pieces as Gluon functions, for the Hopper kernels
(``ops.attention.hopper``, ``ops.common.hopper_bwd``).

Each is the ``FAST_LOG2 = 1`` branch of its Triton twin in ``transforms`` -- the same PTX
instruction -- so a Gluon forward and a Triton backward (or the reverse) recompute
bit-identical ``z2`` and ``p``. Gluon has no interpreter: the Triton functions are the CPU
path and the reference.
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5; the package pins 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels run
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "rcp_asm", "ex2_asm"]

#: ``rcp_asm``'s seed: ``1/t ~ bits(0x7EF311C3 - bits(t))``, 5 % off; one cubic step
#: (``y += y (e + e^2)``, ``e = 1 - t y``) and one Newton step (``y += y e``) take it to 1.7e-8
#: relative (fp64 check over t in [1, 2] and [1, e^80]) -- MUFU ``rcp.approx``'s order.
_RCP_SEED = "0x7EF311C3"
#: ``ex2_asm``'s polynomial: 2^f on [-0.5, 0.5], degree 4, relative least squares on Chebyshev
#: nodes (fp32 coefficients; 2.7e-6 relative at most), highest degree first.
_EX2_POLY = ("0f3C1CA3B0", "0f3D650944", "0f3E76040C", "0f3F317071", "0f3F7FFFF2")


def rcp_asm(fma_lanes: int) -> str:
    """PTX for four reciprocals (``pack=4``: outputs ``$0..$3``, inputs ``$4..$7``) of
    ``t >= 1``: the last ``fma_lanes`` by Newton iteration on the FMA pipe from an integer seed
    (six instructions), the rest by MUFU ``rcp.approx.ftz``. Moving a share of SSA's
    backward reciprocals off the MUFU pipe, which it saturates at head dim 64 (three MUFU
    operations per score)."""
    if not 0 <= fma_lanes <= 4:
        raise ValueError(f"fma_lanes must be 0..4, got {fma_lanes}")
    lines = ["{", ".reg .f32 ry<4>, re<4>, rn<4>;", ".reg .b32 rb<4>, rc;", f"mov.b32 rc, {_RCP_SEED};"]
    for i in range(4):
        o, x = f"${i}", f"${i + 4}"
        if i < 4 - fma_lanes:
            lines.append(f"rcp.approx.ftz.f32 {o}, {x};")
            continue
        lines += [f"mov.b32 rb{i}, {x};", f"sub.s32 rb{i}, rc, rb{i};", f"mov.b32 ry{i}, rb{i};",
                  f"neg.ftz.f32 rn{i}, {x};",
                  f"fma.rn.ftz.f32 re{i}, rn{i}, ry{i}, 0f3F800000;",
                  f"fma.rn.ftz.f32 re{i}, re{i}, re{i}, re{i};",
                  f"fma.rn.ftz.f32 ry{i}, ry{i}, re{i}, ry{i};",
                  f"fma.rn.ftz.f32 re{i}, rn{i}, ry{i}, 0f3F800000;",
                  f"fma.rn.ftz.f32 {o}, ry{i}, re{i}, ry{i};"]
    return "\n".join(lines + ["}"])


def ex2_asm(fma_lanes: int) -> str:
    """PTX for four ``2^x`` (``pack=4``) of ``x <= 0``: the last ``fma_lanes`` on the FMA pipe
    (``x`` clamped at -125, split into ``round(x) + f`` by the 1.5 * 2^23 trick, a degree-4
    polynomial in ``f``, ``round(x)`` added to the exponent: nine instructions), the rest by
    MUFU ``ex2.approx.ftz`` -- FA4's split of the exponentials between the two pipes."""
    if not 0 <= fma_lanes <= 4:
        raise ValueError(f"fma_lanes must be 0..4, got {fma_lanes}")
    lines = ["{", ".reg .f32 xc<4>, xj<4>, xr<4>, xf<4>;", ".reg .b32 bj<4>, br<4>;"]
    c4, c3, c2, c1, c0 = _EX2_POLY
    for i in range(4):
        o, x = f"${i}", f"${i + 4}"
        if i < 4 - fma_lanes:
            lines.append(f"ex2.approx.ftz.f32 {o}, {x};")
            continue
        lines += [f"max.ftz.f32 xc{i}, {x}, 0fC2FA0000;",
                  f"add.rn.ftz.f32 xj{i}, xc{i}, 0f4B400000;",
                  f"sub.rn.ftz.f32 xr{i}, xj{i}, 0f4B400000;",
                  f"sub.rn.ftz.f32 xf{i}, xc{i}, xr{i};",
                  f"fma.rn.ftz.f32 xr{i}, xf{i}, {c4}, {c3};",
                  f"fma.rn.ftz.f32 xr{i}, xr{i}, xf{i}, {c2};",
                  f"fma.rn.ftz.f32 xr{i}, xr{i}, xf{i}, {c1};",
                  f"fma.rn.ftz.f32 xr{i}, xr{i}, xf{i}, {c0};",
                  f"mov.b32 bj{i}, xj{i};", f"mov.b32 br{i}, xr{i};",
                  f"mad.lo.s32 br{i}, bj{i}, 8388608, br{i};",
                  f"mov.b32 {o}, br{i};"]
    return "\n".join(lines + ["}"])


if HAVE_GLUON:
    __all__ += ["abs_fast", "lg2", "rcp", "flip_sign", "ssa_parts", "score", "rcp_mixed", "ex2_mixed"]

    _RCP_ASM_1 = gl.constexpr(rcp_asm(1))
    _RCP_ASM_2 = gl.constexpr(rcp_asm(2))
    _RCP_ASM_4 = gl.constexpr(rcp_asm(4))
    _EX2_ASM_1 = gl.constexpr(ex2_asm(1))
    _EX2_ASM_2 = gl.constexpr(ex2_asm(2))

    @gluon.jit
    def abs_fast(x):
        """``transforms.abs_fast`` (FAST): PTX ``abs.f32``, a free ``|x|`` operand of the FFMA."""
        return gl.inline_asm_elementwise("abs.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def lg2(x):
        """``transforms._log2_mufu`` (FAST): ``x = 1 + b|s| >= 1``, never subnormal."""
        return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def rcp(x):
        """``transforms.rcp_fast`` (FAST): one MUFU ``rcp.approx.ftz`` for ``x >= 1``."""
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def flip_sign(x, s):
        """``transforms.flip_sign`` (FAST): ``x`` with ``s``'s sign bit xor-ed in, one LOP3."""
        return gl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, 0x80000000, 0x78;", "=r,r,r",
            [x.to(gl.uint32, bitcast=True), s.to(gl.uint32, bitcast=True)],
            dtype=gl.uint32, is_pure=True, pack=1).to(gl.float32, bitcast=True)

    @gluon.jit
    def ssa_parts(qk, c0, c1):
        """``(z2, smag, t)`` of an SSA tile as ``transforms.score_bwd_parts`` computes them:
        ``t = 1 + b|s|``, ``smag = sgn(s) log2 t``, ``z2 = n smag``."""
        t = abs_fast(qk) * c0 + 1.0
        smag = flip_sign(lg2(t), qk)
        return c1 * smag, smag, t

    @gluon.jit
    def score(qk, c0, c1, TRANSFORM: gl.constexpr):
        """``z2`` exactly as ``transforms.score_fwd_hoisted`` with ``FAST_LOG2 = 1``."""
        if TRANSFORM == 1:
            z2 = c1 * flip_sign(lg2(abs_fast(qk) * c0 + 1.0), qk)
        else:
            z2 = qk * c0
        return z2

    @gluon.jit
    def rcp_mixed(x, FMA_LANES: gl.constexpr):
        """``1 / x`` for ``x >= 1``: ``FMA_LANES`` of every four by Newton iteration on the FMA
        pipe (``rcp_asm``), the rest by MUFU; ``FMA_LANES = 0`` is ``rcp``."""
        if FMA_LANES == 0:
            y = rcp(x)
        elif FMA_LANES == 1:
            y = gl.inline_asm_elementwise(_RCP_ASM_1, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32,
                                          is_pure=True, pack=4)
        elif FMA_LANES == 2:
            y = gl.inline_asm_elementwise(_RCP_ASM_2, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32,
                                          is_pure=True, pack=4)
        else:
            gl.static_assert(FMA_LANES == 4, "rcp_mixed: FMA_LANES must be 0, 1, 2 or 4")
            y = gl.inline_asm_elementwise(_RCP_ASM_4, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32,
                                          is_pure=True, pack=4)
        return y

    @gluon.jit
    def ex2_mixed(x, FMA_LANES: gl.constexpr):
        """``2^x`` for ``x <= 0`` (``-inf`` allowed only with ``FMA_LANES = 0``): ``FMA_LANES``
        of every four by a polynomial on the FMA pipe (``ex2_asm``), the rest by MUFU."""
        if FMA_LANES == 0:
            y = gl.exp2(x)
        elif FMA_LANES == 1:
            y = gl.inline_asm_elementwise(_EX2_ASM_1, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32,
                                          is_pure=True, pack=4)
        else:
            gl.static_assert(FMA_LANES == 2, "ex2_mixed: FMA_LANES must be 0, 1 or 2")
            y = gl.inline_asm_elementwise(_EX2_ASM_2, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32,
                                          is_pure=True, pack=4)
        return y
