"""The comparison study: attentions x seeds of the recipe, then seed-paired verdicts.

    python scripts/study.py                                          # softmax vs ssa, 3 seeds (train=auto)
    python scripts/study.py --attentions softmax,ssa,nsa --seeds 5 -- train.max_steps=500
    python scripts/study.py --parallel 3                             # 3 runs at once on one GPU
    python scripts/study.py --lrs 3e-4,6e-4,1.2e-3,2.4e-3 --seeds 2 --gpus 0,1,2,3 -- train.max_steps=1000
                                                                     # learning-rate sweep, one run per GPU
    python scripts/study.py --lr softmax=6e-4,ssa=1.2e-3 -- train.max_steps=3000   # each at its own rate
    python scripts/study.py --attentions ssa,ssa_nb \
        --variant "ssa_nb=ssa policy=free attention.options.learnable_b=true attention.options.n_min=1.0"
                                                                     # an ablation beside the pinned policy
    python -m nemo_ssa study ...                                     # the same (an installed package)

A variant (``--variant "LABEL=ATTENTION OVERRIDE ..."``, repeatable) is a study axis of its
own: ``LABEL`` in ``--attentions`` trains ``attention=ATTENTION`` with its overrides after the
study's (so they win), in ``<out>/<LABEL>-s<seed>``; the verdicts and plots name it LABEL.

A sweep (``--lrs``) trains every (attention, rate, seed) in ``<out>/<attention>-lr<rate>-s<seed>``
(``train.lr``, and ``train.min_lr`` at a tenth of it) and writes ``lr_sweep.md``: per attention
and rate the held-out loss at the last validation (the last quarter's training loss where no
run recorded one), mean ± sd over seeds, beside the last quarter's training loss (below one pass
over the data, also a loss on tokens no step trained on), each attention's best rate -- marked
when it is the grid's largest or smallest rate, or when rates had different seed counts -- and
the command that runs the study at those rates (``--lr``). ``--gpus`` spreads the runs over those GPUs, ``--parallel``
runs per GPU; ``--stop-launching-after S`` starts no run after S seconds, so a run of the
study fits a time-limited call and the next call carries on (finished runs are reused,
interrupted ones resumed from their checkpoints).

Every (attention, seed) run is the launcher (``python -m nemo_ssa.cli.pretrain``, what
``scripts/pretrain.py`` runs) with ``attention=A seed=S compare_to=[]`` and the overrides after
``--``, in its own process, in the current directory, and in its run directory
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
runs recorded it (``heldout.csv``: each validation on the split no step trains on, NeMo's
on a GPU, the CPU loop's every ``train.val_check_interval`` steps, which the study sets to
``CPU_HELDOUT_EVERY`` on a machine without CUDA unless given). The plot has the training
loss, the held-out loss and the final n per layer (SSA attentions), each mean ± sd over seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from nemo_ssa.cli import child_env, compared_cuda_graphs, config_file, pretrain_command, split_overrides

Curve = Tuple[List[int], List[float]]
#: the CPU loop has no validation unless asked: the study asks every this many steps
CPU_HELDOUT_EVERY = 20


def run_name(attention: str, seed: int, lr: Optional[float] = None) -> str:
    return f"{attention}-s{seed}" if lr is None else f"{attention}-lr{lr:g}-s{seed}"


def run_dir_of(out: str, attention: str, seed: int, lr: Optional[float] = None) -> str:
    return os.path.join(out, run_name(attention, seed, lr))


def lr_overrides(lr: Optional[float]) -> List[str]:
    """``train.lr`` and ``train.min_lr`` (a tenth of it, as the recipe's schedules have it)."""
    return [] if lr is None else [f"train.lr={lr:g}", f"train.min_lr={lr / 10:g}"]


#: a study label -> (the attention it trains, its own overrides); ``parse_variant``
Variants = Dict[str, Tuple[str, List[str]]]

_LABEL_OK = re.compile(r"^[A-Za-z0-9_.+-]+$")


def parse_variant(spec: str, variants: Variants) -> None:
    """``"LABEL=ATTENTION OVERRIDE ..."`` into ``variants`` (SystemExit naming what is wrong)."""
    from nemo_ssa.config.policy import known_names

    head, _, rest = spec.strip().partition(" ")
    label, eq, attention = head.partition("=")
    if not eq or not _LABEL_OK.match(label) or not attention:
        raise SystemExit(f"[study] --variant {spec!r}: give \"LABEL=ATTENTION OVERRIDE ...\", LABEL of letters, "
                         "digits and _.+- (it names the run directories)")
    if label in known_names():
        raise SystemExit(f"[study] --variant {spec!r}: LABEL {label!r} is an attention's name; choose another")
    if attention not in known_names():
        raise SystemExit(f"[study] --variant {spec!r}: unknown attention {attention!r}; known: "
                         f"{', '.join(known_names())}")
    if label in variants:
        raise SystemExit(f"[study] --variant {label!r} given twice")
    extra = rest.split()
    bad = [o for o in extra if "=" not in o]
    if bad:
        raise SystemExit(f"[study] --variant {spec!r}: overrides are key=value, got {bad}")
    variants[label] = (attention, extra)


def command(out: str, attention: str, seed: int, overrides: Sequence[str], lr: Optional[float] = None,
            variants: Optional[Variants] = None) -> List[str]:
    """The launcher for one run: reused if it finished with this configuration, resumed if it
    started and did not finish (metrics.csv without complete.json), else trained.
    ``attention`` is a study label: a variant's (``variants``) trains its attention with its
    overrides after ``overrides``."""
    run_dir = run_dir_of(out, attention, seed, lr)
    started = os.path.isfile(os.path.join(run_dir, "metrics.csv"))
    finished = os.path.isfile(os.path.join(run_dir, "complete.json"))
    name, extra = (variants or {}).get(attention, (attention, []))
    return pretrain_command(f"attention={name}", f"seed={seed}", f"run_dir={run_dir}", "compare_to=[]",
                            "reuse_if_complete=true", f"resume={'true' if started and not finished else 'false'}",
                            *overrides, *extra, *lr_overrides(lr))


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


def _launch_logged(cmd: List[str], log: str, env: Optional[Dict[str, str]] = None) -> int:
    """One run with its output in ``log`` (runs that share the terminal would interleave)."""
    with open(log, "a") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(env))


