"""The same launcher job from several source trees, alternated on one GPU: a change measured alone.

A host-bound step (micro batch 8) moves by a few per cent from host to host, so a change is
measured against its parent in the same call, not against a record: each tree runs the job once
per round, the order reversed every other round (A B, B A, ...) so drift in the machine falls on
both. A tree is a git ref (checked out beside this one for the call: ``benchmarks/ab.py``'s
worktree, as ``run.py --ab`` does) or a directory holding ``scripts/pretrain.py`` and its
``nemo_ssa`` (``.`` for the checkout; on a machine without ``.git``, such as the lent GPUs:
``git archive <sha> nemo_ssa recipes scripts | tar -x -C dev/<sha>``, carried)::

    python scripts/device/step_ab.py --tree before=dev/a001b99 --tree after=. --rounds 2 --out $OUT/ab -- \\
        attention=ssa train=gpu_9min train.micro_batch_size=8 train.global_batch_size=8 train.max_steps=60 \\
        train.val_check_interval=60 model.cuda_graphs=local

``--arm LABEL="k=v k=v"`` adds overrides to one tree's runs only, so an option is A/B'd on one tree
(``--tree ln_off=. --tree ln_on=. --arm ln_on="model.fused_layernorm=true"``).

Each tree builds the corpus into its own ``data/`` unless ``NEMO_SSA_DATA_DIR`` names one for
all (the runs inherit the environment). Writes ``{out}/ab.md`` after every run (a call cut at its limit keeps what finished): per tree the
tokens/s of each round (``summary.json``'s median), their median and the ratio to the first
tree, peak memory, whether graphs were captured, and the first and last step's loss (a change
that should not touch numerics leaves them equal), then every run in the order it ran with the
host's load average as it started. Each run's log is ``{out}/<label>-r<round>.log``.
``--warmup-steps N`` first runs each distinct tree and arm once for N steps, not counted
(``{out}/<label>-warmup.log``, the first label of each): on a fresh machine the first run also
compiles the kernels, and its step rate came out 10-40 % below the later runs'. An arm can change
what compiles (``attention=softmax_triton`` against ``attention=ssa``), so each warms up with its
own overrides; ``--warmup-per tree`` warms each tree once, with its first label's overrides, where
the arms change only what is logged (``train.progress_bar_values``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]  # this checkout's nemo_ssa

from benchmarks.ab import worktree  # noqa: E402
from nemo_ssa.cli import split_overrides  # noqa: E402


def parse_tree(spec: str) -> Tuple[str, str]:
    label, sep, ref = spec.partition("=")
    if not sep or not label or not ref:
        raise SystemExit(f"[step_ab] --tree {spec!r}: LABEL=REF or LABEL=DIR")
    return label, ref


def check_tree(spec: str, path: str) -> str:
    if not os.path.isfile(os.path.join(path, "scripts", "pretrain.py")):
        raise SystemExit(f"[step_ab] --tree {spec!r}: {path}/scripts/pretrain.py not found (a tree holds the "
                         "launcher and its nemo_ssa)")
    return os.path.abspath(path)


def order(labels: Sequence[str], rnd: int) -> List[str]:
    """Round ``rnd``'s order: as given on even rounds, reversed on odd ones."""
    return list(labels) if rnd % 2 == 0 else list(reversed(labels))


def launch(tree: str, overrides: Sequence[str], run_dir: str, log: str, timeout: float) -> int:
    cmd = [sys.executable, os.path.join(tree, "scripts", "pretrain.py"), "compare_to=[]", *overrides,
           f"run_dir={run_dir}"]
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=tree, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[step_ab] timed out after {timeout:.0f} s\n")
            return 124


