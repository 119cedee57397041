"""Where the training loop's host time goes, from a sampling profiler's record of the run.

    py-spy record --idle --threads --nonblocking -r 1000 -f speedscope -o host.json -- \\
        python scripts/pretrain.py ... model.cuda_graphs=full
    python -m nemo_ssa.tools.host_samples host.json --step-ms 22.8 [--top 30]

Why a sampler and not torch.profiler: with ``with_stack`` the profiler instruments every
Python call, which inflates exactly the host work it is asked to measure (a logging reset of
79 us a step on the CPU showed as ~1 ms a step in a profiled step). py-spy reads the
process's stacks from outside at a fixed rate and the run keeps its speed; ``--idle``
counts time the thread waits too (a device sync, a sleep), so the samples of a thread add
up to its wall time.

From py-spy's speedscope file (one sampled profile per thread, the samples in time order)
it takes the thread that runs Lightning's training loop, keeps the samples inside the loop's
step (``--within``), drops everything up to the last sample of a warm-up stack (a Triton or
inductor compile, a CUDA graph capture: ``WARMUP``) and the validation and checkpoint
samples after it (``OTHER``), and prints for what is left, the steady steps:

* the hooks Lightning calls (the frame below its dispatch functions: a callback's
  ``on_train_batch_end``, the module's ``optimizer_step``, the strategy's ``training_step``);
* inclusive time by function (each function counted once per sample);
* the innermost frame of each sample -- the line the thread stood on (for ``--idle`` samples
  that is a wait: a sync's ``.item()``, a graph replay).

Each row is a share of the steady samples and, with ``--step-ms`` (the step's wall time from
the same run's metrics), milliseconds per step. Pure Python; runs on any machine.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

#: the step's frame in Lightning's fit loop (one call per training step)
WITHIN = "training_epoch_loop.py:advance"
#: stacks of one-off work at the start of training ("file:function", the function matched by
#: its end, empty = any; "A&B" = both in one stack): kernel compiles (dynamo's frame
#: conversion, not its eval_frame: torch.optim's fused step runs under a dynamo-disable
#: wrapper every step), CUDA graph captures
#: (torch's graph context, megatron's layer graphs, the whole-iteration wrapper running the
#: schedule eagerly -- its warm-up step and its capture; a replay does not run the schedule)
WARMUP = ("triton/compiler/:", "torch/_inductor/compile_fx.py:", "torch/_inductor/codecache.py:",
          "torch/_dynamo/convert_frame.py:",
          "torch/cuda/graphs.py:capture_begin", "torch/cuda/graphs.py:capture_end",
          "torch/cuda/graphs.py:graph.__enter__", "torch/cuda/graphs.py:graph.__exit__",
          "torch/cuda/graphs.py:make_graphed_callables",
          "megatron/core/transformer/cuda_graphs.py:create_fwd_graph",
          "megatron/core/transformer/cuda_graphs.py:create_bwd_graph",
          "megatron/core/full_cuda_graph.py:__call__&megatron/core/pipeline_parallel/schedules.py:")
#: stacks inside the step that are not the step: validation and checkpoint saves (a
#: ModelCheckpoint hook that only decides not to save is the step's)
OTHER = ("evaluation_loop.py:", "checkpoint_connector.py:", ":save_checkpoint", ":_save_checkpoint")
#: Lightning's dispatch functions: the frame below one of them is the hook that ran
DISPATCH = ("_call_callback_hooks", "_call_lightning_module_hook", "_call_strategy_hook",
            "_call_lightning_datamodule_hook")

Frame = Tuple[str, str, int]  # (function, file, line)


def _short(path: str) -> str:
    """A file as a reader finds it: relative to site-packages (or the folder gpu_session installs
    the offline bundle into), this package's checkout or the Python library, else as given."""
    for marker in ("site-packages/", "dist-packages/", "nemo-ssa-site/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if "/nemo_ssa/" in path:
        return "nemo_ssa/" + path.rsplit("/nemo_ssa/", 1)[1]
    parts = path.split("/lib/python3")
    if len(parts) > 1 and "/" in parts[-1]:
        return parts[-1].split("/", 1)[1]
    return path


def _frame_key(frame: Frame) -> str:
    return f"{frame[0]} ({_short(frame[1])})"


def load_speedscope(path: str) -> List[Tuple[str, List[List[Frame]], List[float]]]:
    """[(thread name, samples root first, weights in seconds)] from py-spy's speedscope file."""
    with open(path) as f:
        data = json.load(f)
    frames = [(fr.get("name", "?"), fr.get("file", "?") or "?", int(fr.get("line") or 0))
              for fr in data["shared"]["frames"]]
    out = []
    for prof in data.get("profiles", []):
        if prof.get("type") != "sampled":
            continue
        samples = [[frames[i] for i in s] for s in prof.get("samples", [])]
        weights = [float(w) for w in prof.get("weights", [1.0] * len(samples))]
        out.append((str(prof.get("name", "")), samples, weights))
    if not out:
        raise ValueError(f"{path}: no sampled profiles (expected py-spy's -f speedscope output)")
    return out


def _has(stack: List[Frame], pattern: str) -> bool:
    """Whether a frame of ``stack`` matches ``file:function`` (each part a substring of the
    file / the end of the function's name, empty = any); ``A&B``: both match."""
    if "&" in pattern:
        return all(_has(stack, part) for part in pattern.split("&"))
    file_part, _, func = pattern.partition(":")
    return any(file_part in fr[1] and (not func or fr[0].endswith(func)) for fr in stack)


def _any(stack: List[Frame], patterns: Sequence[str]) -> bool:
    return any(_has(stack, p) for p in patterns)


def steady_samples(threads, within: str = WITHIN, warmup: Sequence[str] = WARMUP,
                   other: Sequence[str] = OTHER) -> Dict[str, object]:
    """Pick the training thread and split its samples: warm-up, other, steady."""
    best = None
    for name, samples, weights in threads:
        n = sum(1 for s in samples if _has(s, within))
        if best is None or n > best[0]:
            best = (n, name, samples, weights)
    if best is None or best[0] == 0:
        raise ValueError(f"no thread has a sample inside {within!r}: is this a training run's record?")
    _, name, samples, weights = best
    # only the step's own samples can end the warm-up: validation captures its own graph later
    last_warm = -1
    for i, s in enumerate(samples):
        if _has(s, within) and _any(s, warmup):
            last_warm = i
    steady, n_other, n_warm_loop = [], 0, 0
    for i, (s, w) in enumerate(zip(samples, weights)):
        if not _has(s, within):
            continue
        if i <= last_warm:
            n_warm_loop += 1
        elif _any(s, other):
            n_other += 1
        else:
            steady.append((s, w))
    return dict(thread=name, total=len(samples), warm_loop=n_warm_loop, other=n_other, steady=steady,
                steady_s=sum(w for _, w in steady))


def _rows(counter: Counter, total: float, top: int, step_ms: Optional[float]) -> List[str]:
    lines = []
    for key, w in counter.most_common(top):
        share = w / total if total else 0.0
        ms = f"{share * step_ms:8.3f}" if step_ms else "       -"
        lines.append(f"| {100 * share:5.1f} | {ms} | {key} |")
    return lines


def summarize(threads, top: int = 30, step_ms: Optional[float] = None, within: str = WITHIN) -> str:
    split = steady_samples(threads, within=within)
    steady = split["steady"]
    total = split["steady_s"]
    out = [f"Thread {split['thread']!r}: {split['total']} samples; inside the step ({within}): "
           f"{split['warm_loop']} up to the last warm-up stack (compile, graph capture) left out, "
           f"{split['other']} validation/checkpoint left out, {len(steady)} steady ({total:.2f} s)."]
    if not steady:
        return "\n".join(out + ["No steady samples."])
    out.append("ms per step = share x --step-ms" + (f" ({step_ms} ms)" if step_ms else " (not given)") + ".")

    hooks: Counter = Counter()
    inclusive: Counter = Counter()
    innermost: Counter = Counter()
    for stack, w in steady:
        hook = None
        for i, fr in enumerate(stack[:-1]):
            if fr[0].endswith(DISPATCH):
                hook = _frame_key(stack[i + 1])
        hooks[hook or "(not inside a Lightning hook)"] += w
        for key in {_frame_key(fr) for fr in stack}:
            inclusive[key] += w
        leaf = stack[-1]
        innermost[f"{leaf[0]} ({_short(leaf[1])}:{leaf[2]})"] += w
    # the frames every steady sample shares (the loop's ancestors) say nothing
    inclusive = Counter({k: v for k, v in inclusive.items() if v < 0.995 * total})

    head = ["| % of step | ms/step | {} |", "|---:|---:|---|"]
    out += ["", "Lightning hooks (the frame below the dispatch):", head[0].format("hook"), head[1]]
    out += _rows(hooks, total, top, step_ms)
    out += ["", "Inclusive by function:", head[0].format("function (file)"), head[1]]
    out += _rows(inclusive, total, top, step_ms)
    out += ["", "Innermost frame (where the thread stood; with --idle a wait shows here):",
            head[0].format("function (file:line)"), head[1]]
    out += _rows(innermost, total, top, step_ms)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("record", help="py-spy record -f speedscope output")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--step-ms", type=float, default=None,
                   help="the step's wall time in ms (from the run's tokens/s) to turn shares into ms")
    p.add_argument("--within", default=WITHIN, help="file:function of the frame one step runs inside")
    a = p.parse_args(argv)
    print(summarize(load_speedscope(a.record), top=a.top, step_ms=a.step_ms, within=a.within))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