#: exit code recorded for a run the study did not start (``stop_launching_after``)
NOT_STARTED = -1


def train_all(out: str, attentions: Sequence[str], seeds: Sequence[int], overrides: Sequence[str],
              launch: Optional[Callable[..., int]] = None, parallel: int = 1,
              lrs: Optional[Sequence[float]] = None, lr_of: Optional[Dict[str, float]] = None,
              gpus: Optional[Sequence[str]] = None, stop_launching_after: Optional[float] = None,
              variants: Optional[Variants] = None) -> Dict[str, int]:
    """Every (attention, seed) run -- every (attention, rate, seed) with ``lrs``; each attention
    at ``lr_of[attention]`` with ``lr_of`` -- seed-major, ``parallel`` at a time per GPU of
    ``gpus`` (``CUDA_VISIBLE_DEVICES`` of each run; unset: the runs share what the process
    sees, and their tokens/s are not speed results); returns {run: exit code}. With more
    than one run at a time each run's output goes to ``<out>/<run>.log``. After
    ``stop_launching_after`` seconds no run starts (exit code ``NOT_STARTED``)."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if lrs and lr_of:
        raise ValueError("a sweep (lrs) or a rate per attention (lr_of), not both")
    jobs = [(a, s, lr) for s in seeds for lr in (lrs or [None]) for a in attentions]
    if lr_of:
        jobs = [(a, s, lr_of.get(a)) for a, s, _ in jobs]
    slots: "queue.Queue[Optional[str]]" = queue.Queue()
    for gpu in (list(gpus) if gpus else [None]):
        for _ in range(parallel):
            slots.put(gpu)
    workers = slots.qsize()
    codes, t0, done = {}, time.time(), [0]

    def one(i: int, attention: str, seed: int, lr: Optional[float]) -> None:
        name = run_name(attention, seed, lr)
        if stop_launching_after is not None and time.time() - t0 > stop_launching_after:
            codes[name] = NOT_STARTED
            print(f"[study] run {i}/{len(jobs)}: {name} not started (--stop-launching-after "
                  f"{stop_launching_after:g} s; run the study again to go on)", flush=True)
            return
        gpu = slots.get()
        try:
            env = None if gpu is None else dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
            print(f"[study] run {i}/{len(jobs)}: {name}" + (f" on GPU {gpu}" if gpu is not None else ""), flush=True)
            t = time.time()
            cmd = command(out, attention, seed, overrides, lr, variants)
            if launch is not None:
                codes[name] = launch(cmd) if env is None else launch(cmd, env=env)
            elif workers > 1:
                codes[name] = _launch_logged(cmd, os.path.join(out, f"{name}.log"), env)
            else:
                codes[name] = subprocess.call(cmd, env=child_env(env))
        finally:
            slots.put(gpu)
        done[0] += 1
        spent = time.time() - t0
        print(f"[study] {name}: exit {codes[name]} in {time.time() - t:.0f} s; {done[0]}/{len(jobs)} done, "
              f"about {spent / done[0] * (len(jobs) - done[0]) / workers:.0f} s left", flush=True)

    if workers == 1:
        for i, job in enumerate(jobs, 1):
            one(i, *job)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for f in [pool.submit(one, i, *job) for i, job in enumerate(jobs, 1)]:
                f.result()
    return codes


def final_value(run_dir: str) -> Optional[Tuple[float, str]]:
    """A run's score for choosing its rate: the held-out loss at its last validation, else the
    mean training loss over the last quarter of its steps; with which one it was."""
    held = read_curve(run_dir, "heldout.csv", "val_loss")
    if held:
        return held[1][-1], "held-out"
    tail = last_quarter_loss(run_dir)
    return None if tail is None else (tail, "training, last quarter")


def last_quarter_loss(run_dir: str) -> Optional[float]:
    """Mean training loss over the last quarter of a run's steps (None without metrics.csv).
    Below one pass over the data every step's loss is on tokens the model has not trained on,
    so it is a held-out figure on the training distribution -- beside the held-out split's."""
    train = read_curve(run_dir)
    if not train:
        return None
    return statistics.fmean(train[1][-max(1, len(train[1]) // 4):])


def sweep_notes(attention: str, best: float, lrs: Sequence[float], counts: Dict[float, int]) -> List[str]:
    """What a reader must know before trusting ``attention``'s best rate: it lies on the
    grid's edge (the optimum may be beyond it), or the rates were scored over different
    numbers of seeds."""
    notes, grid = [], sorted(lrs)
    if len(grid) > 1 and best in (grid[0], grid[-1]):
        side, nxt = ("largest", best * 2) if best == grid[-1] else ("smallest", best / 2)
        notes.append(f"**{attention}: its best rate {best:g} is the grid's {side}** -- the optimum may lie beyond "
                     f"it; add {nxt:g} to --lrs before choosing.")
    if len(set(counts.values())) > 1:
        notes.append(f"{attention}: the rates were scored over different numbers of seeds "
                     f"({', '.join(f'{lr:g}: {n}' for lr, n in sorted(counts.items()))}); run the missing ones.")
    return notes


def passes_warning(run_dirs: Sequence[str]) -> Optional[str]:
    """A line for the study's reports when any run read its training split more than once
    (the launcher's ``data.json``): past the first pass the held-out loss rewards memorizing
    less, so a ranking read off it is not only one of learning."""
    from nemo_ssa.data.passes import RECORD

    passes = []
    for d in run_dirs:
        try:
            with open(os.path.join(d, RECORD)) as f:
                p = json.load(f).get("passes")
        except (OSError, ValueError):
            continue
        if p:
            passes.append(float(p))
    if not passes or max(passes) <= 1.0:
        return None
    return (f"**Data: these runs read their training split up to {max(passes):.1f} times** "
            f"({sum(p > 1 for p in passes)} of {len(passes)} runs past one pass). Past the first pass the "
            "held-out loss also rewards memorizing less: a ranking or verdict read off it is not only one of "
            "learning (more data: `data=site_packages`, 8x the embedded corpus, `data.source=<dir>` or "
            "`data.prefix=...`).")


def lr_sweep(out: str, attentions: Sequence[str], seeds: Sequence[int], lrs: Sequence[float],
             overrides: Sequence[str] = ()) -> Tuple[str, Dict[str, float]]:
    """``lr_sweep.md``: per attention and rate the score of ``final_value`` (mean ± sd over the
    seeds that have it), each attention's best rate (lowest mean), and the study command at
    those rates. Returns (text, {attention: best rate})."""
    lines = [f"# Learning-rate sweep: {', '.join(attentions)} x rates {', '.join(f'{lr:g}' for lr in lrs)} "
             f"x seeds {', '.join(map(str, seeds))}", "", f"`{out}`; lower is better.", "",
             "| attention | rate | seeds | score (mean ± sd) | measured on | training loss, last quarter |",
             "|---|---|---|---|---|---|"]
    best: Dict[str, float] = {}
    notes: List[str] = []
    for a in attentions:
        means, counts = {}, {}
        for lr in lrs:
            dirs = [run_dir_of(out, a, s, lr) for s in seeds]
            vals = [v for d in dirs if (v := final_value(d))]
            if not vals:
                lines.append(f"| {a} | {lr:g} | 0 | - | - | - |")
                continue
            xs = [v for v, _ in vals]
            means[lr], counts[lr] = statistics.fmean(xs), len(xs)
            sd = f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else ""
            tails = [t for d in dirs if (t := last_quarter_loss(d)) is not None]
            tail = (f"{statistics.fmean(tails):.4f}" + (f" ± {statistics.stdev(tails):.4f}" if len(tails) > 1 else "")
                    if tails else "-")
            lines.append(f"| {a} | {lr:g} | {len(xs)} | {means[lr]:.4f}{sd} | "
                         f"{', '.join(sorted({w for _, w in vals}))} | {tail} |")
        if means:
            best[a] = min(means, key=means.get)
            notes += sweep_notes(a, best[a], lrs, counts)
    warn = passes_warning([run_dir_of(out, a, s, lr) for a in attentions for s in seeds for lr in lrs])
    if warn:
        lines += ["", warn]
    lines += ["", "Best rate per attention: " + (", ".join(f"{a} {lr:g}" for a, lr in best.items()) or "none yet")]
    lines += [f"- {n}" for n in notes]
    if len(best) == len(attentions):
        extra = " ".join(o for o in overrides if o.split("=", 1)[0] not in ("train.max_steps",))
        lines += ["", "The study at each attention's own rate:", "",
                  f"    python -m nemo_ssa study --attentions {','.join(attentions)} --lr "
                  + ",".join(f"{a}={lr:g}" for a, lr in best.items()) + f" -- train.max_steps=3000 {extra}".rstrip()]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "lr_sweep.md"), "w") as f:
        f.write(text)
    return text, best


def final_n(run_dir: str) -> Dict[int, float]:
    """{layer: n} at the last step of a run's metrics.csv (``n_layer_XX`` columns); {} without SSA."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        return {}
    last: Dict[str, str] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            last = row
    out = {}
    for k, v in last.items():
        if k and k.startswith("n_layer_") and v not in ("", None):
            try:
                out[int(k[len("n_layer_"):])] = float(v)
            except ValueError:
                continue
    return out


def with_cpu_heldout(overrides: Sequence[str], cuda: bool) -> List[str]:
    """The overrides, plus ``train.val_check_interval=CPU_HELDOUT_EVERY`` on a machine
    without CUDA when they do not set it (NeMo's GPU configs validate on their own)."""
    overrides = list(overrides)
    if not cuda and not any(o.split("=", 1)[0].lstrip("+~") == "train.val_check_interval" for o in overrides):
        overrides.append(f"train.val_check_interval={CPU_HELDOUT_EVERY}")
    return overrides


def summarize(out: str, attentions: Sequence[str], seeds: Sequence[int], plot: bool = True,
              lr_of: Optional[Dict[str, float]] = None) -> str:
    from nemo_ssa.study.verdict import compare_pair, format_table

    lr_of = lr_of or {}


    def run(a: str, s: int) -> str:  # each attention's runs at its own rate (--lr)
        return run_dir_of(out, a, s, lr_of.get(a))

    curves = {a: {s: c for s in seeds if (c := read_curve(run(a, s)))} for a in attentions}
    last = max((c[0][-1] for runs in curves.values() for c in runs.values()), default=0)
    if not last:
        raise SystemExit(f"[study] no metrics.csv under {out}: nothing to compare")
    q = max(last // 4, 1)
    buckets = [(1 + i * q, last if i == 3 else (i + 1) * q) for i in range(4)]
    rates = f"; rates {', '.join(f'{a} {lr:g}' for a, lr in lr_of.items())}" if lr_of else ""
    lines = [f"# Study: {', '.join(attentions)} x seeds {', '.join(map(str, seeds))}{rates}", "",
             f"`{out}`; training loss per quarter of the schedule (mean ± sd over seeds; lower is better),"
             " then the verdicts on training and, where the runs recorded it (heldout.csv: the validation"
             " split no step trains on), held-out loss.", "",
             "| attention | seeds | " + " | ".join(f"steps {a}-{b}" for a, b in buckets) + " |",
             "|---|---|" + "---|" * len(buckets)]
    from nemo_ssa.study.verdict import bucket_means

    for a in attentions:
        cells = []
        for bk in buckets:
            # runs that reached the bucket's end (as the verdicts count them); (k) when not every seed did
            vals = [m for c in curves[a].values() if c[0][-1] >= bk[1] and (m := bucket_means(*c, bk)) is not None]
            cells.append(f"{statistics.fmean(vals):.4f}" + (f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else "")
                         + (f" ({len(vals)})" if len(vals) < len(curves[a]) else "") if vals else "-")
        lines.append(f"| {a} | {len(curves[a])} | " + " | ".join(cells) + " |")
    base = attentions[0]
    held = {a: {s: c for s in seeds if (c := read_curve(run(a, s), "heldout.csv", "val_loss"))}
            for a in attentions}
    held_steps = sorted({st for runs in held.values() for c in runs.values() for st in c[0]})
    for other in attentions[1:]:
        v = compare_pair(curves[other], curves[base], buckets, names=(other, base))
        lines += ["", f"## {other} vs {base}: training loss", "", format_table(v, (other, base))]
        if held_steps:  # NeMo's validation on the held-out split, one bucket per validation
            hv = compare_pair(held[other], held[base], [(st, st) for st in held_steps], names=(other, base))
            lines += ["", f"## {other} vs {base}: held-out loss", "", format_table(hv, (other, base))]
    n_final = {a: {s: n for s in seeds if (n := final_n(run(a, s)))} for a in attentions}
    n_layers = sorted({layer for runs in n_final.values() for n in runs.values() for layer in n})
    if n_layers:
        lines += ["", "## n per layer at the last step (mean ± sd over seeds)", "",
                  "| attention | " + " | ".join(f"layer {layer}" for layer in n_layers) + " |",
                  "|---|" + "---|" * len(n_layers)]
        for a in attentions:
            if not n_final[a]:
                continue
            cells = []
            for layer in n_layers:
                vals = [n[layer] for n in n_final[a].values() if layer in n]
                cells.append(f"{statistics.fmean(vals):.3f}" + (f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")
                             if vals else "-")
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        n_curves = {a: {layer: {s: c for s in n_final[a] if (c := read_curve(run(a, s), column=f"n_layer_{layer:02d}"))}
                        for layer in n_layers} for a in attentions if n_final[a]}
        lines += ["", "## n per layer over the schedule (mean over seeds, at the end of each quarter)", "",
                  "| attention | step | " + " | ".join(f"layer {layer}" for layer in n_layers) + " |",
                  "|---|---|" + "---|" * len(n_layers)]
        for a, per_layer in n_curves.items():
            for bk in buckets:
                cells = []
                for layer in n_layers:
                    vals = [dict(zip(*c)).get(bk[1]) for c in per_layer[layer].values()]
                    vals = [v for v in vals if v is not None]
                    cells.append(f"{statistics.fmean(vals):.3f}" if vals else "-")
                lines.append(f"| {a} | {bk[1]} | " + " | ".join(cells) + " |")
    else:
        n_curves = {}
    warn = passes_warning([run(a, s) for a in attentions for s in seeds])
    if warn:
        lines[1:1] = ["", warn]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write(text)
    if plot:
        _plot(curves, held, n_final, os.path.join(out, "study.png"), n_curves)
    return text


def _band(ax, runs: Dict[int, Curve], label: str) -> None:
    """Mean and ± sd over seeds on the steps every seed has."""
    steps = sorted(set.intersection(*(set(c[0]) for c in runs.values())))
    rows = [[dict(zip(*c))[s] for s in steps] for c in runs.values()]
    mean = [statistics.fmean(col) for col in zip(*rows)]
    sd = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*rows)]
    ax.plot(steps, mean, label=f"{label} ({len(runs)} seeds)", marker="o" if len(steps) < 20 else None)
    ax.fill_between(steps, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], alpha=0.25)


def _plot(curves: Dict[str, Dict[int, Curve]], held: Dict[str, Dict[int, Curve]],
          n_final: Dict[str, Dict[int, Dict[int, float]]], path: str,
          n_curves: Optional[Dict[str, Dict[int, Dict[int, Curve]]]] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axh, axn, axt) = plt.subplots(1, 4, figsize=(21, 4.5))
    styles = ["-", "--", ":", "-."]
    for i, (a, per_layer) in enumerate((n_curves or {}).items()):
        cmap = plt.get_cmap("viridis", max(len(per_layer), 2))
        for j, (layer, runs) in enumerate(sorted(per_layer.items())):
            if not runs:
                continue
            steps = sorted(set.intersection(*(set(c[0]) for c in runs.values())))
            mean = [statistics.fmean(dict(zip(*c))[st] for c in runs.values()) for st in steps]
            axt.plot(steps, mean, styles[i % len(styles)], color=cmap(j), lw=1,
                     label=f"{a} layer {layer}" if len(per_layer) <= 4 or j in (0, len(per_layer) - 1) else None)
    axt.set_xlabel("step")
    axt.set_ylabel("n per layer (mean over seeds)")
    if not n_curves:
        axt.text(0.5, 0.5, "no SSA attention in this study", ha="center", va="center", transform=axt.transAxes)
    for a, runs in curves.items():
        if runs:
            _band(ax, runs, a)
        if held.get(a):
            _band(axh, held[a], a)
    for a, per_seed in n_final.items():
        if per_seed:
            layers = sorted(set.intersection(*(set(n) for n in per_seed.values())))
            vals = [[n[layer] for n in per_seed.values()] for layer in layers]
            mean = [statistics.fmean(v) for v in vals]
            sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
            axn.errorbar(layers, mean, yerr=sd, marker="o", capsize=3, label=f"{a} ({len(per_seed)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean ± sd over seeds)")
    axh.set_xlabel("step")
    axh.set_ylabel("held-out loss (mean ± sd over seeds)")
    if not any(held.values()):
        axh.text(0.5, 0.5, "no heldout.csv in these runs", ha="center", va="center", transform=axh.transAxes)
    axn.set_xlabel("layer")
    axn.set_ylabel("n at the last step (mean ± sd over seeds)")
    if not any(n_final.values()):
        axn.text(0.5, 0.5, "no SSA attention in this study", ha="center", va="center", transform=axn.transAxes)
    for a_ in (ax, axh, axn, axt):
        if a_.get_legend_handles_labels()[0]:
            a_.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_lr_of(spec: str, attentions: Sequence[str]) -> Dict[str, float]:
    """``softmax=6e-4,ssa=1.2e-3`` -> {attention: rate}; every attention of the study named once."""
    out: Dict[str, float] = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"[study] --lr {spec!r}: give attention=rate pairs, e.g. softmax=6e-4,ssa=1.2e-3")
        out[name.strip()] = float(value)
    if set(out) != set(attentions):
        raise SystemExit(f"[study] --lr names {sorted(out)}; the study's attentions are {list(attentions)}")
    return out


