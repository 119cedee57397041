"""Run megatron-core's CUDA-assuming code paths on a CPU-only machine.

megatron-core 0.15 trains a GPTModel on CPU except for a handful of hard-coded CUDA
placements: ``torch.cuda.current_device()`` in the DDP grad buffers and RoPE,
``torch.cuda.synchronize()`` in dist_checkpointing's save, ``torch.cuda.current_stream()`` in
0.19's grad buffer,
``device='cuda'`` in the optimizer's loss-scale and overflow buffers, ``.cuda()`` in
utilities. :func:`cpu_device_shims` redirects exactly those to the CPU for the duration
of a ``with`` block, through a ``TorchFunctionMode`` (which sees factory calls and
tensor methods) plus ``torch.cuda.current_device``. Nothing is patched outside the
block, and it refuses to run where CUDA exists (there the real path must be used).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts ``grad.type() == 'torch.cuda.FloatTensor'`` before clipping
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func in (torch.Tensor.to,):
            args = tuple("cpu" if _is_cuda(a) and not isinstance(a, torch.Tensor) and not isinstance(a, torch.dtype) and not isinstance(a, bool) else a for a in args)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            kwargs.pop("non_blocking", None)
            return func(*args, **kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _CpuStream:
    """The one 'stream' of a CPU: everything is already in order, every wait is a no-op."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


@contextlib.contextmanager
def cpu_device_shims():
    """Redirect megatron's hard-coded CUDA placements to the CPU inside the block."""
    if torch.cuda.is_available():
        raise RuntimeError("cpu_device_shims() is for CPU-only machines; use the CUDA path here")
    patches = {
        "current_device": lambda: torch.device("cpu"),
        "synchronize": lambda *a, **k: None,  # dist_checkpointing's D2H staging
        # megatron-core 0.19's grad buffer waits on the current stream before every reduction
        "current_stream": lambda *a, **k: _CPU_STREAM,
    }
    saved = {name: getattr(torch.cuda, name) for name in patches}
    for name, fn in patches.items():
        setattr(torch.cuda, name, fn)
    try:
        with _CudaToCpuMode():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
