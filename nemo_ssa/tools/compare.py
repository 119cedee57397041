"""Compare loss curves: one merged curve per run, aligned by global step, judged vs a baseline.

A *run* is one training job over global steps, possibly written in several *segments*
(a resume or restart appends to ``metrics.csv`` and opens a new TensorBoard event file).
Segments are merged into one curve: where they overlap, the later segment wins (a resumed
run re-does the steps after its checkpoint); missing steps are reported as gaps.

Inputs per run (``LABEL=PATH[,PATH...]``; the label defaults to the run directory's name):
  * a run directory of our launcher: ``metrics.csv`` (preferred: it also has n per layer),
    else TensorBoard events under ``tb/`` (else anywhere below), tag ``reduced_train_loss``;
  * a ``.csv`` file with ``step`` and ``loss`` columns (``n_layer_XX`` optional);
  * a TensorBoard event file or a directory of them.
Several paths for one run are segments in the order given (later wins).

Judging: every curve is EMA-smoothed (TensorBoard's debiased EMA, ``ema=0`` = raw), the
runs are aligned on the steps they share with the reference, and the summary reports per
run the final and minimum loss, mean and max |Δ| of the smoothed curves vs the baseline
(from ``from_step`` on) and the first step where |Δ| exceeds the tolerance. Gates
(``--max-delta`` absolute, ``--rtol`` relative to the reference's loss) turn that into an
exit code, like Megatron's golden-value checks; ``--gate RUN=REF`` gates a run against
its own reference (``ssa_triton=ssa_reference``) instead of the baseline.

Errors name the run and the file: no loss tag/column, empty run, non-finite loss (the
step where the first NaN/Inf appeared), step ranges that do not match.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "CompareError",
    "Segment",
    "Curve",
    "RunStats",
    "GateResult",
    "read_csv_segments",
    "read_tb_segments",
    "merge_segments",
    "load_run",
    "ema",
    "compare_runs",
    "write_summary",
    "plot_losses",
    "plot_ssa_n",
    "main",
]

LOSS_TAG = "reduced_train_loss"
N_COLUMN = re.compile(r"^n_layer_(\d+)$")
N_TAG = re.compile(r"^ssa/n/layer_(\d+)$")
EXIT_OK, EXIT_GATE_FAILED, EXIT_INPUT_ERROR = 0, 1, 2


class CompareError(ValueError):
    """Bad or unusable input (exit code 2 from the CLI)."""


@dataclass
class Segment:
    """One contiguous stretch of logging (one launch of a run)."""

    source: str
    steps: List[int]
    loss: List[float]
    n: Dict[int, List[float]] = field(default_factory=dict)  # layer -> values aligned to steps


@dataclass
class Curve:
    """A run's merged curve over global step."""

    label: str
    steps: List[int]
    loss: List[float]
    n: Dict[int, List[Tuple[int, float]]]  # layer -> [(step, value)]
    segments: List[Tuple[str, int, int]]  # (source, first step, last step) in merge order
    overlaps: List[Tuple[int, int]]  # step ranges re-done by a later segment
    gaps: List[Tuple[int, int]]  # (last step before, first step after) where steps are missing
    sources: List[str]

    @property
    def interval(self) -> int:
        return _interval(self.steps)


@dataclass
class RunStats:
    label: str
    first_step: int
    last_step: int
    points: int
    final_loss: float
    final_smoothed: float
    min_loss: float
    min_step: int
    compared: int = 0  # common steps with the baseline (from from_step on)
    mean_abs_delta: Optional[float] = None
    max_abs_delta: Optional[float] = None
    max_delta_step: Optional[int] = None
    first_exceed_step: Optional[int] = None
    segments: int = 1
    gaps: int = 0


@dataclass
class GateResult:
    run: str
    ref: str
    compared: int
    mean_abs_delta: float
    max_abs_delta: float
    max_delta_step: int
    max_rel_delta: float
    first_exceed_step: Optional[int]
    max_delta: Optional[float]
    rtol: Optional[float]
    passed: Optional[bool]  # None: a shown pair (noise floor), not a gate


