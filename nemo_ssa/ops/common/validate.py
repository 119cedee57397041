"""One argument check for every attention op, driven by what each op supports.

Each op declares a :class:`Capabilities` (dtypes, head dims, dropout, ``keep_mask``,
packed varlen input, Triton kernels or plain torch, grid limit) and calls
:func:`validate_attention_args` before doing any work, so the reference, the fused
kernels, FlexAttention, ELSA and NSA can never disagree about what is legal: the same
bad input gets the same exception type from every op, with a message that names what
that op supports.

Exception types (each also a ``ValueError``, so existing ``except ValueError`` callers,
the fuzzer's "refused" rule and the registry's conventions keep working):

* :class:`ArgumentTypeError` (``TypeError``): an argument of the wrong Python type (a
  non-tensor ``q``, a Python float ``n``, ``softmax_scale=True``, a string
  ``dropout_p``);
* :class:`UnsupportedError` (``NotImplementedError``): a well-formed input this op does
  not implement (another op may: fp64 on a Triton kernel, ``keep_mask`` on ELSA, head
  dim 8, dropout on FlexAttention);
* plain ``ValueError``: malformed input no op accepts (shape mismatches, GQA ratio,
  ``dropout_p`` outside ``[0, 1)``, ``softmax_scale <= 0``).

Rules decided here, where the ops used to disagree:

* ``softmax_scale``: ``None`` or a Python real number, finite and ``> 0``. A ``bool``
  is refused everywhere (``True`` is an ``int``, and the fused op used to run it as a
  scale of 1.0 while the reference refused it). The Triton transforms take
  ``sgn(s) = sgn(q . k)``, so a negative scale is refused by all ops, not only some.
* ``n``, ``b`` (SSA): tensors of shape ``[1]`` or 0-d, floating, **on q's device**.
  The reference used to also accept a 0-d CPU tensor next to CUDA ``q`` while the
  kernels refused it. Refused everywhere now: the kernels read ``n``/``b`` by pointer
  on q's device, and moving them inside the op would hide a misplaced parameter behind
  a host-to-device copy on every call; a module's parameters move with the module.
  0-d tensors on q's device are accepted by every op.
* ``dropout_p``: a Python real number (not ``bool``, not a tensor, not a string) in
  ``[0, 1)``; ``> 0`` only where the op implements dropout.
* ``causal``: a ``bool`` (a string such as ``"no"`` used to be truthy and mean causal).
* Sizes: ``B, Hq, Hkv, Sq, Sk, D >= 1`` for every op (the reference used to return an
  empty result for ``B = 0``; the kernels refused it).
* The device: plain-torch ops run anywhere (``meta`` included); Triton ops need CUDA,
  or CPU when their kernels were built by the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from nemo_ssa.ops.common.target import backend

__all__ = [
    "check_deterministic",
    "ArgumentTypeError",
    "UnsupportedError",
    "Capabilities",
    "TRANSFORMS",
    "KERNEL_DTYPES",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
    "validate_attention_args",
    "check_ssa_param",
]

TRANSFORMS = ("ssa", "softmax")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: head dims every attention kernel family compiles for (flash, ELSA, NSA; the tile pads to
#: a power of two, ``launch.block_d``)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
GRID_LIMIT = 65535  # CUDA's limit on a launch grid's second dimension


class ArgumentTypeError(TypeError, ValueError):
    """An attention argument of the wrong Python type; catchable as TypeError or ValueError."""


class UnsupportedError(NotImplementedError, ValueError):
    """A well-formed input this op does not implement; catchable as NotImplementedError or
    ValueError. The message names what the op supports."""


@dataclass(frozen=True)
class Capabilities:
    """What one attention op accepts.

    Attributes:
        name: how messages name the op (``"ssa/triton"``, ``"ELSA"``, ...).
        dtypes: supported dtypes of q, k, v.
        head_dims: ``(min, max)`` supported head dim, inclusive; None = any ``D >= 1``.
        transforms: supported score transforms.
        dropout: implements ``dropout_p > 0``.
        keep_mask: implements a user boolean ``keep_mask``.
        varlen: takes packed ``[T, H, D]`` input with ``cu_seqlens`` (else ``[B, H, S, D]``).
        triton: runs Triton kernels (CUDA, or CPU under the interpreter); else plain torch
            on any device.
        grid_limit: ``B * Hq`` (``num_seqs * Hq`` for varlen) must stay within the CUDA
            grid limit.
    """

    name: str
    dtypes: Tuple[torch.dtype, ...] = _FLOAT_DTYPES
    head_dims: Optional[Tuple[int, int]] = None
    transforms: Tuple[str, ...] = TRANSFORMS
    dropout: bool = True
    keep_mask: bool = True
    varlen: bool = False
    triton: bool = False
    grid_limit: bool = False


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_deterministic(deterministic) -> None:
    """``deterministic=``: None (the backward's own choice) or a bool."""
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ArgumentTypeError(f"deterministic must be None or a bool; got {type(deterministic).__name__} "
                                f"{deterministic!r}")


def check_ssa_param(name: str, t, device: torch.device) -> None:
    """``n`` / ``b``: a floating tensor of shape ``[1]`` or 0-d on ``device``."""
    if t is None:
        raise ValueError(f"transform='ssa' needs `{name}` (a tensor of shape [1] or 0-d)")
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(
            f"`{name}` must be a torch.Tensor (shape [1] or 0-d) so it stays in the autograd "
            f"graph; got {type(t).__name__}")
    if t.numel() != 1 or t.dim() > 1:
        raise ValueError(f"`{name}` must have shape [1] or be 0-d, got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"`{name}` must be a floating tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device}, q on {device}; supported: `{name}` on q's device "
                         f"(0-d or [1])")


