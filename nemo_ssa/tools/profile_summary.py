"""Summarise a torch.profiler chrome trace of training steps: where the GPU waits for the host.

    python -m nemo_ssa.tools.profile_summary runs/softmax-s1234/profile/trace.json.gz [--top 25]

For each ``ProfilerStep#N`` window (written by ``nemo_ssa.nemo.callbacks.ProfilerCallback``)
it prints the step's wall time (start to the next step's start), the GPU-busy time (union
of kernel intervals) and the idle time, then attributes every GPU-idle interval longer than
``--min-gap-us`` to the Python functions the CPU was executing at that moment (inclusive
per stack level; needs ``with_stack``), then every host-device synchronisation in the steps
(``cudaStreamSynchronize`` and the other calls in ``SYNC_CALLS``: an ``.item()``, a blocking
copy, a host read of a device flag) grouped by the call site that asked for it, with how long
the host waited -- each one drains the GPU's queue, and the host must refill it before the GPU
works again -- then the host's torch ops by call site and count (a per-tensor Python loop
shows as ~one op per parameter per step), plus the CUDA kernels by total time. Pure Python; runs on any machine.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

#: CUDA runtime calls after which the host has waited for the device. torch's ``.item()``,
#: ``.cpu()`` and blocking host-to-device copies end in ``cudaStreamSynchronize``.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")

#: frames skipped when naming the call site of a synchronisation: the library plumbing between
#: the code that asked for a value and the runtime call (the trace names a frame by its path
#: under site-packages: "torch/_tensor.py(..)", "lightning/pytorch/...")
_PLUMBING = ("torch/", "<built-in", "contextlib.py", "lightning_utilities/")


def load(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def summarize(events: List[dict], top: int = 25, min_gap_us: float = 20.0) -> str:
    # the host's step annotations (the profiler also writes each one on the GPU's timeline,
    # category gpu_user_annotation: counting both halved every step's window)
    steps = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    pyfn = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    lines = []
    if not steps:
        return "no ProfilerStep# events in this trace"
    busy = _union([(a, b) for a, b, _ in kernels])
    busy_starts = [a for a, _ in busy]
    # main thread = the thread of the step annotations
    tid = steps[0].get("tid")
    main_py = sorted((e for e in pyfn if e.get("tid") == tid), key=lambda e: e["ts"])

    def busy_in(a: float, b: float) -> float:
        i = max(0, bisect.bisect_right(busy_starts, a) - 1)
        t = 0.0
        while i < len(busy) and busy[i][0] < b:
            t += max(0.0, min(b, busy[i][1]) - max(a, busy[i][0]))
            i += 1
        return t

    def gaps_in(a: float, b: float) -> List[Tuple[float, float]]:
        out, cur = [], a
        i = max(0, bisect.bisect_right(busy_starts, a) - 1)
        while i < len(busy) and busy[i][0] < b:
            s, e = busy[i]
            if s > cur:
                out.append((cur, min(s, b)))
            cur = max(cur, e)
            i += 1
        if cur < b:
            out.append((cur, b))
        return [(x, y) for x, y in out if y - x >= min_gap_us]

    py_starts = [e["ts"] for e in main_py]

    def stack_at(t: float) -> List[str]:
        """Python frames (outermost first) active on the main thread at time t."""
        i = bisect.bisect_right(py_starts, t)
        frames = [e for e in main_py[max(0, i - 4000):i] if e["ts"] + e["dur"] >= t]
        frames.sort(key=lambda e: (e["ts"], -e["dur"]))
        return [e["name"] for e in frames]

    lines.append("| step | wall ms (to next step) | annotated ms | GPU busy ms | GPU idle ms | idle % |")
    lines.append("|---|---|---|---|---|---|")
    idle_by_fn: Dict[str, float] = defaultdict(float)
    idle_leaf: Dict[str, float] = defaultdict(float)
    total_idle = 0.0
    windows = []
    for i, st in enumerate(steps):
        a = st["ts"]
        b = steps[i + 1]["ts"] if i + 1 < len(steps) else st["ts"] + st["dur"]
        windows.append((a, b))
        bz = busy_in(a, b)
        lines.append(f"| {st['name']} | {(b - a) / 1e3:.2f} | {st['dur'] / 1e3:.2f} | {bz / 1e3:.2f} | "
                     f"{(b - a - bz) / 1e3:.2f} | {100 * (1 - bz / max(b - a, 1e-9)):.0f} |")
        for ga, gb in gaps_in(a, b):
            total_idle += gb - ga
            # attribute the gap to what the host ran in it: sample at a few points
            pts = [ga + (gb - ga) * f for f in (0.1, 0.5, 0.9)]
            for t in pts:
                frames = stack_at(t)
                w = (gb - ga) / len(pts)
                for name in set(frames):
                    idle_by_fn[name] += w
                if frames:
                    idle_leaf[frames[-1]] += w
    if main_py:
        lines.append(f"\nGPU-idle time attributed to Python functions on the main thread "
                     f"(gaps >= {min_gap_us:.0f} us, {total_idle / 1e3:.1f} ms in all; inclusive):")
        for name, t in sorted(idle_by_fn.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {t / 1e3:9.2f} ms  {name[:150]}")
        lines.append("\n... innermost frame at the sample points:")
        for name, t in sorted(idle_leaf.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {t / 1e3:9.2f} ms  {name[:150]}")
    lines.extend(_sync_table(events, tid, windows, stack_at, top))
    lines.extend(_op_table(events, tid, windows, stack_at, top))
    k_tot: Dict[str, float] = defaultdict(float)
    k_cnt: Dict[str, int] = defaultdict(int)
    a0, b1 = windows[0][0], windows[-1][1]
    for a, b, name in kernels:
        if a >= a0 and b <= b1:
            k_tot[name] += b - a
            k_cnt[name] += 1
    n = len(steps)
    lines.append(f"\nCUDA kernels by total time per step ({sum(k_cnt.values()) / n:.0f} launches per step):")
    for name, t in sorted(k_tot.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {t / n / 1e3:8.3f} ms  x{k_cnt[name] / n:5.0f}  {name[:120]}")
    return "\n".join(lines)


def call_site(frames: List[str], depth: int = 2) -> str:
    """The innermost ``depth`` frames outside torch's and Lightning's plumbing, innermost first."""
    own = [f for f in frames if not f.startswith(_PLUMBING)]
    return " <- ".join(reversed(own[-depth:])) if own else "(no Python frame)"


def _by_site(found: List[dict], n: int, stack_at, top: int, time_header: str) -> List[str]:
    """``found`` events grouped by (name, call site): per step, their time, the site."""
    count: Dict[str, int] = defaultdict(int)
    spent: Dict[str, float] = defaultdict(float)
    for e in found:
        site = f"{e['name']}: {call_site(stack_at(e['ts'] + e['dur'] / 2))}"
        count[site] += 1
        spent[site] += e["dur"]
    lines = [f"| per step | {time_header} | call site (innermost first) |", "|---|---|---|"]
    for site in sorted(count, key=lambda k: -count[k] * 1e9 - spent[k])[:top]:
        lines.append(f"| {count[site] / n:.1f} | {spent[site] / n / 1e3:.3f} | {site[:220]} |")
    return lines


def _sync_table(events: List[dict], tid, windows: List[Tuple[float, float]], stack_at, top: int) -> List[str]:
    a0, b1 = windows[0][0], windows[-1][1]
    syncs = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
             and e.get("name") in SYNC_CALLS and e.get("tid") == tid and a0 <= e["ts"] < b1]
    n = len(windows)
    lines = [f"\nHost-device synchronisations on the main thread: {len(syncs) / n:.1f} per step, "
             f"{sum(e['dur'] for e in syncs) / n / 1e3:.2f} ms waited per step"]
    return lines + (_by_site(syncs, n, stack_at, top, "ms waited per step") if syncs else [])


def _op_table(events: List[dict], tid, windows: List[Tuple[float, float]], stack_at, top: int) -> List[str]:
    """The host's torch ops per step outside any other op, by (op, call site): the per-tensor
    Python loops a step runs (one dispatch, often one launch, each) stand out by count -- the
    host time a CUDA graph of the model does not remove when the loop runs outside it."""
    a0, b1 = windows[0][0], windows[-1][1]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("tid") == tid
                  and a0 <= e["ts"] < b1), key=lambda e: (e["ts"], -e["dur"]))
    outer, end = [], -1.0
    for e in ops:  # top-level ops only: an aten::copy_ inside aten::to is the same dispatch
        if e["ts"] >= end:
            outer.append(e)
            end = e["ts"] + e["dur"]
    n = len(windows)
    lines = [f"\nHost ops on the main thread (outermost only): {len(outer) / n:.0f} per step, "
             f"{sum(e['dur'] for e in outer) / n / 1e3:.2f} ms of op time per step (profiled)"]
    return lines + (_by_site(outer, n, stack_at, top, "op ms per step") if outer else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    args = ap.parse_args(argv)
    print(summarize(load(args.trace), args.top, args.min_gap_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
