"""GPU loss-parity protocol: train attentions on the 114M recipe, bring the logs back, compare.

Step 1 (on the GPU machine, one command of <= 10 minutes):

    python scripts/parity.py train --out $OUT/parity --steps 1000 \
        --runs softmax:1234 ssa_reference:1234 ssa_reference:4321 ssa_triton:1234 \
        --resume-check softmax:1234:500

trains each ``ATTENTION:SEED`` with ``scripts/pretrain.py`` (``train=gpu_9min``, micro
batch 8, seq 1024, the local corpus; same seed = same initialisation and data order),
spreading the runs over the visible GPUs (``--per-gpu`` runs share one GPU). A
``--resume-check ATTENTION:SEED:STEP[:OVERRIDES]`` run is interrupted after STEP (checkpoint at STEP)
and resumed, so the merged curve can be checked against the uninterrupted run. Only small
files come back: one ``parity-logs.tgz`` (per run ``metrics.csv``, ``summary.json``,
``config.yaml``, the launch log) and ``parity_runs.json`` -- the device tool returns only a
few files per command. The checkpoints stay in ``--scratch``.

Labels are ``ATTENTION-sSEED``, so two runs of one attention and seed that differ only in
their overrides (softmax at seq 1024 and at seq 4096) need separate invocations (own
``--out`` and ``--scratch``; two invocations can share a GPU, started ~50 s apart so the
corpus is built once).

Step 2 (anywhere, on the returned logs):

    python scripts/parity.py compare --logs <returned>/parity/parity-logs.tgz [more .tgz/dirs] \
        --out docs/results/<date>-parity

runs the compare tool with the protocol's rules: baseline ``softmax-s<first seed>``;
gates (``--max-delta``) only between a fused kernel and its own reference at the same seed
(``ssa_triton`` vs ``ssa_reference``, ``softmax_triton`` vs ``softmax``, ...); softmax vs
SSA is shown, not gated; a second seed of a reference is shown as the noise floor; a
resumed run is gated against its uninterrupted twin with the golden tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

# fused implementation -> the reference it must match (same seed)
REFERENCE_OF: Dict[str, str] = {
    "ssa_triton": "ssa_reference",
    "ssa": "ssa_reference",
    "ssa_flex": "ssa_reference",
    "elsa_ssa": "ssa_reference",
    "softmax_triton": "softmax",
    "elsa": "softmax",
}
GOLDEN_RTOL = 0.05  # Megatron's golden-value rule (lm loss, deterministic mode); see tests/golden/README.md
KEEP = ("metrics.csv", "summary.json", "config.yaml", "attention_policy.json", "complete.json")


def _label(attention: str, seed: int, resumed: bool = False) -> str:
    return f"{attention}-s{seed}" + ("-resumed" if resumed else "")


def _parse_run(spec: str) -> Tuple[str, int, List[str]]:
    """``ATTENTION:SEED[:OVERRIDE,OVERRIDE...]`` (overrides go to this run's pretrain.py)."""
    parts = spec.split(":", 2)
    try:
        name, seed = parts[0], int(parts[1])
    except (ValueError, IndexError):
        raise SystemExit(f"--runs wants ATTENTION:SEED[:OVERRIDES], got {spec!r}") from None
    return name, seed, [o for o in (parts[2].split(",") if len(parts) > 2 else []) if o]


def _parse_resume(spec: str) -> Tuple[str, int, int, List[str]]:
    """``ATTENTION:SEED:STEP[:OVERRIDE,OVERRIDE...]`` (overrides as in ``--runs``)."""
    parts = spec.split(":", 3)
    try:
        name, seed, step = parts[0], int(parts[1]), int(parts[2])
    except (ValueError, IndexError):
        raise SystemExit(f"--resume-check wants ATTENTION:SEED:STEP[:OVERRIDES], got {spec!r}") from None
    return name, seed, step, [o for o in (parts[3].split(",") if len(parts) > 3 else []) if o]


# ----------------------------------------------------------------------------- train


class Job:
    def __init__(self, label: str, commands: List[List[str]], run_dir: str):
        self.label, self.commands, self.run_dir = label, commands, run_dir
        self.proc: Optional[subprocess.Popen] = None
        self.gpu: Optional[str] = None
        self.started = 0.0
        self.rc: Optional[int] = None
        self.log_path = ""
        self.segment = 0
        self.elapsed = 0.0
        self.seed = 0


# The protocol's batch and schedule, pinned here so every parity result stays comparable
# when train=gpu_9min moves (at micro/global batch 32, 1,000 steps would take the unfused
# reference ~20 min). Overrides in --extra / per run still win.
PROTOCOL = ["train.micro_batch_size=8", "train.global_batch_size=8", "train.lr=3.0e-4", "train.min_lr=3.0e-5",
            "train.warmup_steps=75", "train.val_check_interval=500", "train.limit_val_batches=4"]


def _pretrain_cmd(name: str, seed: int, steps: int, runs_root: str, extra: List[str]) -> List[str]:
    return [sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), f"attention={name}", f"seed={seed}",
            "compare_to=[]", "train=gpu_9min", f"train.max_steps={steps}", f"runs_root={runs_root}",
            *PROTOCOL, *extra]