def read_summary(run_dir: str) -> Optional[Dict]:
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return None
    s = json.load(open(path))
    losses = s.get("loss") or {}
    steps = sorted(int(k) for k in losses)
    return {"rate": s.get("tokens_per_s_median"), "memory": s.get("peak_memory_gib"),
            "graphs": s.get("cuda_graphs_captured"),
            "first": losses.get(str(steps[0])) if steps else None, "last": losses.get(str(steps[-1])) if steps else None}


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def _fmt(x: Optional[float], spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def table(labels: Sequence[str], results: Dict[str, List[Optional[Dict]]]) -> str:
    lines = [f"| tree | tokens/s per round | median | vs {labels[0]} | peak GiB | graphs | first / last loss |",
             "|---|---|---|---|---|---|---|"]
    base = _median([r["rate"] for r in results.get(labels[0], []) if r])
    for label in labels:
        rows = results.get(label, [])
        ok = [r for r in rows if r]
        rates = ", ".join(_fmt(r["rate"]) if r else "failed" for r in rows) or "-"
        med = _median([r["rate"] for r in ok])
        ratio = f"{med / base:.3f}x" if med and base else "-"
        memory = _fmt(max((r["memory"] or 0.0) for r in ok), ".2f") if ok else "-"
        graphs = "/".join(sorted({str(r["graphs"]) for r in ok})) or "-"
        losses = " ; ".join(f"{r['first']} / {r['last']}" for r in ok) or "-"
        lines.append(f"| {label} | {rates} | {_fmt(med)} | {ratio} | {memory} | {graphs} | {losses} |")
    return "\n".join(lines)


def _load_average() -> float:
    """The host's 1-minute load average as a run starts (a host-bound step's rate follows it)."""
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        return float("nan")


def run_order(ran: Sequence[Tuple[int, str, float, Optional[float], float]]) -> str:
    """The runs in the order they ran, with the host's load as each started: a drift with the
    run's place in the call (seen at micro batch 8) shows here, not in the per-tree table."""
    lines = ["| # | round | tree | load at start | tokens/s | seconds |", "|---|---|---|---|---|---|"]
    for i, (rnd, label, load, rate, secs) in enumerate(ran, 1):
        shown = "warm-up" if rnd < 0 else str(rnd + 1)
        speed = "not counted" if rnd < 0 else _fmt(rate) if rate else "failed"
        lines.append(f"| {i} | {shown} | {label} | {load:.2f} | {speed} | {secs:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None, run: Callable = launch) -> int:
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=REF|DIR")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--arm", action="append", default=[], metavar='LABEL="k=v ..."',
                    help="overrides added to one tree's runs only (an option A/B'd on one tree)")
    ap.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                    help="before round 1, run the job for N steps once per distinct tree and arm, not counted: "
                         "the first run of a fresh machine also compiles the kernels, and ran 10-40 %% slower")
    ap.add_argument("--warmup-per", default="arm", choices=("arm", "tree"),
                    help="arm (default): one warm-up per distinct tree and arm overrides; tree: one per tree, "
                         "where the arms change only what is logged")
    args = ap.parse_args(argv)
    refs = dict(parse_tree(t) for t in args.tree)
    if len(refs) < 2:
        raise SystemExit("[step_ab] needs two --tree LABEL=REF|DIR at least (the first is the baseline)")
    args.extra = {}
    for spec in args.arm:
        label, sep, extra = spec.partition("=")
        if not sep or label not in refs:
            raise SystemExit(f"[step_ab] --arm {spec!r}: LABEL=\"k=v ...\" with LABEL one of the trees "
                             f"({', '.join(refs)})")
        args.extra[label] = extra.split()
    if any(o.split("=", 1)[0] in ("run_dir", "compare_to") for o in overrides + sum(args.extra.values(), [])):
        raise SystemExit("[step_ab] run_dir and compare_to are set per run; leave them out of the overrides")
    with contextlib.ExitStack() as stack:
        trees = {}
        for label, ref in refs.items():
            # "." and any directory holding the launcher are used as they are; others are git refs
            if os.path.isfile(os.path.join(ref, "scripts", "pretrain.py")):
                path = ref
            else:
                try:
                    path = stack.enter_context(worktree(ref))[1]
                except subprocess.CalledProcessError:
                    raise SystemExit(f"[step_ab] --tree {label}={ref}: neither a directory holding "
                                     "scripts/pretrain.py nor a git ref of this checkout") from None
            trees[label] = check_tree(f"{label}={ref}", path)
        return _alternate(trees, overrides, args, run)


def _tail(path: str, lines: int = 12) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _alternate(trees: Dict[str, str], overrides: List[str], args, run: Callable) -> int:
    labels = list(trees)
    os.makedirs(args.out, exist_ok=True)
    results: Dict[str, List[Optional[Dict]]] = {label: [] for label in labels}
    ran: List[Tuple[int, str, float, Optional[float], float]] = []  # (round, tree, load, tokens/s, seconds)
    t0 = time.time()
    warm = int(getattr(args, "warmup_steps", 0) or 0)
    extra = getattr(args, "extra", {})
    per_arm = getattr(args, "warmup_per", "arm") == "arm"
    first_label = {}
    for label, path in trees.items():
        first_label.setdefault((path, tuple(extra.get(label, ()))) if per_arm else path, label)
    for label in first_label.values() if warm else []:
        # one short run per distinct tree and arm (the first label naming it), with that label's
        # overrides: its kernels compiled and cached, the machine past its first run; the short
        # run's steps come last, and later duplicates of an override win in Hydra
        run_dir = os.path.join(os.path.abspath(args.out), f"{label}-warmup")
        load, t_run = _load_average(), time.time()
        # the LR warm-up shortened with the run: the recipes' 20 warm-up steps would exceed a
        # 10-step run, the launcher refuses that, and a refused warm-up compiled nothing
        short = [f"train.max_steps={warm}", f"train.val_check_interval={warm}", f"train.warmup_steps={warm // 2}"]
        rc = run(trees[label], overrides + extra.get(label, []) + short, run_dir, run_dir + ".log", args.timeout)
        ran.append((-1, label, load, None, time.time() - t_run))
        print(f"[step_ab] warm-up {label} ({warm} steps, not counted): exit {rc} ({time.time() - t0:.0f} s)", flush=True)
        if rc != 0:
            # the rounds run the same job: stop before they spend the device's time
            print(f"[step_ab] warm-up {label} failed; its log's last lines ({run_dir}.log):\n{_tail(run_dir + '.log')}",
                  flush=True)
            return 1
    for rnd in range(args.rounds):
        for label in order(labels, rnd):
            run_dir = os.path.join(os.path.abspath(args.out), f"{label}-r{rnd}")
            load, t_run = _load_average(), time.time()
            rc = run(trees[label], overrides + extra.get(label, []), run_dir, run_dir + ".log", args.timeout)
            summary = read_summary(run_dir) if rc == 0 else None
            results[label].append(summary)
            ran.append((rnd, label, load, summary["rate"] if summary else None, time.time() - t_run))
            rate = f"{summary['rate']:,.0f} tokens/s" if summary and summary["rate"] else f"failed (exit {rc})"
            print(f"[step_ab] round {rnd + 1}/{args.rounds} {label}: {rate} ({time.time() - t0:.0f} s)", flush=True)
            with open(os.path.join(args.out, "ab.md"), "w") as f:
                f.write(f"# The same job from {len(labels)} trees, alternated ({args.rounds} rounds)\n\n"
                        f"Overrides: `{' '.join(overrides)}`\n\n" +
                        "".join(f"- {label} also: `{' '.join(x)}`\n" for label, x in extra.items())
                        + f"\n{table(labels, results)}\n\n{run_order(ran)}\n")
    print(table(labels, results), flush=True)
    return 0 if all(all(r for r in rows) for rows in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