def prepare_corpus(overrides: Sequence[str]) -> None:
    """Build the embedded corpus the runs will use (``data.*`` of the overrides) once, before
    several runs at a time would race to build it."""
    if any(o.startswith("data.prefix=") for o in overrides):
        return
    from omegaconf import OmegaConf

    from nemo_ssa.data import build_corpus, default_corpus_dir

    group = next((o.split("=", 1)[1] for o in overrides if o.startswith("data=")), "stdlib")  # data=site_packages
    data = OmegaConf.merge(OmegaConf.load(config_file("data", f"{group}.yaml")),
                           OmegaConf.from_dotlist([o[len("data."):] for o in overrides if o.startswith("data.")]))
    info = build_corpus(data.get("dir") or default_corpus_dir(data.source), source=data.source,
                        vocab_size=int(data.vocab_size), max_bytes=data.get("max_bytes"),
                        tokenizer_from=data.get("tokenizer_from"))
    print(f"[study] corpus {info.prefix} ({info.num_tokens:,} tokens{', reused' if info.reused else ''})", flush=True)


def main(argv=None) -> int:
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attentions", default="softmax,ssa", help="the first is the baseline of the verdicts")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--summarize-only", action="store_true", help="no training: the table and plot of what is there")
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at once on the same GPU (per GPU of --gpus; loss study only: tokens/s are then shared)")
    ap.add_argument("--gpus", default=None, help="comma list of GPU indices to spread the runs over (one slot "
                                                 "per GPU x --parallel)")
    ap.add_argument("--lrs", default=None, help="comma list of learning rates: a sweep, then lr_sweep.md")
    ap.add_argument("--lr", default=None, help="each attention at its own rate: softmax=6e-4,ssa=1.2e-3")
    ap.add_argument("--variant", action="append", default=[], metavar='"LABEL=ATTENTION OVERRIDE ..."',
                    help="a study label training ATTENTION with its own overrides (repeatable); name it in "
                         "--attentions")
    ap.add_argument("--stop-launching-after", type=float, default=None,
                    help="seconds after which no run starts (the next invocation goes on)")
    args = ap.parse_args(argv)
    attentions = [a for a in args.attentions.split(",") if a]
    if len(attentions) < 2:
        raise SystemExit("[study] --attentions needs at least two names (the first is the baseline)")
    variants: Variants = {}
    for spec in args.variant:
        parse_variant(spec, variants)
    unused = sorted(set(variants) - set(attentions))
    if unused:
        raise SystemExit(f"[study] --variant {unused} not in --attentions {attentions}")
    seeds = [args.first_seed + i for i in range(args.seeds)]
    lrs = [float(x) for x in args.lrs.split(",") if x] if args.lrs else None
    lr_of = parse_lr_of(args.lr, attentions) if args.lr else None
    if lrs and lr_of:
        raise SystemExit("[study] --lrs (a sweep) or --lr (a rate per attention), not both")
    gpus = [g for g in args.gpus.split(",") if g] if args.gpus else None
    os.makedirs(args.out, exist_ok=True)
    if not args.summarize_only:
        import torch

        overrides = with_cpu_heldout(overrides, torch.cuda.is_available())
        if torch.cuda.is_available():  # without CUDA every run decides none itself
            overrides, why = compared_cuda_graphs(
                [(variants.get(a) or (a, []))[0] for a in attentions], overrides)
            if why:
                print(f"[study] {why}", flush=True)
        if args.parallel > 1:
            prepare_corpus(overrides)
        codes = train_all(args.out, attentions, seeds, overrides, parallel=args.parallel, lrs=lrs, lr_of=lr_of,
                          gpus=gpus, stop_launching_after=args.stop_launching_after, variants=variants)
        failed = [k for k, v in codes.items() if v not in (0, NOT_STARTED)]
        if failed:
            print(f"[study] runs that failed (run the study again to resume them): {failed}", flush=True)
    if lrs:
        text, _ = lr_sweep(args.out, attentions, seeds, lrs, overrides)
        print(text)
        print(f"[study] wrote {os.path.join(args.out, 'lr_sweep.md')}", flush=True)
        return 0
    print(summarize(args.out, attentions, seeds, lr_of=lr_of))
    print(f"[study] wrote {os.path.join(args.out, 'study.md')} and study.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
