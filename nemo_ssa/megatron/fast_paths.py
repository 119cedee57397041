"""Sync-free stand-ins for megatron-core's no-apex fallbacks, and a fused AdamW.

Without apex or Transformer Engine (the lent GPU image has neither) megatron-core 0.15.3
falls back to ``megatron.core.utils.local_multi_tensor_l2_norm`` and
``local_multi_tensor_scale``. The first turns every parameter's norm into a Python
number (``torch.tensor(list of 0-d CUDA tensors)``: one device sync per parameter, ~100
per step for the 114M model) before one more host-to-device copy; the second runs one
multiply and one copy per tensor. Profiled on an H100 (docs/training-step.md) they are
most of the NeMo step's ~116 host syncs.

:func:`install` replaces them, from the plugin (no edits to installed packages), in the
modules that bound them at import (``megatron.core.optimizer.clip_grads`` and
``megatron.core.optimizer.optimizer``) -- only where the bound function *is* megatron's
local fallback, so apex/TE kernels are never shadowed:

- ``l2_norm``: ``torch._foreach_norm`` over the list, the norm of the norms on the
  device, returned as megatron's ``[1]`` fp32 tensor; no host round trip. Megatron then
  reads the total once (``total_norm.item()``) for its Python clip coefficient: one sync
  per step instead of ~100.
- ``scale``: ``torch._foreach_mul_`` in place when source and destination are the same
  list (gradient clipping), ``torch._foreach_copy_`` for the scale-1 main->model
  parameter copy, ``_foreach_mul`` + ``_foreach_copy_`` otherwise.
- ``copy_this_to_that``: the main->model parameter copy of a bf16 run, which megatron does
  not send through ``scale`` (no overflow buffer for bf16) but copies tensor by tensor in
  Python: ~100 ``copy_`` dispatches per step, host time outside even a whole-iteration CUDA
  graph (the mb-8 profile of docs/results/2026-12-02-full-mb8-profile).

Same results as the originals (tests/megatron/test_fast_paths.py compares them on fp32
and bf16 lists, with inf/NaN gradients too). :func:`fused_adamw` is a context manager
under which megatron's optimizer factory builds ``torch.optim.AdamW(fused=True)`` (one
multi-tensor CUDA kernel per step instead of the foreach chain) when every parameter is
on CUDA; elsewhere it is torch's default.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List, Sequence

import torch

log = logging.getLogger(__name__)

_INSTALLED: List[str] = []


def l2_norm(chunk_size, noop_flag, tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` / megatron's local fallback, without syncs.

    Returns ``(norm [1] fp32, None)`` on the tensors' device (megatron's fallback returns
    it on ``cuda`` after a host round trip)."""
    tensors = [t for tl in tensor_lists for t in tl]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch._foreach_norm(tensors)
    dev = tensors[0].device
    # megatron's fallback takes the norm of the norms in fp32 (torch.tensor of Python floats);
    # the fp32 main gradients' norms already are, and a no-op ``.to`` per tensor is a dispatch each
    if not all(n.dtype == torch.float32 and n.device == dev for n in norms):
        norms = [n.to(device=dev, dtype=torch.float32) for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists: Sequence[Sequence[torch.Tensor]], scale_: float):
    """Drop-in for ``amp_C.multi_tensor_scale`` / megatron's local fallback: ``dst = src * scale``."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        if scale_ != 1.0:
            torch._foreach_mul_(dst, scale_)
        return
    if scale_ == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale_))


def copy_this_to_that(this: Sequence[torch.Tensor], that: Sequence[torch.Tensor], overflow_buf=None) -> None:
    """Drop-in for ``megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that``
    without an overflow buffer (every bf16 run: megatron sets none for bf16): one
    ``torch._foreach_copy_`` in place of a Python ``copy_`` per tensor, so the fp32 main
    parameters reach the bf16 model parameters in one call; with a buffer (fp16, apex's
    kernel) megatron's own function runs."""
    this, that = list(this), list(that)
    if overflow_buf is not None or len(this) != len(that):
        return _ORIGINAL_COPY[0](this, that, overflow_buf)
    if this:
        torch._foreach_copy_(that, this)


_ORIGINAL_COPY: List = []


def _install_param_copy() -> List[str]:
    """Bind :func:`copy_this_to_that` where megatron's loop is (and only that function)."""
    import megatron.core.optimizer.optimizer as mopt

    cur = getattr(mopt, "_multi_tensor_copy_this_to_that", None)
    if cur is copy_this_to_that:
        return ["megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that"]
    if cur is None or getattr(cur, "__module__", None) != mopt.__name__:
        return []
    import inspect

    if list(inspect.signature(cur).parameters) != ["this", "that", "overflow_buf"]:
        return []  # a megatron whose copy takes other arguments keeps its own
    _ORIGINAL_COPY[:] = [cur]
    mopt._multi_tensor_copy_this_to_that = copy_this_to_that
    return ["megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that"]


def install() -> List[str]:
    """Replace megatron's local (no-apex) multi-tensor fallbacks where they are bound.

    Idempotent; returns the replaced ``module.name`` entries (empty where apex/TE kernels
    are in use)."""
    import megatron.core.utils as mutils

    targets = {
        "megatron.core.optimizer.clip_grads": ("l2_norm_impl", "multi_tensor_scale_impl"),
        "megatron.core.optimizer.optimizer": ("multi_tensor_scale_impl",),
    }
    ours = {mutils.local_multi_tensor_l2_norm: l2_norm, mutils.local_multi_tensor_scale: scale}
    import importlib

    done = []
    for modname, names in targets.items():
        mod = importlib.import_module(modname)
        for name in names:
            cur = getattr(mod, name, None)
            if cur in ours:
                setattr(mod, name, ours[cur])
                done.append(f"{modname}.{name}")
            elif cur in (l2_norm, scale):
                done.append(f"{modname}.{name}")
    done += _install_param_copy()
    if done and not _INSTALLED:
        log.info("nemo_ssa fast paths installed: %s", ", ".join(done))
    _INSTALLED[:] = done
    return done


class _FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that asks for the fused kernel when every parameter is on CUDA."""

    def __init__(self, params, *args, **kwargs):
        params = list(params)
        flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        if "fused" not in kwargs and "foreach" not in kwargs and flat and \
                all(p.is_cuda and p.is_floating_point() for p in flat):
            kwargs["fused"] = True
        super().__init__(params, *args, **kwargs)


@contextlib.contextmanager
def fused_adamw(enabled: bool = True) -> Iterator[None]:
    """Inside this block ``torch.optim.AdamW`` builds the fused kernel (megatron-core
    0.15.3 without apex/TE constructs ``torch.optim.AdamW`` by attribute lookup)."""
    if not enabled:
        yield
        return
    orig = torch.optim.AdamW
    torch.optim.AdamW = _FusedAdamW  # type: ignore[misc]
    try:
        yield
    finally:
        torch.optim.AdamW = orig  # type: ignore[misc]
