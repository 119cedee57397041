"""Host-side helpers shared by the NSA kernels: dtype/shape checks, block sizes, precision."""

from __future__ import annotations

import torch

from nemo_ssa.ops.common.launch import block_d, is_interpreter  # noqa: F401 (block_d: re-exported)
from nemo_ssa.ops.common.target import target, use_fast_math
from nemo_ssa.ops.common.validate import KERNEL_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM
from nemo_ssa.ops.common.transforms import log2_mode, transform_id



def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get true fp32 products (TF32 would cost ~1e-3 relative error);
    half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kernel_tensors(name_to_tensor) -> None:
    """Dtype/device checks every kernel launcher shares (raises ValueError)."""
    ref = next(iter(name_to_tensor.values()))
    for name, t in name_to_tensor.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"NSA Triton kernels support dtypes {[str(x).replace('torch.', '') for x in KERNEL_DTYPES]}, "
                f"`{name}` is {t.dtype} (use impl='torch' for float64)"
            )
        if t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(f"all inputs must share dtype and device; `{name}` is {t.dtype} on {t.device}")
    if not target(ref.device).runs_kernels:
        raise ValueError(
            "NSA Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 on CPU); "
            "use impl='torch' for the CPU reference path"
        )
    d = ref.shape[-1]
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
        raise ValueError(f"head dim {d} not supported by the NSA kernels (supported: {MIN_HEAD_DIM}..{MAX_HEAD_DIM})")


def ssa_scalars(transform: str, n, b, device):
    """(TRANSFORM id, n tensor, b tensor) as fp32 [1] tensors the kernels read by pointer."""
    tid = transform_id(transform)
    if tid == 1:
        if n is None or b is None:
            raise ValueError("transform='ssa' needs the SSA parameters n and b (tensors of shape [1])")
        return tid, n.detach().reshape(1).to(device=device, dtype=torch.float32).contiguous(), \
            b.detach().reshape(1).to(device=device, dtype=torch.float32).contiguous()
    if n is not None or b is not None:
        raise ValueError(f"transform={transform!r} takes no n/b: they are SSA parameters, supported only with "
                         f"transform='ssa'")
    dummy = torch.zeros(1, device=device, dtype=torch.float32)
    return tid, dummy, dummy


def fast_log2(tid: int, device: torch.device) -> int:
    """The kernels' ``FAST_LOG2`` constexpr: for SSA the dense kernels' default (PTX
    ``lg2.approx`` on CUDA, ``transforms.log2_mode``), 0 for softmax (no log2) and in the
    interpreter. Every kernel that recomputes a branch's scores from its ``lse`` (the
    backward, the selection) must take the mode its forward took: all derive it here."""
    return log2_mode(use_fast_math(device)) if tid == 1 else 0


def row_delta(o: torch.Tensor, do: torch.Tensor, zero: torch.Tensor = None) -> torch.Tensor:
    """The backward's ``delta = rowsum(o * do)``, fp32 ``[B, H, N]``, for ``o, do [B, H, N, D]``.

    One pass over ``o`` and ``do`` (the dense backward's ``attn_bwd_preprocess``): torch's
    ``(o.float() * do.float()).sum(-1)`` writes and rereads three fp32 copies, ~7.5 GB of
    traffic per NSA branch at N=64K Hq64 D64 against 1.1 GB. ``zero``: an fp32 accumulator
    shaped like ``o`` that the same launch zeroes (no separate memset).
    """
    from nemo_ssa.ops.common.bwd_kernels import attn_bwd_preprocess

    bsz, h, n, d = o.shape
    delta = torch.empty(bsz, h, n, device=o.device, dtype=torch.float32)
    if n == 0 or bsz * h == 0:
        return delta
    bd = block_d(d)
    bm = 16 if is_interpreter() else max(16, min(128, 8192 // bd))
    meta = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, VARLEN=False)
    if zero is not None:
        meta["ZERO_DQ"] = True
    acc = zero if zero is not None else delta
    az = zero.stride() if zero is not None else (0, 0, 0, 0)
    attn_bwd_preprocess[(-(-n // bm), bsz * h)](
        o, do, delta, delta, acc, *o.stride(), *do.stride(), *delta.stride(), *az, h, n, **meta)
    return delta
