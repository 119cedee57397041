"""The one timer of the benchmarks: median milliseconds of a callable, and its peak memory.

``median_ms`` is ``triton.testing.do_bench`` (L2 flushed between calls, median of the
timed calls) with floors on the number of calls: do_bench sizes its loops from a 5-call
estimate, so a 130 ms call got one warm-up and ONE timed call and the first case of a
process ran up to 9% slow (docs/results/2026-11-26-nsa-qmajor-dq). At least
``MIN_WARMUP_CALLS`` warm-up and ``MIN_TIMED_CALLS`` timed calls, whatever the budgets say.

Without CUDA (the scripts' CPU smoke modes only) it returns the wall clock of one call
after one warm-up call: numbers that check the script runs, not speeds.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Tuple

import torch

MIN_WARMUP_CALLS = 3
MIN_TIMED_CALLS = 10


def median_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100,
              grad_to_none: Optional[Iterable[torch.Tensor]] = None) -> float:
    """Median ms of ``fn()`` on the current CUDA stream.

    Args:
        fn: the call to time (its first call here also compiles and warms up).
        warmup_ms, rep_ms: do_bench's time budgets, raised to the call-count floors.
        grad_to_none: tensors whose ``.grad`` is cleared before every call (fwd+bwd
            rows that accumulate into leaves).
    Returns:
        milliseconds (float).
    """
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    leaves = list(grad_to_none) if grad_to_none is not None else None
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    warmup_ms = max(warmup_ms, MIN_WARMUP_CALLS * est)
    rep_ms = max(rep_ms, MIN_TIMED_CALLS * est)
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves,
                                         return_mode="median"))


def host_ms(fn: Callable[[], object], n: int = 200, warmup: int = 20,
            sync: Optional[Callable[[], None]] = None) -> float:
    """Median milliseconds of CPU time of ONE call of ``fn``, each started on an idle,
    synchronized device: the host cost alone (Python, dispatch, validation, allocation,
    launch), whatever the kernels take -- what a host-bound row's wall time hides under its
    process-to-process spread (docs/results/2026-11-28-consolidation-gpu: do_bench read the
    same SDPA call 1.4x apart within one process at micro batch 8). ``sync`` defaults to
    ``torch.cuda.synchronize`` (a no-op without CUDA)."""
    sync = sync or (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
    for _ in range(max(1, warmup)):
        fn()
    times = []
    for _ in range(max(1, n)):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    times.sort()
    return times[len(times) // 2] * 1e3


def enqueue_ms(fn: Callable[[], object], calls: int = 20, reps: int = 31, warmup: int = 10, *,
               busy: Optional[Callable[[float], Callable[[], bool]]] = None,
               sync: Optional[Callable[[], None]] = None) -> Tuple[float, int]:
    """Median milliseconds of host time per call of ``fn`` while the device is kept busy, and
    how many samples were late.

    Each sample starts a device-side wait long enough to hold ``calls`` calls, then issues the
    calls back to back and divides the CPU wall time by ``calls``: the kernels only queue up
    behind the wait, so the time is the host path alone (Python, dispatch, allocation, launch)
    with no device round trip. ``host_ms`` times one call after a synchronize instead -- a first
    launch on an idle device each time -- and read the same SDPA call up to 1.7x apart between
    processes (docs/results/2026-11-28-consolidation-gpu). A sample is *late* when the device had already
    finished the wait when the calls were issued: a call synchronized (``.item()``, a host
    copy, ``cudaFree``), or the wait was too short; late samples still count in the median
    and the caller reports them.

    ``busy(ms)`` starts the wait and returns a function that says whether the device is still
    in it (default: ``torch.cuda._sleep`` calibrated once, and a CUDA event's ``query``);
    ``sync`` defaults to ``torch.cuda.synchronize``. Both are arguments so the CPU tests can
    stand in for a device."""
    sync = sync or torch.cuda.synchronize
    busy = busy or _cuda_busy()
    for _ in range(max(1, warmup)):
        fn()
    sync()
    t0 = time.perf_counter()  # a first estimate sizes the wait: three times the calls' host time
    for _ in range(calls):
        fn()
    est_ms = (time.perf_counter() - t0) * 1e3 / calls
    sync()
    wait_ms = max(5.0, 3.0 * calls * est_ms)
    per_call, late = [], 0
    for _ in range(max(1, reps)):
        still_busy = busy(wait_ms)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) * 1e3 / calls)
        late += not still_busy()
        sync()
    per_call.sort()
    return per_call[len(per_call) // 2], late


def _cuda_busy() -> Callable[[float], Callable[[], bool]]:
    """``busy(ms)`` for ``enqueue_ms`` on CUDA: ``torch.cuda._sleep`` of ms worth of cycles
    (calibrated here with events) and the query of an event recorded after it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)

    def busy(ms: float) -> Callable[[], bool]:
        torch.cuda._sleep(int(ms * cycles_per_ms))
        done = torch.cuda.Event()
        done.record()
        return lambda: not done.query()

    return busy


def graph_ms(fn: Callable[[], None], n: int = 30) -> float:
    """Milliseconds per call of ``fn`` replayed as a CUDA graph: kernel time without host
    cost or launch gaps (no L2 flush between replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def kernel_ms(fn: Callable[[], object], calls: int = 50, warmup: int = 10) -> float:
    """GPU time per call of ``fn``: the sum of its device activity (kernels, copies, memsets)
    as the profiler records it over ``calls`` calls, divided by ``calls``. Neither the host
    cost nor the gaps between launches count: what a host-bound row's wall time hides (the
    part a change to a kernel moves), and what it costs once the host is out of the way
    (CUDA graphs)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return device_us(prof.events()) / calls / 1e3


def device_us(events: Iterable) -> float:
    """Microseconds of device activity in profiler ``events`` (``kernel_ms``'s sum)."""
    return sum(e.device_time for e in events if e.device_type == torch.autograd.DeviceType.CUDA)


def peak_mib(fn: Callable[[], object]) -> float:
    """MiB allocated by one call of ``fn`` above what was allocated before it (CUDA)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
