"""Squared-ReLU MLP with the activation fused into two GEMM epilogues (seed 003's design).

``mlp_relu2(x [..., K], w1 [N, K], w2 [H, N]) -> y [..., H]`` equals
``naive.mlp_relu2_naive`` (``relu(x w1^T)^2 w2^T``, no bias, no gate). Only two pieces
are Triton kernels; the other three GEMMs stay cuBLAS (``torch.mm``):

forward
  ``relu2_fwd_kernel``: ``u = x w1^T`` (fp32 accumulation), epilogue ``a = relu(u)^2``
  written once in the input dtype. ``u`` and ``relu(u)`` never reach memory.
  ``y = a w2^T`` by torch.
backward
  ``relu2_bwd_kernel_du``: ``dA = dy w2`` (fp32 accumulation), epilogue
  ``dU = dA * 2 sqrt(a)`` -- ``dA`` never reaches memory. ``dw2 = dy^T a``,
  ``dw1 = dU^T x``, ``dx = dU w1`` by torch.

What is saved for the backward: ``x``, the weights and ``a`` -- nothing the unfused MLP
does not already keep (``a`` is the down-projection's input, needed for ``dw2``). The
activation gradient ``2 relu(u)`` is recomputed in the epilogue as ``2 sqrt(a)``: for
``a = relu(u)^2`` that is exact up to rounding, branch-free (``sqrt(0) = 0`` is the relu
mask), and more accurate than a stored bf16 ``relu(u)`` (sqrt halves the relative
rounding error of ``a``: ~2^-10 against bf16's 2^-9). Storing ``relu(u)`` as a second
output would cost one more ``[tokens, N]`` write per layer (201 MB at 32k tokens, N 3072)
for no gain; the seed stored its leaky-ReLU gradient because leaky ReLU's square cannot
be inverted without a sign bit.

Surgical fusion (seed 003: one opaque autograd.Function around the MLP cost 2.7x under
torch.compile): both kernels are ``torch.library.custom_op`` ops with fake
implementations and the autograd.Function calls only them and ``torch.mm``, so
``torch.compile`` traces through it without a graph break and keeps fusing around it.

Layouts and limits: ``x`` may be any view whose last dim has unit stride (megatron's
``[s, b, h]`` is reshaped to ``[s*b, h]``; a view that cannot be flattened is copied);
any number of rows (masked by wrapping the row index, stores masked); ``K`` and ``N``
must be multiples of 16 (tiles are shrunk to divisors of ``K`` and ``N``, so no column
masks); bf16 / fp16 on CUDA take the Triton path (fp16 also on CPU under
``TRITON_INTERPRET=1``, for tests), everything else the torch reference (the CPU loop). Deterministic: no atomics, each output tile
is written by one program.

Tiles: ``DEFAULT_TILES`` or ``NEMO_SSA_MLP_TILES="fwd=128x256x64/3/8,bwd=128x128x64/4/4"``
(``BMxBNxBK/stages/warps``); ``benchmarks/bench_mlp.py --tiles`` measures candidates.
Fixed tiles rather than autotuning: a run pays every autotune at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.launch import cdiv, is_interpreter, launch_kw
from nemo_ssa.ops.common.target import backend
from nemo_ssa.ops.mlp.naive import mlp_relu2_naive


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _tile_pids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering (Triton tutorial 03): GROUP_M row tiles share their B columns in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = N // BLOCK_N
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _mm_tile(a_ptr, b_ptr, M, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``A[rows, :] @ B[:, cols]`` for one output tile. K % BLOCK_K == 0 (host shrinks
    BLOCK_K to a divisor); rows wrap modulo M so every load is in bounds without a mask."""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc  # [BLOCK_M, BLOCK_N] fp32