def _check_device(caps: Capabilities, device: torch.device) -> None:
    if not caps.triton:
        return
    kind = backend(device)
    if kind == "unsupported":
        raise UnsupportedError(
            f"{caps.name}: the Triton kernels were built for TRITON_INTERPRET=1; supported "
            f"devices in this process: cpu; got {device}")
    if kind == "cpu":
        raise UnsupportedError(
            f"{caps.name}: device {device} unsupported; supported devices: cuda (or cpu when "
            f"TRITON_INTERPRET=1 is set before nemo_ssa.ops is imported)")


def _check_cu_seqlens(q, hq, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, caps) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise ArgumentTypeError(f"`{name}` must be a 1-D int32/int64 tensor, got {type(cu).__name__}")
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"`{name}` must be a 1-D int32/int64 tensor, got {cu.dtype} of shape "
                             f"{tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"`{name}` is on {cu.device}, q on {q.device}; they must share a device")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 2:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have num_seqs + 1 >= 2 entries")
    if caps.grid_limit and (cu_seqlens_q.numel() - 1) * hq > GRID_LIMIT:
        raise UnsupportedError(f"{caps.name}: num_seqs * Hq = {(cu_seqlens_q.numel() - 1) * hq} exceeds the "
                               f"grid limit; supported: num_seqs * Hq <= {GRID_LIMIT}")
    if int(max_seqlen_q) <= 0 or int(max_seqlen_k) <= 0:
        raise ValueError(f"max_seqlen_q / max_seqlen_k must be positive ints, got {max_seqlen_q}, {max_seqlen_k}")


