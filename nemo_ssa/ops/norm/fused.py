"""LayerNorm with zero-centred gamma as two Triton kernels (forward; backward with the
weight and bias gradients reduced without atomics).

``layer_norm_1p(x [..., N], weight [N], bias [N], eps, zero_centred)`` equals
``naive.layer_norm_1p_naive``: ``(x - mean) / sqrt(var + eps) * g + bias`` with
``g = 1 + weight`` (zero-centred, nemotron's ``layernorm_zero_centered_gamma``) or
``g = weight``. Statistics and the scale are fp32 in registers (eager torch rounds
``1 + weight`` to the weight's dtype first).

forward (``layernorm_fwd_kernel``)
  one program per ``BLOCK_M`` rows: mean, then the centred variance (two passes over the
  row in registers, no Welford), ``y`` written once; ``mean`` and ``rstd`` (fp32, 8 bytes
  a row) kept for the backward.
backward (``layernorm_bwd_kernel``)
  a fixed number of programs, each walking its share of the row tiles:
  ``dx = rstd * (g dy - xhat * mean(xhat g dy) - mean(g dy))`` per row, and the
  per-program column sums of ``dy * xhat`` and ``dy`` in fp32 registers, written once as
  ``[programs, N]`` partials that torch sums (fixed order: deterministic). torch's own
  LayerNorm backward spends most of its time in that column reduction
  (``GammaBetaBackwardCUDAKernel``), which is why the pair exists.

Layouts and limits: ``x`` any view whose last dim has unit stride (megatron's ``[s, b, h]``
flattens to ``[s*b, h]``, a view); ``N <= MAX_N``; bf16 / fp16 / fp32 on CUDA, and every
dtype on CPU under ``TRITON_INTERPRET=1`` (tests). Deterministic for a given device: the
backward's program count is a function of the SM count only.

Both kernels are ``torch.library.custom_op`` ops with fake implementations, so
``torch.compile`` traces the autograd.Function without a graph break (as the fused MLP).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from nemo_ssa.ops.common.launch import cdiv, launch_kw, next_pow2
from nemo_ssa.ops.common.target import backend, target
from nemo_ssa.ops.norm.naive import layer_norm_1p_naive

#: the widest row one program holds in registers (a power of two); wider rows take torch
MAX_N = 16384
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def layernorm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, stride_xm, stride_ym, eps,
                         ZERO_CENTRED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = (x - mean) * rstd * g + b for BLOCK_M rows; mean, rstd stored (fp32)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        g = g + 1.0
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * g[None, :] + b[None, :]
    tl.store(y_ptr + r64 * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def layernorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
                         M, N, stride_dym, stride_xm, stride_dxm,
                         ZERO_CENTRED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx for this program's row tiles (pid, pid + programs, ...) and its column partials
    of dw = sum(dy * xhat), db = sum(dy) at row ``pid`` of ``[programs, N]``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        g = g + 1.0
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), programs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows[:, None].to(tl.int64)
        x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        gdy = dy * g[None, :]
        c1 = tl.sum(xhat * gdy, axis=1) / N
        c2 = tl.sum(gdy, axis=1) / N
        dx = (gdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + r64 * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


# ------------------------------------------------------------------------------- tiles
def tile(n: int, device: torch.device) -> List[int]:
    """``[BLOCK_M, BLOCK_N, warps, backward programs]`` for rows of ``n`` elements.

    BLOCK_N: the row rounded up to a power of two (one row per program row, no loop over
    columns). BLOCK_M: rows per tile so a tile holds ~4k elements (enough bytes in flight
    per program for a bandwidth-bound op, few enough registers for 4-8 warps). Backward
    programs: 4 per SM, so the ``[programs, N]`` partials stay a few MB and every SM walks
    tiles (on CPU, 4: the interpreter runs programs one after another)."""
    block_n = next_pow2(max(int(n), 1))
    block_m = max(1, min(16, 4096 // block_n))
    warps = 4 if block_m * block_n <= 4096 else 8
    sms = target(device).sms
    return [block_m, block_n, warps, 4 * sms if sms else 4]


# ----------------------------------------------------------------------- host launchers
def _empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer the kernels fill (the tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_fwd(x2d: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centred: bool,
                t: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    block_m, block_n, warps, _ = t
    M, N = x2d.shape
    y = _empty((M, N), x2d.dtype, x2d.device)
    mean = _empty((M,), torch.float32, x2d.device)
    rstd = _empty((M,), torch.float32, x2d.device)
    if M:
        # the cached launch: JITFunction.run's binder costs more host time than the kernel
        # takes at the recipe's shape, and the model calls 25 norms forward and backward
        launch_kw(layernorm_fwd_kernel, (cdiv(M, block_m),),
                  dict(x_ptr=x2d, w_ptr=weight, b_ptr=bias, y_ptr=y, mean_ptr=mean, rstd_ptr=rstd),
                  dict(M=M, N=N, stride_xm=x2d.stride(0), stride_ym=y.stride(0), eps=eps),
                  dict(ZERO_CENTRED=zero_centred, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
    return y, mean, rstd


def _launch_bwd(dy2d: Tensor, x2d: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, zero_centred: bool,
                t: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    block_m, block_n, warps, programs = t
    M, N = x2d.shape
    dx = _empty((M, N), x2d.dtype, x2d.device)
    if M == 0:
        zero = torch.zeros_like(weight)
        return dx, zero, zero.clone()
    programs = max(1, min(int(programs), cdiv(M, block_m)))
    part = _empty((2, programs, N), torch.float32, x2d.device)  # dw, db partials: one sum, one cast
    launch_kw(layernorm_bwd_kernel, (programs,),
              dict(dy_ptr=dy2d, x_ptr=x2d, w_ptr=weight, mean_ptr=mean, rstd_ptr=rstd, dx_ptr=dx,
                   dw_part_ptr=part[0], db_part_ptr=part[1]),
              dict(M=M, N=N, stride_dym=dy2d.stride(0), stride_xm=x2d.stride(0), stride_dxm=dx.stride(0)),
              dict(ZERO_CENTRED=zero_centred, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
    dw, db = part.sum(1).to(weight.dtype).unbind(0)
    return dx, dw, db


@torch.library.custom_op("nemo_ssa::layernorm_fwd", mutates_args=())
def _fwd_call(x2d: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centred: bool,
              t: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    return _launch_fwd(x2d, weight, bias, eps, zero_centred, t)


@_fwd_call.register_fake
def _(x2d, weight, bias, eps, zero_centred, t):
    m = x2d.shape[0]
    return (x2d.new_empty(x2d.shape), x2d.new_empty((m,), dtype=torch.float32),
            x2d.new_empty((m,), dtype=torch.float32))


@torch.library.custom_op("nemo_ssa::layernorm_bwd", mutates_args=())
def _bwd_call(dy2d: Tensor, x2d: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, zero_centred: bool,
              t: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _launch_bwd(dy2d, x2d, weight, mean, rstd, zero_centred, t)
    return dx, dw.clone(), db  # dw, db are rows of one tensor; a custom op's outputs may not alias


@_bwd_call.register_fake
def _(dy2d, x2d, weight, mean, rstd, zero_centred, t):
    return x2d.new_empty(x2d.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# Eager calls go straight to the launchers; under torch.compile (``via_ops``) the same
# launchers are reached through the custom ops (no graph break). The custom-op dispatch costs
# host time on every eager call, and the host-bound micro batch 8 step pays it 50 times (as
# the attention's eager Function, ops/attention/flash.py).
class _LayerNorm1P(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centred: bool,
                t: List[int], via_ops: bool) -> Tensor:
        y, mean, rstd = (_fwd_call if via_ops else _launch_fwd)(x2d, weight, bias, eps, zero_centred, t)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.zero_centred, ctx.t, ctx.via_ops = zero_centred, t, via_ops
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = (_bwd_call if ctx.via_ops else _launch_bwd)(_unit_last(dy), x2d, weight, mean, rstd,
                                                                 ctx.zero_centred, ctx.t)
        return dx, dw, db, None, None, None, None


# ------------------------------------------------------------------------------ public
def unsupported_reason(n: int, dtype: torch.dtype) -> str | None:
    """Why rows of ``n`` elements of ``dtype`` cannot take the Triton path (None: they can)."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (supported: bf16, fp16, fp32)"
    if not 1 <= int(n) <= MAX_N:
        return f"hidden size {n} (supported: 1..{MAX_N})"
    return None