@triton.jit
def relu2_fwd_kernel(x_ptr, w1_ptr, a_ptr, M, N, K,
                     stride_xm, stride_xk, stride_w1n, stride_w1k, stride_am, stride_an,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """a = relu(x @ w1^T)^2; w1 [N, K] is read as the [K, N] operand through its strides."""
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    u = _mm_tile(x_ptr, w1_ptr, M, K, stride_xm, stride_xk, stride_w1k, stride_w1n, pid_m, pid_n,
                 BLOCK_M, BLOCK_N, BLOCK_K)
    r = tl.maximum(u, 0.0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :] * stride_an
    tl.store(a_ptrs, (r * r).to(a_ptr.dtype.element_ty), mask=rows[:, None] < M)


@triton.jit
def relu2_bwd_kernel_du(dy_ptr, w2_ptr, a_ptr, du_ptr, M, N, K,
                        stride_dym, stride_dyk, stride_w2k, stride_w2n, stride_am, stride_an,
                        stride_dum, stride_dun,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """dU = (dy @ w2) * 2 sqrt(a); K here is the hidden size H (w2 is [H, N])."""
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    da = _mm_tile(dy_ptr, w2_ptr, M, K, stride_dym, stride_dyk, stride_w2k, stride_w2n, pid_m, pid_n,
                  BLOCK_M, BLOCK_N, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows[:, None] < M
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :] * stride_an, mask=mask, other=0.0)
    du = da * (2.0 * tl.sqrt(a.to(tl.float32)))  # 2 relu(u) = 2 sqrt(relu(u)^2)
    du_ptrs = du_ptr + rows[:, None].to(tl.int64) * stride_dum + cols[None, :] * stride_dun
    tl.store(du_ptrs, du.to(du_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------- host launchers
@dataclass(frozen=True)
class Tile:
    """A GEMM tile: block sizes, grouped-ordering width, pipeline stages and warps."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    group_m: int = 8
    stages: int = 4
    warps: int = 4

    def as_list(self) -> list:
        return [self.bm, self.bn, self.bk, self.group_m, self.stages, self.warps]

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}/{self.stages}/{self.warps}"

    @staticmethod
    def parse(text: str) -> "Tile":
        """``BMxBNxBK/stages/warps`` (group_m 8)."""
        try:
            blocks, stages, warps = text.strip().split("/")
            bm, bn, bk = (int(v) for v in blocks.split("x"))
            return Tile(bm, bn, bk, 8, int(stages), int(warps))
        except ValueError as e:
            raise ValueError(f"tile {text!r}: expected BMxBNxBK/stages/warps, e.g. 128x128x64/4/4") from e


#: the fastest of benchmarks/bench_mlp.py --tiles at 32,768 tokens (timings in docs/results)
DEFAULT_TILES: Dict[str, Tile] = {"fwd": Tile(128, 128, 64, 8, 3, 4), "bwd": Tile(128, 256, 32, 8, 4, 8)}


def tiles() -> Dict[str, Tile]:
    """The tiles in use: DEFAULT_TILES overridden by ``NEMO_SSA_MLP_TILES``."""
    out = dict(DEFAULT_TILES)
    spec = env.mlp_tiles()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in out:
            raise ValueError(f"NEMO_SSA_MLP_TILES: {key!r}; supported keys: fwd, bwd")
        out[key] = Tile.parse(value)
    return out


def _fit(block: int, n: int) -> int:
    """Largest power of two <= block that divides n (n is a multiple of 16)."""
    b = 1 << (max(int(block), 16).bit_length() - 1)
    while b > 16 and n % b:
        b //= 2
    return b


def _empty(shape: Sequence[int], like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fwd(x2d: Tensor, w1: Tensor, tile: Sequence[int]) -> Tensor:
    bm, bn, bk, group_m, stages, warps = (int(v) for v in tile)
    M, K = x2d.shape
    N = w1.shape[0]
    a = _empty((M, N), x2d)
    if M == 0:
        return a
    bn, bk = _fit(bn, N), _fit(bk, K)
    sx, sw, sa = x2d.stride(), w1.stride(), a.stride()
    # by name through launch_kw's cached path: on the host-bound micro batch 8 step,
    # JITFunction.run's per-call binding is most of a launch's host time (ops/common/launch.py)
    launch_kw(relu2_fwd_kernel, (cdiv(M, bm) * (N // bn),), {"x_ptr": x2d, "w1_ptr": w1, "a_ptr": a},
              {"M": M, "N": N, "K": K, "stride_xm": sx[0], "stride_xk": sx[1], "stride_w1n": sw[0],
               "stride_w1k": sw[1], "stride_am": sa[0], "stride_an": sa[1]},
              {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_stages": stages,
               "num_warps": warps})
    return a


def _launch_bwd_du(dy2d: Tensor, w2: Tensor, a: Tensor, tile: Sequence[int]) -> Tensor:
    bm, bn, bk, group_m, stages, warps = (int(v) for v in tile)
    M, H = dy2d.shape
    N = w2.shape[1]
    du = _empty((M, N), a)
    if M == 0:
        return du
    bn, bk = _fit(bn, N), _fit(bk, H)
    sdy, sw, sa, sdu = dy2d.stride(), w2.stride(), a.stride(), du.stride()
    launch_kw(relu2_bwd_kernel_du, (cdiv(M, bm) * (N // bn),),
              {"dy_ptr": dy2d, "w2_ptr": w2, "a_ptr": a, "du_ptr": du},
              {"M": M, "N": N, "K": H, "stride_dym": sdy[0], "stride_dyk": sdy[1], "stride_w2k": sw[0],
               "stride_w2n": sw[1], "stride_am": sa[0], "stride_an": sa[1], "stride_dum": sdu[0],
               "stride_dun": sdu[1]},
              {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_stages": stages,
               "num_warps": warps})
    return du


# Both kernels are torch.library custom ops with fake (shape) implementations, so dynamo
# traces an autograd.Function calling them without a graph break and inductor schedules
# them as extern kernels between its own fused code. (``triton_op`` would let inductor
# inline the launches, but its fake tracing calls the kernel itself under
# TRITON_INTERPRET=1, so it could not be tested on CPU; custom_op behaves the same on both.)
@torch.library.custom_op("nemo_ssa::mlp_relu2_fwd", mutates_args=())
def _fwd_call(x2d: Tensor, w1: Tensor, tile: List[int]) -> Tensor:
    return _launch_fwd(x2d, w1, tile)


@_fwd_call.register_fake
def _(x2d: Tensor, w1: Tensor, tile: List[int]) -> Tensor:
    return x2d.new_empty((x2d.shape[0], w1.shape[0]))


@torch.library.custom_op("nemo_ssa::mlp_relu2_bwd_du", mutates_args=())
def _bwd_du_call(dy2d: Tensor, w2: Tensor, a: Tensor, tile: List[int]) -> Tensor:
    return _launch_bwd_du(dy2d, w2, a, tile)


@_bwd_du_call.register_fake
def _(dy2d: Tensor, w2: Tensor, a: Tensor, tile: List[int]) -> Tensor:
    return a.new_empty((dy2d.shape[0], w2.shape[1]))


def relu2_fwd(x2d: Tensor, w1: Tensor, tile: Tile) -> Tensor:
    """``relu(x2d w1^T)^2`` by the Triton kernel (no autograd; x2d [M, K], w1 [N, K])."""
    return _fwd_call(x2d, w1, tile.as_list())


def relu2_bwd_du(dy2d: Tensor, w2: Tensor, a: Tensor, tile: Tile) -> Tensor:
    """``(dy2d w2) * 2 sqrt(a)`` by the Triton kernel (no autograd; dy2d [M, H], w2 [H, N])."""
    return _bwd_du_call(dy2d, w2, a, tile.as_list())


# ------------------------------------------------------------------------ autograd
# Eager calls go straight to the launchers; under torch.compile (``via_ops``) the same
# launchers are reached through the custom ops (no graph break). The custom-op dispatch costs
# host time on every eager call (as for the layer norm, ops/norm/fused.py).
class _MLPReLU2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: Tensor, w1: Tensor, w2: Tensor, fwd_tile: List[int], bwd_tile: List[int],
                via_ops: bool) -> Tensor:
        a = (_fwd_call if via_ops else _launch_fwd)(x2d, w1, fwd_tile)  # [M, N]
        y = torch.mm(a, w2.t())  # [M, H], cuBLAS
        ctx.save_for_backward(x2d, w1, w2, a)
        ctx.bwd_tile, ctx.via_ops = bwd_tile, via_ops
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2d, w1, w2, a = ctx.saved_tensors
        dy = _unit_last(dy)
        dx = dw1 = dw2 = None
        if ctx.needs_input_grad[2]:
            dw2 = torch.mm(dy.t(), a)  # [H, N]
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            du = (_bwd_du_call if ctx.via_ops else _launch_bwd_du)(dy, w2, a, ctx.bwd_tile)  # [M, N]; dA never stored
            if ctx.needs_input_grad[1]:
                dw1 = torch.mm(du.t(), x2d)  # [N, K]
            if ctx.needs_input_grad[0]:
                dx = torch.mm(du, w1)  # [M, K]
        return dx, dw1, dw2, None, None, None


# -------------------------------------------------------------------------- public
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def triton_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton path runs for ``dtype`` tensors on ``device``: bf16/fp16 on CUDA;
    fp16 on CPU under ``TRITON_INTERPRET=1`` (the interpreter's bf16 ``tl.dot`` is wrong:
    it stores bf16 as uint16, so bf16 is checked on the GPU, tests/ops/mlp/test_mlp_gpu.py)."""
    kind = backend(device)
    if kind in ("cuda", "rocm"):
        return dtype in SUPPORTED_DTYPES
    return kind == "interpreter" and dtype == torch.float16


kernels_interpreted = is_interpreter  # this family's name for the one interpreter check


def check_shapes(x: Tensor, w1: Tensor, w2: Tensor) -> Tuple[int, int, int]:
    """``(K, N, H)`` or ValueError naming what is supported."""
    if w1.dim() != 2 or w2.dim() != 2 or x.dim() < 1:
        raise ValueError(f"mlp_relu2: expected x [..., K], w1 [N, K], w2 [H, N]; got x {tuple(x.shape)}, "
                         f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    N, K = w1.shape
    H = w2.shape[0]
    if x.shape[-1] != K or w2.shape[1] != N:
        raise ValueError(f"mlp_relu2: shapes do not chain: x {tuple(x.shape)}, w1 {tuple(w1.shape)} ([N, K]), "
                         f"w2 {tuple(w2.shape)} ([H, N])")
    if K % 16 or N % 16 or H % 16:
        raise ValueError(f"mlp_relu2: K={K}, N={N}, H={H} must be multiples of 16 (supported: hidden and ffn "
                         "sizes that are multiples of 16, e.g. 768 / 3072)")
    if not (x.dtype == w1.dtype == w2.dtype):
        raise ValueError(f"mlp_relu2: x, w1, w2 must share one dtype; got {x.dtype}, {w1.dtype}, {w2.dtype}")
    return K, N, H


def mlp_relu2(x: Tensor, w1: Tensor, w2: Tensor, impl: str = "auto") -> Tensor:
    """``relu(x w1^T)^2 w2^T``: the up-projection with the activation in its epilogue, the
    down-projection's input gradient with the activation gradient in its epilogue.

    Args:
        x: ``[..., K]`` activations (e.g. megatron's ``[s, b, h]``); last dim unit stride
            or it is copied.
        w1: ``[N, K]`` up-projection weight (``linear_fc1.weight``).
        w2: ``[H, N]`` down-projection weight (``linear_fc2.weight``).
        impl: ``auto`` (Triton where ``triton_available``: bf16/fp16 on CUDA, fp16 in
            the CPU interpreter; else the torch reference), ``triton`` (refuse if it cannot run) or ``torch``.

    Returns:
        ``y [..., H]`` in the inputs' dtype.

    Raises:
        ValueError: shapes that do not chain, K/N/H not multiples of 16, mixed dtypes,
            an unknown ``impl``, or ``impl="triton"`` where it cannot run.
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"mlp_relu2: impl={impl!r}; supported: auto, triton, torch")
    K, N, H = check_shapes(x, w1, w2)
    use_triton = impl != "torch" and triton_available(x.device, x.dtype)
    if impl == "triton" and not use_triton:
        raise ValueError(f"mlp_relu2: impl='triton' needs bf16/fp16 tensors on CUDA (or fp16 on CPU under "
                         f"TRITON_INTERPRET=1); got {x.dtype} on {x.device}")
    if not use_triton:
        return mlp_relu2_naive(x, w1, w2)
    t = tiles()
    x2d = _unit_last(x.reshape(-1, K))  # a view for megatron's contiguous [s, b, h]
    y = _MLPReLU2.apply(x2d, _unit_last(w1), _unit_last(w2), t["fwd"].as_list(), t["bwd"].as_list(),
                         torch.compiler.is_compiling())
    return y.view(*x.shape[:-1], H)