def validate_attention_args(
    caps: Capabilities,
    q,
    k,
    v,
    n=None,
    b=None,
    *,
    transform: str,
    causal,
    softmax_scale,
    dropout_p,
    keep_mask=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
) -> None:
    """Check one attention call against ``caps``; raise before any work is done.

    Args:
        caps: the op's :class:`Capabilities`.
        q, k, v: ``[B, Hq, Sq, D]`` / ``[B, Hkv, Sk, D]`` (``[T, H, D]`` when
            ``caps.varlen``), ``Hq % Hkv == 0``.
        n, b: SSA parameters (required for ``transform="ssa"``, refused otherwise).
        transform, causal, softmax_scale, dropout_p, keep_mask: as in ``attention_naive``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: packed input (varlen ops).

    Raises:
        ArgumentTypeError, UnsupportedError or ValueError (module docstring), the message
        naming what ``caps`` supports.
    """
    nd = 3 if caps.varlen else 4
    layout = "[T, H, D] (packed)" if caps.varlen else "[B, H, S, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"`{name}` must be {nd}-D {layout}, got shape {tuple(t.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in caps.dtypes:
        exc = UnsupportedError if q.dtype in _FLOAT_DTYPES else ValueError
        raise exc(f"{caps.name}: q, k, v have dtype {q.dtype}; supported dtypes: {_dtype_names(caps.dtypes)}")
    device = q.device  # (each .device builds a torch.device: asked once, validation runs on every call)
    if device != k.device or device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {device}, {k.device}, {v.device}")
    _check_device(caps, device)  # Triton ops: target.backend says where their kernels run
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    d, dk = q.shape[-1], k.shape[-1]
    hq, hkv = q.shape[1], k.shape[1]  # dim 1 is the heads in both layouts
    if d != dk:
        raise ValueError(f"head-dim mismatch: q has D={d}, k/v have D={dk}; q, k, v must share the head dim")
    if min(q.shape) == 0 or min(k.shape) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; every dim must be >= 1")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv}) for GQA")
    if caps.head_dims is not None and not (caps.head_dims[0] <= d <= caps.head_dims[1]):
        lo, hi = caps.head_dims
        raise UnsupportedError(f"{caps.name}: head dim D={d} unsupported; supported head dims: "
                               f"{lo} <= D <= {hi}")
    if not caps.varlen:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"batch mismatch: q has B={q.shape[0]}, k/v have B={k.shape[0]}; q, k, v must "
                             f"share the batch size")
        if caps.grid_limit and q.shape[0] * hq > GRID_LIMIT:
            raise UnsupportedError(f"{caps.name}: B * Hq = {q.shape[0] * hq} exceeds the grid limit; "
                                   f"supported: B * Hq <= {GRID_LIMIT}")
    if not isinstance(transform, str) or transform not in TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}; supported: one of {TRANSFORMS}")
    if transform not in caps.transforms:
        raise UnsupportedError(f"{caps.name}: transform={transform!r} unsupported; supported: {caps.transforms}")
    if transform == "ssa":
        check_ssa_param("n", n, device)
        check_ssa_param("b", b, device)
    elif n is not None or b is not None:
        raise ValueError(f"transform={transform!r} takes no `n`/`b`: they are SSA parameters, supported only "
                         f"with transform='ssa'")
    if not isinstance(causal, bool):
        raise ArgumentTypeError(f"causal must be a bool (True or False), got {type(causal).__name__}")
    if not _is_real(dropout_p):
        raise ArgumentTypeError(f"dropout_p must be a Python number in [0, 1), got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and not caps.dropout:
        raise UnsupportedError(f"{caps.name} has no dropout (dropout_p={dropout_p}); supported: "
                               f"dropout_p=0.0 (the reference and the fused Triton kernel implement dropout)")
    if softmax_scale is not None:
        if not _is_real(softmax_scale):
            raise ArgumentTypeError(f"softmax_scale must be None or a Python number > 0 (not a bool or a "
                                    f"tensor), got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be > 0 and finite, or None (supported: a Python number, "
                             f"softmax_scale > 0); got {softmax_scale!r}")
    if keep_mask is not None:
        if not caps.keep_mask:
            raise UnsupportedError(f"{caps.name} does not support keep_mask (supported masks: causal or none); "
                                   f"use attention_naive / softmax_attention_sdpa for arbitrary masks")
        if not isinstance(keep_mask, torch.Tensor):
            raise ArgumentTypeError(f"keep_mask must be a bool tensor (True = may attend), got "
                                    f"{type(keep_mask).__name__}")
        if keep_mask.dtype != torch.bool:
            raise ValueError(f"keep_mask must be a bool tensor (True = may attend), got {keep_mask.dtype}")
        target = (q.shape[0], hq, q.shape[2], k.shape[2])
        try:
            bshape = torch.broadcast_shapes(keep_mask.shape, target)
        except RuntimeError:
            bshape = None
        if bshape != torch.Size(target):
            raise ValueError(f"keep_mask of shape {tuple(keep_mask.shape)} is not broadcastable to "
                             f"[B, Hq, Sq, Sk] = {list(target)}; it must broadcast to that shape")
    if caps.varlen:
        _check_cu_seqlens(q, hq, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, caps)
