"""The score transform's elementwise pieces as Gluon functions, for the Hopper kernels
(``ops.attention.hopper``, ``ops.common.hopper_bwd``).

Each is the ``FAST_LOG2 = 1`` branch of its Triton twin in ``transforms`` -- the same PTX
instruction -- so a Gluon forward and a Triton backward (or the reverse) recompute
bit-identical ``z2`` and ``p``. Gluon has no interpreter: the Triton functions are the CPU
path and the reference.
"""

from __future__ import annotations

import triton

#: the Triton the Gluon kernels were compiled, measured and tested on. Gluon is Triton's
#: experimental layer and its API moves between releases (3.5 has it too, with other
#: signatures): on any other Triton the plain Triton kernels run (NeMo FW 25.11's 3.5.1
#: included; docs/install.md)
GLUON_TRITON = (3, 6)


def triton_version(version: str = triton.__version__) -> tuple:
    """``(major, minor)`` of a Triton version string (``"3.6.0"``, ``"3.5.1+git..."``)."""
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2])


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAVE_GLUON = triton_version() == GLUON_TRITON
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels run
    HAVE_GLUON = False

__all__ = ["GLUON_TRITON", "HAVE_GLUON", "triton_version"]

if HAVE_GLUON:
    __all__ += ["abs_fast", "lg2", "rcp", "flip_sign", "ssa_parts", "score"]

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