def triton_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run for ``dtype`` tensors on ``device``: CUDA (bf16/fp16/fp32),
    or CPU under ``TRITON_INTERPRET=1``."""
    kind = backend(device)
    return (kind == "cuda" and dtype in SUPPORTED_DTYPES) or kind == "interpreter"


def layer_norm_1p(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5, zero_centred: bool = True,
                  impl: str = "auto", tiles: List[int] | None = None) -> Tensor:
    """LayerNorm over the last dim with scale ``1 + weight`` (``zero_centred``) or ``weight``.

    Args:
        x: ``[..., N]`` activations; last dim unit stride or it is copied.
        weight, bias: ``[N]``.
        impl: ``auto`` (Triton where ``triton_available`` and ``unsupported_reason`` is
            None, else the torch reference), ``triton`` (ValueError where it cannot run),
            ``torch`` (``naive.layer_norm_1p_naive``).
        tiles: ``tile()``'s answer overridden (benchmarks compare candidates).

    Returns:
        ``y`` with x's shape and dtype.

    Raises:
        ValueError: mismatched shapes, an unknown ``impl``, or ``impl="triton"`` where the
            kernels cannot run (the message names what is supported).
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"layer_norm_1p: impl={impl!r}; supported: auto, triton, torch")
    n = x.shape[-1] if x.dim() else 0
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"layer_norm_1p: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must be "
                         f"[{n}] for x {tuple(x.shape)}")
    reason = unsupported_reason(n, x.dtype)
    use_triton = impl != "torch" and reason is None and triton_available(x.device, x.dtype)
    if impl == "triton" and not use_triton:
        raise ValueError(f"layer_norm_1p: impl='triton' cannot run here ({reason or f'{x.dtype} on {x.device}'}); "
                         "supported: bf16/fp16/fp32 on CUDA (any dtype on CPU under TRITON_INTERPRET=1), "
                         f"hidden sizes 1..{MAX_N}")
    if not use_triton:
        return layer_norm_1p_naive(x, weight, bias, eps, zero_centred)
    t = list(tiles) if tiles is not None else tile(n, x.device)
    x2d = _unit_last(x.reshape(-1, n))
    y = _LayerNorm1P.apply(x2d, weight, bias, float(eps), bool(zero_centred), t, torch.compiler.is_compiling())
    return y.view(x.shape)