# ----------------------------------------------------------------------------- reading


def _interval(steps: Sequence[int]) -> int:
    """The logging interval: the most common step difference (1 for a single point)."""
    diffs = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    if not diffs:
        return 1
    counts: Dict[int, int] = {}
    for d in diffs:
        counts[d] = counts.get(d, 0) + 1
    return max(sorted(counts), key=lambda d: counts[d])


def read_csv_segments(path: str) -> List[Segment]:
    """Segments of a metrics CSV: a new one starts where the step does not increase or the
    ``segment`` column (launch counter written by our MetricsWriter) changes."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        if "step" not in cols or "loss" not in cols:
            raise CompareError(f"{path}: needs 'step' and 'loss' columns, found {cols or 'no header'}")
        n_cols = {int(m.group(1)): c for c in cols for m in [N_COLUMN.match(c)] if m}
        segments: List[Segment] = []
        cur: Optional[Segment] = None
        cur_id = None
        for lineno, row in enumerate(reader, start=2):
            try:
                step = int(float(row["step"]))
                loss = float(row["loss"])
            except (TypeError, ValueError):
                raise CompareError(f"{path}:{lineno}: unreadable step/loss {row.get('step')!r}, "
                                   f"{row.get('loss')!r}") from None
            seg_id = row.get("segment")
            if cur is None or step <= cur.steps[-1] or seg_id != cur_id:
                cur_id = seg_id
                cur = Segment(source=f"{path}#{len(segments) + 1}", steps=[], loss=[],
                              n={layer: [] for layer in n_cols})
                segments.append(cur)
            cur.steps.append(step)
            cur.loss.append(loss)
            for layer, col in n_cols.items():
                val = row.get(col)
                cur.n[layer].append(float(val) if val not in (None, "") else math.nan)
    return segments


def _event_files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    files = sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True))
    return files


def _scalar(value) -> Optional[float]:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        from tensorboard.util import tensor_util

        arr = tensor_util.make_ndarray(value.tensor)
        if arr.size == 1:
            return float(arr.reshape(-1)[0])
    return None


def read_tb_segments(path: str, tag: str = LOSS_TAG) -> List[Segment]:
    """One segment per event file (ordered by the file's first wall time)."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError as e:  # pragma: no cover - tensorboard is a declared dependency
        raise CompareError(f"reading TensorBoard events needs the tensorboard package ({e})") from None
    files = _event_files(path)
    if not files:
        raise CompareError(f"{path}: no TensorBoard event files (events.out.tfevents.*)")
    found: List[Tuple[float, Segment]] = []
    tags_seen: set = set()
    for fpath in files:
        steps: Dict[int, float] = {}
        n: Dict[int, Dict[int, float]] = {}
        first_wall = math.inf
        for event in EventFileLoader(fpath).Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                tags_seen.add(value.tag)
                x = _scalar(value)
                if x is None:
                    continue
                if value.tag == tag:
                    first_wall = min(first_wall, event.wall_time)
                    steps[int(event.step)] = x  # a re-logged step in one file: last wins
                else:
                    m = N_TAG.match(value.tag)
                    if m:
                        n.setdefault(int(m.group(1)), {})[int(event.step)] = x
        if steps:
            order = sorted(steps)
            seg = Segment(source=fpath, steps=order, loss=[steps[s] for s in order],
                          n={layer: [vals.get(s, math.nan) for s in order] for layer, vals in n.items()})
            found.append((first_wall, seg))
    if not found:
        shown = ", ".join(sorted(tags_seen)[:12]) or "none"
        raise CompareError(f"{path}: no '{tag}' scalars in {len(files)} event file(s); tags found: {shown}")
    return [seg for _, seg in sorted(found, key=lambda t: t[0])]


def _segments_of(path: str, source: str) -> List[Segment]:
    if not os.path.exists(path):
        raise CompareError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        csv_path = os.path.join(path, "metrics.csv")
        if source in ("auto", "csv") and os.path.isfile(csv_path):
            return read_csv_segments(csv_path)
        if source == "csv":
            raise CompareError(f"{path}: no metrics.csv (source=csv)")
        tb = os.path.join(path, "tb")
        return read_tb_segments(tb if os.path.isdir(tb) else path)
    if path.endswith(".csv"):
        return read_csv_segments(path)
    return read_tb_segments(path)


def merge_segments(label: str, segments: Sequence[Segment]) -> Curve:
    """Merge segments in order; a later segment replaces the earlier one's steps it covers.

    A resumed segment restarts from its checkpoint, so everything the earlier segment
    logged at or after the resumed segment's first step is superseded (not only the exact
    steps it re-logs: a run that stopped mid-interval must not leave stale points behind).
    """
    segments = [s for s in segments if s.steps]
    if not segments:
        raise CompareError(f"run {label!r}: empty (no logged steps)")
    points: Dict[int, float] = {}
    n_points: Dict[int, Dict[int, float]] = {}
    spans: List[Tuple[str, int, int]] = []
    overlaps: List[Tuple[int, int]] = []
    for seg in segments:
        start = seg.steps[0]
        stale = [s for s in points if s >= start]
        if stale:
            overlaps.append((start, max(stale)))
            for s in stale:
                del points[s]
                for layer in n_points.values():
                    layer.pop(s, None)
        for i, (s, x) in enumerate(zip(seg.steps, seg.loss)):
            points[s] = x
            for layer, vals in seg.n.items():
                if not math.isnan(vals[i]):
                    n_points.setdefault(layer, {})[s] = vals[i]
        spans.append((seg.source, seg.steps[0], seg.steps[-1]))
    steps = sorted(points)
    interval = _interval(steps)
    gaps = [(a, b) for a, b in zip(steps, steps[1:]) if b - a > interval]
    return Curve(
        label=label,
        steps=steps,
        loss=[points[s] for s in steps],
        n={layer: sorted(vals.items()) for layer, vals in sorted(n_points.items())},
        segments=spans,
        overlaps=overlaps,
        gaps=gaps,
        sources=sorted({src.split("#")[0] for src, _, _ in spans}),
    )


def _default_label(path: str) -> str:
    path = path.rstrip("/")
    if os.path.isdir(path):
        return os.path.basename(path)
    base = os.path.basename(path)
    if base == "metrics.csv" or base.startswith("events.out"):
        return os.path.basename(os.path.dirname(path)) or base
    return os.path.splitext(base)[0]


def parse_run_spec(spec: str) -> Tuple[str, List[str]]:
    """``LABEL=PATH[,PATH...]`` or ``PATH[,PATH...]`` -> (label, paths)."""
    label = None
    if "=" in spec and not os.path.exists(spec):
        label, spec = spec.split("=", 1)
    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise CompareError(f"run spec {spec!r} names no path")
    return (label or _default_label(paths[0])), paths


def load_run(label: str, paths: Sequence[str], source: str = "auto",
             allow_nonfinite: bool = False) -> Curve:
    """Read every segment of a run and merge them; see the module docstring."""
    segments: List[Segment] = []
    for p in paths:
        segments.extend(_segments_of(p, source))
    curve = merge_segments(label, segments)
    bad = next((i for i, x in enumerate(curve.loss) if not math.isfinite(x)), None)
    if bad is not None:
        step = curve.steps[bad]
        if not allow_nonfinite:
            raise CompareError(
                f"run {label!r}: loss is {curve.loss[bad]} at step {step} (first non-finite value; "
                f"{bad} finite points before it). Not plotting it; pass --truncate-nonfinite to "
                f"compare the finite part only")
        curve.steps, curve.loss = curve.steps[:bad], curve.loss[:bad]
        curve.n = {k: [(s, v) for s, v in vals if s < step] for k, vals in curve.n.items()}
        if not curve.steps:
            raise CompareError(f"run {label!r}: the first logged loss (step {step}) is already non-finite")
    return curve


# ----------------------------------------------------------------------------- judging


def ema(values: Sequence[float], alpha: float) -> List[float]:
    """TensorBoard's debiased EMA: s_t = a*s_{t-1} + (1-a)*x_t, divided by 1 - a^t."""
    if not 0.0 <= alpha < 1.0:
        raise CompareError(f"--ema must be in [0, 1), got {alpha}")
    if alpha == 0.0:
        return list(values)
    out, acc, weight = [], 0.0, 0.0
    for x in values:
        acc = alpha * acc + (1.0 - alpha) * x
        weight = alpha * weight + (1.0 - alpha)
        out.append(acc / weight)
    return out


def _deltas(run: Curve, ref: Curve, alpha: float, from_step: int, strict_range: bool):
    """(steps, run_smoothed - ref_smoothed, ref_smoothed) on the shared steps >= from_step."""
    rs, fs = dict(zip(run.steps, ema(run.loss, alpha))), dict(zip(ref.steps, ema(ref.loss, alpha)))
    common = sorted(s for s in rs if s in fs and s >= from_step)
    if not common:
        raise CompareError(
            f"runs {run.label!r} (steps {run.steps[0]}..{run.steps[-1]}, every {run.interval}) and "
            f"{ref.label!r} (steps {ref.steps[0]}..{ref.steps[-1]}, every {ref.interval}) share no "
            f"logged step{f' at or after {from_step}' if from_step else ''}")
    if strict_range:
        want = [s for s in ref.steps if s >= from_step]
        have = [s for s in run.steps if s >= from_step]
        if want and have and (have[0] > want[0] or have[-1] < want[-1]):
            raise CompareError(
                f"mismatched step ranges: {ref.label!r} covers {want[0]}..{want[-1]} but {run.label!r} "
                f"covers {have[0]}..{have[-1]}; rerun to the same length or pass --common-range to "
                f"compare only the {len(common)} shared steps")
    d = [rs[s] - fs[s] for s in common]
    return common, d, [fs[s] for s in common]


def _stats(curve: Curve, alpha: float) -> RunStats:
    i_min = min(range(len(curve.loss)), key=lambda i: curve.loss[i])
    return RunStats(
        label=curve.label, first_step=curve.steps[0], last_step=curve.steps[-1],
        points=len(curve.steps), final_loss=curve.loss[-1], final_smoothed=ema(curve.loss, alpha)[-1],
        min_loss=curve.loss[i_min], min_step=curve.steps[i_min],
        segments=len(curve.segments), gaps=len(curve.gaps),
    )


def compare_runs(
    curves: Sequence[Curve],
    baseline: int = 0,
    alpha: float = 0.6,
    from_step: int = 0,
    tolerance: Optional[float] = None,
    gates: Optional[Sequence[Tuple[str, str]]] = None,
    max_delta: Optional[float] = None,
    rtol: Optional[float] = None,
    strict_range: bool = True,
    pairs: Optional[Sequence[Tuple[str, str]]] = None,
) -> Tuple[List[RunStats], List[GateResult]]:
    """Per-run statistics vs the baseline and the gate results (see module docstring).

    Args:
        curves: merged curves; ``curves[baseline]`` is the reference for the Δ columns.
        alpha: EMA factor for the smoothed curves (0 = raw).
        from_step: Δ statistics only from this step on (early steps move fast).
        tolerance: |Δ| that marks "first step exceeding" (default: ``max_delta``).
        gates: ``(run, ref)`` label pairs to gate; default every run vs the baseline.
        max_delta, rtol: gate thresholds (absolute |Δ|; |Δ| / |ref|); none = no gates.
        strict_range: a run must cover the reference's step range (else CompareError).
        pairs: ``(run, ref)`` pairs reported like gates but never failing (e.g. two seeds of
            the reference: the seed-to-seed noise floor).
    """
    if not curves:
        raise CompareError("no runs to compare")
    labels = [c.label for c in curves]
    if len(set(labels)) != len(labels):
        raise CompareError(f"run labels must be unique, got {labels}; name them LABEL=PATH")
    by_label = {c.label: c for c in curves}
    base = curves[baseline]
    tol = tolerance if tolerance is not None else max_delta
    stats = []
    for c in curves:
        st = _stats(c, alpha)
        if c is not base:
            steps, d, _ = _deltas(c, base, alpha, from_step, strict_range)
            absd = [abs(x) for x in d]
            i = max(range(len(absd)), key=lambda j: absd[j])
            st.compared, st.mean_abs_delta, st.max_abs_delta, st.max_delta_step = (
                len(d), sum(absd) / len(absd), absd[i], steps[i])
            if tol is not None:
                st.first_exceed_step = next((s for s, x in zip(steps, absd) if x > tol), None)
        stats.append(st)
    gated = max_delta is not None or rtol is not None
    todo = [(r, f, False) for r, f in (pairs or [])]
    if gated:
        todo += [(r, f, True) for r, f in (list(gates) if gates else
                                            [(c.label, base.label) for c in curves if c is not base])]
    results: List[GateResult] = []
    for run_label, ref_label, is_gate in todo:
        for lab in (run_label, ref_label):
            if lab not in by_label:
                raise CompareError(f"--{'gate' if is_gate else 'pair'} names run {lab!r}, but the runs are {labels}")
        steps, d, ref_vals = _deltas(by_label[run_label], by_label[ref_label], alpha, from_step, strict_range)
        absd = [abs(x) for x in d]
        rel = [a / abs(r) if r else math.inf for a, r in zip(absd, ref_vals)]
        i = max(range(len(absd)), key=lambda j: absd[j])
        lim_abs = max_delta if is_gate else tol
        lim_rel = rtol if is_gate else None

        def exceeds(j):
            return (lim_abs is not None and absd[j] > lim_abs) or (lim_rel is not None and rel[j] > lim_rel)

        first = next((steps[j] for j in range(len(steps)) if exceeds(j)), None)
        results.append(GateResult(
            run=run_label, ref=ref_label, compared=len(d), mean_abs_delta=sum(absd) / len(absd),
            max_abs_delta=absd[i], max_delta_step=steps[i], max_rel_delta=max(rel),
            first_exceed_step=first, max_delta=lim_abs, rtol=lim_rel,
            passed=(first is None) if is_gate else None,
        ))
    return stats, results


# ----------------------------------------------------------------------------- output


def _fmt(x, nd=4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)


def summary_markdown(curves, stats, gates, baseline_label, alpha, from_step, tol) -> str:
    lines = [
        f"Baseline: `{baseline_label}` · EMA {alpha} · Δ = smoothed run − smoothed baseline on shared "
        f"steps ≥ {from_step}" + (f" · tolerance {tol}" if tol is not None else ""),
        "",
        "| run | steps | segments | gaps | final loss | final (EMA) | min loss (step) | mean abs Δ | max abs Δ (step) | first step abs Δ > tol |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for st in stats:
        lines.append(
            f"| {st.label} | {st.first_step}–{st.last_step} ({st.points}) | {st.segments} | {st.gaps} | "
            f"{_fmt(st.final_loss)} | {_fmt(st.final_smoothed)} | {_fmt(st.min_loss)} ({st.min_step}) | "
            f"{_fmt(st.mean_abs_delta)} | {_fmt(st.max_abs_delta)}"
            f"{'' if st.max_delta_step is None else f' ({st.max_delta_step})'} | "
            f"{'-' if st.label == baseline_label else (_fmt(st.first_exceed_step) if tol is not None else 'n/a')} |")
    if gates:
        lines += ["", "| run | vs | shared steps | mean abs Δ | max abs Δ (step) | max rel Δ | limit | first step over | result |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for g in gates:
            limit = " / ".join(x for x in (f"abs {g.max_delta}" if g.max_delta is not None else "",
                                           f"rel {g.rtol}" if g.rtol is not None else "") if x)
            lines.append(f"| {g.run} | {g.ref} | {g.compared} | {_fmt(g.mean_abs_delta)} | "
                         f"{_fmt(g.max_abs_delta)} ({g.max_delta_step}) | {_fmt(g.max_rel_delta)} | {limit} | "
                         f"{_fmt(g.first_exceed_step)} | {'shown' if g.passed is None else ('PASS' if g.passed else 'FAIL')} |")
    notes = []
    for c in curves:
        if len(c.segments) > 1:
            segs = "; ".join(f"{os.path.relpath(src) if os.path.isabs(src) else src}: {a}–{b}" for src, a, b in c.segments)
            notes.append(f"- `{c.label}`: {len(c.segments)} segments merged ({segs})"
                         + (f"; re-done by a later segment: {', '.join(f'{a}–{b}' for a, b in c.overlaps)}" if c.overlaps else ""))
        if c.gaps:
            notes.append(f"- `{c.label}`: gaps (logging every {c.interval}): "
                         + ", ".join(f"{a}→{b}" for a, b in c.gaps[:10]) + (" …" if len(c.gaps) > 10 else ""))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def write_summary(out_dir: str, curves, stats, gates, baseline_label, alpha, from_step, tol) -> Dict[str, str]:
    """``summary.md``, ``summary.csv`` (one row per run) and ``gates.csv`` (if any)."""
    os.makedirs(out_dir, exist_ok=True)
    md = summary_markdown(curves, stats, gates, baseline_label, alpha, from_step, tol)
    paths = {"summary.md": os.path.join(out_dir, "summary.md"), "summary.csv": os.path.join(out_dir, "summary.csv")}
    with open(paths["summary.md"], "w") as f:
        f.write(md)
    with open(paths["summary.csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "baseline", "first_step", "last_step", "points", "segments", "gaps", "final_loss",
                    "final_smoothed", "min_loss", "min_step", "compared_steps", "mean_abs_delta",
                    "max_abs_delta", "max_delta_step", "first_exceed_step", "ema", "from_step", "tolerance"])
        for st in stats:
            w.writerow([st.label, baseline_label, st.first_step, st.last_step, st.points, st.segments, st.gaps,
                        repr(st.final_loss), repr(st.final_smoothed), repr(st.min_loss), st.min_step,
                        st.compared, st.mean_abs_delta, st.max_abs_delta, st.max_delta_step,
                        st.first_exceed_step, alpha, from_step, tol])
    if gates:
        paths["gates.csv"] = os.path.join(out_dir, "gates.csv")
        with open(paths["gates.csv"], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["run", "ref", "compared_steps", "mean_abs_delta", "max_abs_delta", "max_delta_step",
                        "max_rel_delta", "max_delta", "rtol", "first_exceed_step", "passed"])
            for g in gates:
                w.writerow([g.run, g.ref, g.compared, g.mean_abs_delta, g.max_abs_delta, g.max_delta_step,
                            g.max_rel_delta, g.max_delta, g.rtol, g.first_exceed_step, g.passed])
    return paths


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"[compare] matplotlib unavailable ({e}); skipping plots, the summary is still written",
              file=sys.stderr)
        return None
    return plt


def plot_losses(path: str, curves, baseline: int, alpha: float, tol: Optional[float] = None,
                from_step: int = 0, gates: Sequence[Tuple[str, str]] = (), title: str = "",
                pairs: Sequence[Tuple[str, str]] = ()) -> Optional[str]:
    """Loss vs step (raw faint, EMA bold) and a Δ-vs-baseline panel; returns the path."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    base = curves[baseline]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_label = {c.label: c for c in curves}
    for i, c in enumerate(curves):
        col = colors[i % len(colors)]
        if alpha > 0:
            ax.plot(c.steps, c.loss, color=col, alpha=0.25, lw=0.8)
        ax.plot(c.steps, ema(c.loss, alpha), color=col, lw=1.6,
                label=c.label + (" (baseline)" if c is base else ""))
        for a, b in c.gaps:
            ax.axvspan(a, b, color=col, alpha=0.08)
        if c is not base:
            steps, d, _ = _deltas(c, base, alpha, 0, strict_range=False)
            axd.plot(steps, d, color=col, lw=1.2, label=f"{c.label} − {base.label}")
    styles = [(g, "--", "gate") for g in gates] + [(p, ":", "noise/pair") for p in pairs]
    for k, ((run_label, ref_label), ls, kind) in enumerate(styles):
        if ref_label != base.label and run_label in by_label and ref_label in by_label:
            steps, d, _ = _deltas(by_label[run_label], by_label[ref_label], alpha, 0, strict_range=False)
            axd.plot(steps, d, lw=1.2, ls=ls, color=("black", "dimgray", "saddlebrown", "purple")[k % 4],
                     label=f"{run_label} − {ref_label} ({kind})")
    axd.axhline(0.0, color="grey", lw=0.8)
    if tol is not None:
        for y in (tol, -tol):
            axd.axhline(y, color="red", lw=0.8, ls=":")
    if from_step:
        axd.axvline(from_step, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("train loss" + (f" (EMA {alpha})" if alpha > 0 else ""))
    axd.set_ylabel("Δ loss")
    axd.set_xlabel("global step")
    ax.legend(loc="upper right")
    axd.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    axd.grid(alpha=0.3)
    ax.set_title(title or f"loss vs step (baseline {base.label})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ssa_n(path: str, curves) -> Optional[str]:
    """n per layer over steps, one panel per run that logged n; None if none did."""
    with_n = [c for c in curves if c.n]
    if not with_n:
        return None
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(len(with_n), 1, figsize=(10, 3.2 * len(with_n)), squeeze=False, sharex=True)
    cmap = plt.get_cmap("viridis")
    for ax, c in zip(axes[:, 0], with_n):
        layers = sorted(c.n)
        for j, layer in enumerate(layers):
            pts = c.n[layer]
            ax.plot([s for s, _ in pts], [v for _, v in pts], color=cmap(j / max(1, len(layers) - 1)),
                    lw=1.2, label=f"layer {layer}")
        ax.set_title(f"{c.label}: SSA n per layer")
        ax.set_ylabel("n")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=min(6, len(layers)), loc="best")
    axes[-1, 0].set_xlabel("global step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compare_losses",
        description="Merge resumed segments into one loss curve per run, align runs by global step, "
                    "plot them against the baseline and judge parity (exit 1 when a gate fails, 2 on bad input).",
    )
    p.add_argument("runs", nargs="+", metavar="[LABEL=]PATH[,PATH...]",
                   help="a run directory (metrics.csv or TensorBoard events), a CSV, or event files; "
                        "several comma-separated paths are segments of one run, later wins")
    p.add_argument("--baseline", help="label of the reference run (default: the first run)")
    p.add_argument("--out", default=None, help="output directory for loss.png, ssa_n.png, summary.md/csv "
                                               "(default: ./compare-<labels>)")
    p.add_argument("--ema", type=float, default=0.6, help="EMA smoothing factor in [0, 1) (TensorBoard's; 0 = raw)")
    p.add_argument("--from-step", type=int, default=0, help="Δ statistics and gates from this global step on")
    p.add_argument("--max-delta", type=float, default=None, help="gate: max |Δ| of the smoothed curves")
    p.add_argument("--rtol", type=float, default=None, help="gate: max |Δ| / |reference loss| (Megatron's golden check)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="|Δ| reported as 'first step exceeding' (default: --max-delta)")
    p.add_argument("--gate", action="append", default=[], metavar="RUN=REF",
                   help="gate RUN against REF instead of every run against the baseline (repeatable)")
    p.add_argument("--pair", action="append", default=[], metavar="RUN=REF",
                   help="report RUN vs REF like a gate but never fail (e.g. a second seed: the noise floor)")
    p.add_argument("--source", choices=("auto", "csv", "tb"), default="auto",
                   help="what to read in a run directory (auto: metrics.csv, else TensorBoard)")
    p.add_argument("--common-range", action="store_true",
                   help="compare on shared steps even when the runs' step ranges differ")
    p.add_argument("--truncate-nonfinite", action="store_true",
                   help="cut a curve before its first NaN/Inf instead of failing")
    p.add_argument("--title", default="", help="plot title")
    p.add_argument("--no-plot", action="store_true", help="summary only")
    return p


def run_compare(args: argparse.Namespace) -> int:
    specs = [parse_run_spec(s) for s in args.runs]
    curves = [load_run(label, paths, source=args.source, allow_nonfinite=args.truncate_nonfinite)
              for label, paths in specs]
    labels = [c.label for c in curves]
    baseline = 0
    if args.baseline is not None:
        if args.baseline not in labels:
            raise CompareError(f"--baseline {args.baseline!r} is not one of the runs {labels}")
        baseline = labels.index(args.baseline)
    gates = []
    for g in args.gate:
        if "=" not in g:
            raise CompareError(f"--gate wants RUN=REF, got {g!r}")
        gates.append(tuple(g.split("=", 1)))
    pairs = []
    for g in args.pair:
        if "=" not in g:
            raise CompareError(f"--pair wants RUN=REF, got {g!r}")
        pairs.append(tuple(g.split("=", 1)))
    if gates and args.max_delta is None and args.rtol is None:
        raise CompareError("--gate needs a threshold: --max-delta and/or --rtol")
    stats, results = compare_runs(
        curves, baseline=baseline, alpha=args.ema, from_step=args.from_step, tolerance=args.tolerance,
        gates=gates, max_delta=args.max_delta, rtol=args.rtol, strict_range=not args.common_range, pairs=pairs)
    out = args.out or os.path.join(os.getcwd(), "compare-" + "-vs-".join(re.sub(r"[^\w.-]+", "_", x) for x in labels))
    tol = args.tolerance if args.tolerance is not None else args.max_delta
    paths = write_summary(out, curves, stats, results, labels[baseline], args.ema, args.from_step, tol)
    if not args.no_plot:
        png = plot_losses(os.path.join(out, "loss.png"), curves, baseline, args.ema, tol=tol,
                          from_step=args.from_step, gates=gates, title=args.title, pairs=pairs)
        if png:
            paths["loss.png"] = png
        npng = plot_ssa_n(os.path.join(out, "ssa_n.png"), curves)
        if npng:
            paths["ssa_n.png"] = npng
    with open(paths["summary.md"]) as f:
        print(f.read(), end="")
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({"runs": {c.label: c.sources for c in curves}, "baseline": labels[baseline],
                   "ema": args.ema, "from_step": args.from_step, "max_delta": args.max_delta,
                   "rtol": args.rtol, "gates": [g.__dict__ for g in results]}, f, indent=2)
    print(f"[compare] wrote {', '.join(sorted(paths))} to {out}")
    failed = [g for g in results if g.passed is False]
    for g in failed:
        print(f"[compare] GATE FAILED: {g.run} vs {g.ref}: first step over the limit {g.first_exceed_step}, "
              f"max |Δ| {g.max_abs_delta:.4g} at step {g.max_delta_step}", file=sys.stderr)
    return EXIT_GATE_FAILED if failed else EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_compare(args)
    except CompareError as e:
        print(f"compare_losses: error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
