"""Poisoned memory: make a result that depends on memory it never wrote change visibly.

A kernel that reads past its input, or reads a scratch buffer it did not fill, returns
whatever the allocator last left there: right on one machine, wrong on the next, and
different from run to run (issue 47: compiled CPU FlexAttention read past K and gave
NaN or errors of ~1.6 on AVX2 machines only). These helpers put NaN where such reads
land, so the leak is a NaN or a bit difference on every machine:

* :func:`nan_surrounded` -- a copy of a tensor placed inside a NaN-filled storage
  (NaN before and after it): an over- or under-read of the input reads NaN;
* :func:`nan_heap` -- allocate NaN-filled blocks of many sizes and free them, so the
  next allocations of the caching (CUDA) or malloc (CPU) allocator start as NaN:
  scratch and output buffers a kernel forgets to write hold NaN;
* :func:`poisoned_runs` -- call a function under several global seeds, thread counts and
  poisoned heaps and return every result, for a bit-identity check.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Tuple

import torch

__all__ = ["nan_surrounded", "nan_heap", "poisoned_runs", "assert_bit_identical"]

# Block sizes for nan_heap: spread over malloc's small bins and below glibc's mmap
# threshold (128 KiB; larger blocks go back to the OS on free and come back zeroed).
_HEAP_BYTES = tuple(64 << i for i in range(12))  # 64 B .. 128 KiB


def nan_surrounded(t: torch.Tensor, pad: int = 4096) -> torch.Tensor:
    """A contiguous copy of ``t`` with ``pad`` NaN elements before and after it in its storage."""
    if not t.is_floating_point():
        raise ValueError(f"nan_surrounded needs a floating tensor, got {t.dtype}")
    buf = torch.full((pad + t.numel() + pad,), math.nan, dtype=t.dtype, device=t.device)
    out = buf[pad:pad + t.numel()].view(t.shape)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def nan_heap(device="cpu", dtype=torch.float32, copies: int = 4) -> None:
    """Fill the allocator's free blocks with NaN: allocate NaN tensors of many sizes, then free them."""
    item = torch.empty((), dtype=dtype).element_size()
    held = [torch.full((max(1, size // item),), math.nan, dtype=dtype, device=device)
            for size in _HEAP_BYTES for _ in range(copies)]
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    del held


def poisoned_runs(fn: Callable[[], torch.Tensor], seeds: Iterable[int] = (0, 1, 2),
                  threads: Iterable[int] = (1, 2), device="cpu") -> Dict[Tuple[int, int], torch.Tensor]:
    """``fn()`` under every (global seed, thread count), each after :func:`nan_heap`.

    ``fn`` builds whatever it needs (modules, inputs) itself, so a seed-dependent
    construction shows up too. Returns ``{(seed, threads): detached result}``; the
    caller's thread count is restored.
    """
    before = torch.get_num_threads()
    out: Dict[Tuple[int, int], torch.Tensor] = {}
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for seed in seeds:
                torch.manual_seed(seed)
                nan_heap(device)
                out[(seed, n_threads)] = fn().detach().clone()
    finally:
        torch.set_num_threads(before)
    return out


def assert_bit_identical(results: Dict[Tuple[int, int], torch.Tensor], what: str) -> torch.Tensor:
    """Every result finite and bit-identical to the first; returns the first."""
    items: List[Tuple[Tuple[int, int], torch.Tensor]] = list(results.items())
    (key0, first) = items[0]
    for key, res in items:
        bad = int((~torch.isfinite(res)).sum())
        assert bad == 0, f"{what}: {bad} non-finite outputs at (seed, threads) = {key}"
        if not torch.equal(res, first):
            diff = (res.double() - first.double()).abs().max().item()
            raise AssertionError(f"{what}: (seed, threads) = {key} differs from {key0} by up to {diff:.3g} "
                                 f"(the result depends on memory it did not write, the RNG state or the "
                                 f"thread count)")
    return first