def prepare_corpus(overrides: List[str], tag: str = "parity") -> None:
    """Build the embedded corpus once, before several runs would race to build it."""
    if any(o.startswith("data.prefix=") for o in overrides):
        return
    from omegaconf import OmegaConf

    from nemo_ssa.data import build_corpus, default_corpus_dir

    data = OmegaConf.load(os.path.join(REPO, "nemo_ssa", "configs", "data", "stdlib.yaml"))
    info = build_corpus(data.get("dir") or default_corpus_dir(data.source), source=data.source,
                        vocab_size=int(data.vocab_size), max_bytes=data.get("max_bytes"))
    print(f"[{tag}] corpus {info.prefix} ({info.num_tokens:,} tokens{', reused' if info.reused else ''})", flush=True)


def train(args) -> int:
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("parity.py train needs CUDA (this is the GPU protocol); the CPU story is "
                         "`python scripts/pretrain.py`")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    slots = [str(g) for _ in range(args.per_gpu) for g in range(n_gpus)]  # fill GPUs breadth-first
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    jobs: List[Job] = []
    common = list(args.extra or [])
    for spec in args.runs:
        name, seed, own = _parse_run(spec)
        root = os.path.join(args.scratch, _label(name, seed))
        jobs.append(Job(_label(name, seed), [_pretrain_cmd(name, seed, args.steps, root, common + own)],
                        os.path.join(root, f"{name}-s{seed}")))
        jobs[-1].seed = seed
    for spec in args.resume_check or []:
        name, seed, step, own = _parse_resume(spec)
        root = os.path.join(args.scratch, _label(name, seed, True))
        first = _pretrain_cmd(name, seed, args.steps, root,
                              common + own + [f"stop_after={step}", f"train.ckpt_every_n_steps={step}"])
        second = _pretrain_cmd(name, seed, args.steps, root, common + own + ["resume=true"])
        jobs.append(Job(_label(name, seed, True), [first, second], os.path.join(root, f"{name}-s{seed}")))
        jobs[-1].seed = seed
    labels = [j.label for j in jobs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"duplicate runs: {labels}")
    print(f"[parity] {len(jobs)} run(s) on {n_gpus} GPU(s) x {args.per_gpu}: {', '.join(labels)}", flush=True)
    t0 = time.time()
    prepare_corpus(common)
    pending, running, done = list(jobs), [], []
    free = list(slots)

    def launch(job: Job):
        cmd = job.commands[job.segment]
        job.log_path = os.path.join(out, f"{job.label}.log")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=job.gpu, PYTHONUNBUFFERED="1")
        mode = "a" if job.segment else "w"
        log = open(job.log_path, mode)
        log.write(f"\n=== segment {job.segment + 1}: {' '.join(cmd)}\n")
        log.flush()
        job.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        job.started = time.time()
        print(f"[parity] {time.time() - t0:6.0f}s start {job.label} segment {job.segment + 1}/{len(job.commands)} "
              f"on GPU {job.gpu}", flush=True)

    last_launch: Dict[int, float] = {}
    while pending or running:
        # staggered starts: runs with the same seed share megatron's dataset index cache,
        # which the first one writes a few tens of seconds after it starts
        ready = [j for j in pending if time.time() - last_launch.get(j.seed, -1e9) >= args.stagger]
        if ready and free:
            job = ready[0]
            pending.remove(job)
            job.gpu = free.pop(0)
            launch(job)
            running.append(job)
            last_launch[job.seed] = time.time()
            continue
        time.sleep(2)
        for job in list(running):
            rc = job.proc.poll()
            if rc is None and time.time() - t0 > args.time_limit:
                job.proc.kill()
                job.proc.wait()
                rc = -9
                print(f"[parity] {job.label}: killed at the time limit ({args.time_limit} s)", flush=True)
                job.commands = job.commands[: job.segment + 1]
            if rc is None:
                continue
            job.elapsed += time.time() - job.started
            if rc == 0 and job.segment + 1 < len(job.commands):
                job.segment += 1
                launch(job)
                continue
            job.rc = rc
            running.remove(job)
            done.append(job)
            free.append(job.gpu)
            print(f"[parity] {time.time() - t0:6.0f}s end {job.label} rc={rc} ({job.elapsed:.0f} s)", flush=True)
    report = {}
    stage = os.path.join(args.scratch, "_pack")
    shutil.rmtree(stage, ignore_errors=True)
    for job in jobs:
        dest = os.path.join(stage, job.label)
        os.makedirs(dest, exist_ok=True)
        for name in KEEP:
            src = os.path.join(job.run_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, dest)
        if os.path.isfile(job.log_path):
            shutil.move(job.log_path, os.path.join(dest, "launch.log"))
        summary = {}
        if os.path.isfile(os.path.join(dest, "summary.json")):
            summary = json.load(open(os.path.join(dest, "summary.json")))
        report[job.label] = {"rc": job.rc, "seconds": round(job.elapsed, 1), "segments": len(job.commands),
                             "tokens_per_s": summary.get("tokens_per_s_median"),
                             "peak_memory_gib": summary.get("peak_memory_gib"), "device": summary.get("device")}
    with tarfile.open(os.path.join(out, "parity-logs.tgz"), "w:gz") as tar:
        for job in jobs:
            tar.add(os.path.join(stage, job.label), arcname=job.label)
    meta = {"steps": args.steps, "runs": report, "per_gpu": args.per_gpu, "gpus": n_gpus,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv)}
    with open(os.path.join(out, "parity_runs.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print("\n| run | rc | seconds | tokens/s (median) | peak GiB |\n|---|---|---|---|---|")
    for label, r in report.items():
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] else "-"
        print(f"| {label} | {r['rc']} | {r['seconds']} | {tps} | {mem} |")
    if args.per_gpu > 1:
        print(f"(runs shared GPUs {args.per_gpu} at a time: tokens/s are not speed results)")
    return 0 if all(j.rc == 0 for j in jobs) else 1


# ----------------------------------------------------------------------------- compare


def _runs_in(dirs: List[str]) -> Dict[str, str]:
    """label -> run directory, from directories or ``parity-logs.tgz`` archives."""
    found = {}
    for d in dirs:
        if os.path.isfile(d) and tarfile.is_tarfile(d):
            tmp = tempfile.mkdtemp(prefix="parity-logs-")
            with tarfile.open(d) as tar:
                tar.extractall(tmp, filter="data")
            d = tmp
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(os.path.join(path, "metrics.csv")):
                found[name] = path
    return found


def _split(label: str) -> Tuple[str, int, bool]:
    resumed = label.endswith("-resumed")
    base = label[: -len("-resumed")] if resumed else label
    name, seed = base.rsplit("-s", 1)
    return name, int(seed), resumed


def plan_comparison(labels: List[str]) -> Tuple[List[str], List[Tuple[str, str]], List[Tuple[str, str]]]:
    """(ordered labels with the baseline first, gates, pairs) by the protocol's rules."""
    parsed = {lab: _split(lab) for lab in labels}
    seeds = sorted({s for _, s, _ in parsed.values()})
    plain = [lab for lab in labels if not parsed[lab][2]]
    softmax = [lab for lab in plain if parsed[lab][0] == "softmax"]
    baseline = (softmax or plain or labels)[0]
    order = [baseline] + [lab for lab in labels if lab != baseline]
    gates, pairs = [], []
    for lab, (name, seed, resumed) in parsed.items():
        if resumed:
            twin = _label(name, seed)
            if twin in parsed:
                gates.append((lab, twin))
            continue
        ref = REFERENCE_OF.get(name)
        if ref and _label(ref, seed) in parsed:
            gates.append((lab, _label(ref, seed)))
    for name in sorted({n for n, _, r in parsed.values() if not r and n not in REFERENCE_OF}):
        runs = [lab for lab in plain if parsed[lab][0] == name]
        if len(runs) > 1:
            first = min(runs, key=lambda lab: seeds.index(parsed[lab][1]))
            pairs += [(lab, first) for lab in runs if lab != first]
    return order, gates, pairs


def compare(args) -> int:
    from nemo_ssa.tools.compare import main as compare_main

    runs = _runs_in(args.logs)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in set(args.only)}
    if not runs:
        raise SystemExit(f"no run directories with metrics.csv under {args.logs}")
    order, gates, pairs = plan_comparison(list(runs))
    resumed = [g for g in gates if g[0].endswith("-resumed")]
    fused = [g for g in gates if not g[0].endswith("-resumed")]
    print(f"[parity] baseline {order[0]}; gates {fused or 'none'}; resume {resumed or 'none'}; "
          f"noise pairs {pairs or 'none'}", flush=True)
    common = ["--ema", str(args.ema), "--from-step", str(args.from_step)] + (["--common-range"] if args.common_range else [])
    rc = 0
    main_args = [f"{lab}={runs[lab]}" for lab in order if not lab.endswith("-resumed")]
    main_args += ["--out", args.out, "--title", args.title or f"114M parity ({', '.join(order)})"]
    main_args += [a for g in fused for a in ("--gate", f"{g[0]}={g[1]}")]
    main_args += [a for p in pairs for a in ("--pair", f"{p[0]}={p[1]}")]
    if fused:
        main_args += ["--max-delta", str(args.max_delta)]
    rc |= compare_main(main_args + common)
    for run, twin in resumed:
        out = os.path.join(args.out, "resume")
        print(f"\n[parity] resume check: {run} vs {twin} (rtol {GOLDEN_RTOL} per step, raw loss)", flush=True)
        rc |= compare_main([f"{twin}={runs[twin]}", f"{run}={runs[run]}", "--out", out, "--ema", "0",
                            "--rtol", str(GOLDEN_RTOL), "--title", f"resume check: {run} vs {twin}"])
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the runs on the visible GPUs (one device command)")
    t.add_argument("--runs", nargs="+", required=True, metavar="ATTENTION:SEED[:OVERRIDES]",
                   help="e.g. elsa_ssa:1234:policy=free,attention.options.num_partitions=2")
    t.add_argument("--resume-check", nargs="*", metavar="ATTENTION:SEED:STEP[:OVERRIDES]")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--out", required=True, help="where the small result files go (e.g. $OUT/parity)")
    t.add_argument("--scratch", default="/tmp/nemo-ssa-parity", help="run directories with checkpoints")
    t.add_argument("--per-gpu", type=int, default=1, help="runs sharing one GPU at a time")
    t.add_argument("--time-limit", type=float, default=560.0, help="kill runs still going after this many seconds")
    t.add_argument("--extra", nargs="*", help="more pretrain.py overrides for every run")
    t.add_argument("--stagger", type=float, default=40.0, help="seconds between run starts")
    t.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    c = sub.add_parser("compare", help="compare returned logs with the protocol's gates")
    c.add_argument("--logs", nargs="+", required=True, help="directories holding <attention>-s<seed>/metrics.csv")
    c.add_argument("--out", required=True)
    c.add_argument("--only", nargs="*", help="labels to include")
    c.add_argument("--ema", type=float, default=0.9)
    c.add_argument("--from-step", type=int, default=100)
    c.add_argument("--max-delta", type=float, default=0.05)
    c.add_argument("--common-range", action="store_true")
    c.add_argument("--title", default="")
    args = p.parse_args(argv)
    return train(args) if args.cmd == "train" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
