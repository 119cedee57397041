"""The comparison study: attentions x seeds of the recipe, then seed-paired verdicts.

    python scripts/study.py                                          # softmax vs ssa, 3 seeds (train=auto)
    python scripts/study.py --attentions softmax,ssa,nsa --seeds 5 -- train.max_steps=500
    python -m nemo_ssa study ...                                     # the same

Every (attention, seed) run is ``scripts/pretrain.py attention=A seed=S compare_to=[]``
with the overrides after ``--``, in its own process and run directory
``<out>/<attention>-s<seed>``: for a seed every attention trains on the same data order.
A run that already finished with the identical configuration is reused
(``reuse_if_complete``); one that died is resumed from its newest checkpoint
(``resume=true``; give ``train.ckpt_every_n_steps`` to make that worth it). Progress and
an estimate of the time left are printed after each run.

Then, from every run's metrics.csv: per attention the mean and spread over seeds of the
training loss (``study.png`` with bands), a table per step bucket (quarters of the
schedule), and for each attention against the first one the verdict of
:mod:`nemo_ssa.study.verdict` (difference, its 95 % interval over seeds, and whether it
exceeds the seed spread) -> ``study.md``; the same verdict on the held-out loss where the
runs recorded it (``heldout.csv``, written at each NeMo validation on the split no step
trains on; the CPU loop has no validation, docs/study.md).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

Curve = Tuple[List[int], List[float]]


def run_dir_of(out: str, attention: str, seed: int) -> str:
    return os.path.join(out, f"{attention}-s{seed}")


def command(out: str, attention: str, seed: int, overrides: Sequence[str]) -> List[str]:
    """pretrain.py for one run: reused if it finished with this configuration, resumed if it
    started and did not finish (metrics.csv without complete.json), else trained."""
    run_dir = run_dir_of(out, attention, seed)
    started = os.path.isfile(os.path.join(run_dir, "metrics.csv"))
    finished = os.path.isfile(os.path.join(run_dir, "complete.json"))
    return [sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), f"attention={attention}", f"seed={seed}",
            f"run_dir={run_dir}", "compare_to=[]", "reuse_if_complete=true",
            f"resume={'true' if started and not finished else 'false'}", *overrides]


def read_curve(run_dir: str, name: str = "metrics.csv", column: str = "loss") -> Optional[Curve]:
    """(steps, values) of a run's CSV (metrics.csv's training loss, or heldout.csv's
    ``val_loss``), later rows winning where a resume re-did steps."""
    path = os.path.join(run_dir, name)
    if not os.path.isfile(path):
        return None
    by_step: Dict[int, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                by_step[int(row["step"])] = float(row[column])
            except (KeyError, ValueError):
                continue
    steps = sorted(by_step)
    return (steps, [by_step[s] for s in steps]) if steps else None


def train_all(out: str, attentions: Sequence[str], seeds: Sequence[int], overrides: Sequence[str],
              launch: Callable[[List[str]], int] = lambda cmd: subprocess.call(cmd, cwd=REPO)) -> Dict[str, int]:
    """Every (attention, seed) run, seed-major; returns {run: exit code}."""
    jobs = [(a, s) for s in seeds for a in attentions]
    codes, t0 = {}, time.time()
    for i, (attention, seed) in enumerate(jobs, 1):
        name = f"{attention}-s{seed}"
        print(f"[study] run {i}/{len(jobs)}: {name}", flush=True)
        t = time.time()
        codes[name] = launch(command(out, attention, seed, overrides))
        spent = time.time() - t0
        print(f"[study] {name}: exit {codes[name]} in {time.time() - t:.0f} s; {i}/{len(jobs)} done, "
              f"about {spent / i * (len(jobs) - i):.0f} s left", flush=True)
    return codes


def summarize(out: str, attentions: Sequence[str], seeds: Sequence[int], plot: bool = True) -> str:
    from nemo_ssa.study.verdict import compare_pair, format_table

    curves = {a: {s: c for s in seeds if (c := read_curve(run_dir_of(out, a, s)))} for a in attentions}
    last = max((c[0][-1] for runs in curves.values() for c in runs.values()), default=0)
    if not last:
        raise SystemExit(f"[study] no metrics.csv under {out}: nothing to compare")
    q = max(last // 4, 1)
    buckets = [(1 + i * q, last if i == 3 else (i + 1) * q) for i in range(4)]
    lines = [f"# Study: {', '.join(attentions)} x seeds {', '.join(map(str, seeds))}", "",
             f"`{out}`; training loss per quarter of the schedule (mean ± sd over seeds; lower is better),"
             " then the verdicts on training and, where the runs recorded it (heldout.csv: NeMo's validation"
             " on the split no step trains on; the CPU loop has none), held-out loss.", "",
             "| attention | seeds | " + " | ".join(f"steps {a}-{b}" for a, b in buckets) + " |",
             "|---|---|" + "---|" * len(buckets)]
    from nemo_ssa.study.verdict import bucket_means

    for a in attentions:
        cells = []
        for bk in buckets:
            vals = [m for c in curves[a].values() if (m := bucket_means(*c, bk)) is not None]
            cells.append(f"{statistics.fmean(vals):.4f}" + (f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else "")
                         if vals else "-")
        lines.append(f"| {a} | {len(curves[a])} | " + " | ".join(cells) + " |")
    base = attentions[0]
    held = {a: {s: c for s in seeds if (c := read_curve(run_dir_of(out, a, s), "heldout.csv", "val_loss"))}
            for a in attentions}
    held_steps = sorted({st for runs in held.values() for c in runs.values() for st in c[0]})
    for other in attentions[1:]:
        v = compare_pair(curves[other], curves[base], buckets, names=(other, base))
        lines += ["", f"## {other} vs {base}: training loss", "", format_table(v, (other, base))]
        if held_steps:  # NeMo's validation on the held-out split, one bucket per validation
            hv = compare_pair(held[other], held[base], [(st, st) for st in held_steps], names=(other, base))
            lines += ["", f"## {other} vs {base}: held-out loss", "", format_table(hv, (other, base))]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write(text)
    if plot:
        _plot(curves, os.path.join(out, "study.png"))
    return text


def _plot(curves: Dict[str, Dict[int, Curve]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for a, runs in curves.items():
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(c[0]) for c in runs.values())))
        rows = [[dict(zip(*c))[s] for s in steps] for c in runs.values()]
        mean = [statistics.fmean(col) for col in zip(*rows)]
        sd = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*rows)]
        ax.plot(steps, mean, label=f"{a} ({len(runs)} seeds)")
        ax.fill_between(steps, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], alpha=0.25)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean ± sd over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attentions", default="softmax,ssa", help="the first is the baseline of the verdicts")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--summarize-only", action="store_true", help="no training: the table and plot of what is there")
    args = ap.parse_args(argv)
    attentions = [a for a in args.attentions.split(",") if a]
    if len(attentions) < 2:
        raise SystemExit("[study] --attentions needs at least two names (the first is the baseline)")
    seeds = [args.first_seed + i for i in range(args.seeds)]
    os.makedirs(args.out, exist_ok=True)
    if not args.summarize_only:
        codes = train_all(args.out, attentions, seeds, overrides)
        failed = [k for k, v in codes.items() if v]
        if failed:
            print(f"[study] runs that failed (run the study again to resume them): {failed}", flush=True)
    print(summarize(args.out, attentions, seeds))
    print(f"[study] wrote {os.path.join(args.out, 'study.md')} and study.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
