"""Host side of the attention kernels' Hopper path: tensor descriptors for the TMA.

On sm_90 and newer the tensor-memory accelerator copies whole tiles between global and
shared memory on its own; Triton issues it for loads and stores through a *tensor
descriptor* instead of a tensor of pointers. The kernels take that path where their
config says so (``FwdConfig.tma``, ``BwdConfig.tma_dq`` / ``tma_kv``: 1) and the inputs
allow it:

* dense ``[B, H, S, D]`` tensors (not packed THD), any batch/head/sequence strides as long
  as the last dimension is contiguous, each other stride is a multiple of 16 bytes and the
  data pointer is 16-byte aligned (the hardware's rules) -- Megatron's ``[s, b, h, d]``
  tensors permuted to ``[b, h, s, d]`` qualify as they are;
* a GPU of compute capability 9.0 or newer (or Triton's CPU interpreter, which emulates
  descriptors, so the CPU tests run this path).

``NEMO_SSA_TMA=0`` turns the path off everywhere (A/B runs). Elsewhere the same kernels
run with pointers (``use_tma`` is 0; a table row then falls back to the pointer kernels'
own measured tiles): the choice never
changes a result beyond the usual reassociation of a different tiling, and never fails.
The descriptor is rank 4 with a ``[1, 1, rows, BLOCK_D]`` box: rows past ``S`` and
columns past ``D`` read as 0 and are dropped on store, so no masks are needed.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.target import target

__all__ = ["MIN_SCORES", "tma_capable", "tma_ready", "use_tma", "descriptor", "wgmma_capable"]

#: Below this many scores per call (``B * Hq * Sq * Sk``) a config from the tile tables keeps
#: the pointer kernels: descriptors are built on the host and launched through Triton's
#: normal launcher (tens of microseconds per launch, where the cached pointer launch
#: costs a few), which a short call cannot hide. An explicit config is always honoured.
MIN_SCORES = 1 << 24

def tma_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use tensor descriptors (``target.Target.tma``)."""
    return target(device).tma


def wgmma_capable(device: torch.device) -> bool:
    """Hopper's warpgroup MMA, which the Gluon kernels (``ops.attention.hopper``,
    ``ops.common.hopper_bwd``) are built on (``target.Target.wgmma``: sm_90 exactly)."""
    return target(device).wgmma


def tma_ready(t: torch.Tensor) -> bool:
    """A 4-D tensor the TMA can address: last dim contiguous, other strides multiples of
    16 bytes, 16-byte aligned data pointer, a 16-bit or 32-bit float dtype."""
    if t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    return all((s * size) % 16 == 0 for s in t.stride()[:-1]) and all(n > 0 for n in t.shape)


def use_tma(mode: int, varlen: bool, *tensors: torch.Tensor, scores: Optional[int] = None) -> int:
    """The ``TMA`` constexpr for one launch: ``mode`` (from the config) where the layout
    and the device allow it, else 0 (pointers). ``scores`` (table configs only): the
    call's ``B * Hq * Sq * Sk``; fewer than ``MIN_SCORES`` keeps the pointers."""
    if not mode or varlen or (scores is not None and scores < MIN_SCORES) or not tma_capable(tensors[0].device):
        return 0
    if not env.tma():  # NEMO_SSA_TMA=0
        return 0
    return int(mode) if all(tma_ready(t) for t in tensors) else 0


def descriptor(t: torch.Tensor, rows: int, block_d: int):
    """Rank-4 descriptor of ``t`` ``[B, H, S, D]`` whose box is ``rows`` x ``block_d``
    (``block_d`` >= D, the padded head dim)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, int(rows), int(block_d)])
