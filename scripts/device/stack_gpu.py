"""The stack check on GPUs (issue 42): the README main job through NeMo on each megatron-core
the project supports, and a two-rank save + resume, in one device command.

Each *stack* is a folder of wheels installed over the offline bundle (``.whl``) into its
own site directory, first on ``PYTHONPATH`` for that stack's runs (``--stack 0.16.1=.whl16``);
the bundle alone is megatron-core 0.15.3. On every stack, for each attention, the main job
(``scripts/pretrain.py attention=A compare_to=[] train.max_steps=STEPS``, fused MLP on, the
recipe's micro batch 32) runs on one GPU, the stacks side by side on their own GPUs; then a
DP2 run of the last stack stops at step STEPS/2 (checkpoint) and resumes. Finally each
stack's curves are gated against the first stack's (EMA 0.9, max |Δ| 0.05 from step 50)
with ``scripts/compare_losses.py`` and a table is printed::

    python scripts/device/stack_gpu.py --stack 0.15.3= --stack 0.16.1=.whl16 --out $OUT/stack
    python scripts/device/stack_gpu.py --entry core --stack 0.15.3= --stack 0.19.2=.whl19 --bare 0.19.2 --out $OUT/core

``--entry core`` runs ``scripts/train_megatron_core.py`` (plain megatron-core, no NeMo: the
path a megatron-core 0.17-0.19 stack has) at the recipe's shape (12 layers, hidden 768, 24
heads, 8 groups, seq 1024, micro batch 8, fused MLP on; vocabulary 1024, so that its
synthetic next-token task is learnt within 200 steps and curves can be compared), its checkpoint save at
half the run and resume in the DP2 stage. ``--bare NAME``: that stack's site alone on
``PYTHONPATH``, without the bundle (megatron-core 0.19 needs none of NeMo's packages, and
the bundle's nvidia-resiliency-ext 0.4.1 breaks 0.19's dist_checkpointing import).

Everything small comes back in ``--out`` (metrics, logs, compare summaries, table.md).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _site(name: str, wheels: str, scratch: str) -> str:
    """A site directory with the stack's wheels ('' = the bundle as it is)."""
    if not wheels:
        return ""
    site = os.path.join(scratch, f"site-{name}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", site, *glob.glob(os.path.join(REPO, wheels, "*.whl"))], check=True)
    return site


_BARE: set = set()  # sites used without the bundle's PYTHONPATH


def _env(site: str, gpus: str) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if site in _BARE:
        env["PYTHONPATH"] = site
    elif site:
        env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


CORE_SHAPE = ["--layers", "12", "--hidden", "768", "--heads", "24", "--groups", "8", "--seq", "1024",
              "--batch", "8", "--vocab", "1024", "--lr", "3e-4", "--fused-mlp", "true"]


def _core(run_dir: str, attention: str, steps: int, *extra, world: int = 1):
    """scripts/train_megatron_core.py at the recipe's shape, its losses into run_dir/metrics.csv."""
    script = os.path.join(REPO, "scripts", "train_megatron_core.py")
    launch = [sys.executable, script] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", script]
    os.makedirs(run_dir, exist_ok=True)
    tag = len([f for f in os.listdir(run_dir) if f.startswith("losses")])
    return [*launch, "--attention", attention, "--steps", str(steps), *CORE_SHAPE,
            "--out", os.path.join(run_dir, f"losses{tag}.json"), *extra]


def _core_metrics(run_dir: str) -> None:
    """losses*.json (one per launch) -> metrics.csv with segments, for compare_losses."""
    import json

    rows = []
    for seg, f in enumerate(sorted(glob.glob(os.path.join(run_dir, "losses*.json"))), 1):
        d = json.load(open(f))
        rows += [(d.get("first_step", 1) + i, loss, seg) for i, loss in enumerate(d["losses"])]
    if rows:
        with open(os.path.join(run_dir, "metrics.csv"), "w") as out:
            out.write("step,loss,segment\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))


def _pretrain(*overrides, world: int = 1):
    # graphs off on every stack: model.cuda_graphs=auto takes them on megatron-core 0.15 only,
    # and stacks compared with graphs on one and not the other would not compare like with like
    script = os.path.join(REPO, "scripts", "pretrain.py")
    overrides = ("model.cuda_graphs=none", *overrides)
    if world == 1:
        return [sys.executable, script, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", script,
            f"train.num_gpus_per_node={world}", *overrides]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", action="append", required=True, help="NAME=WHEEL_DIR ('' = the bundle alone)")
    ap.add_argument("--attentions", default="ssa_triton,softmax")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scratch", default="/tmp/stack_gpu")
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--entry", choices=("nemo", "core"), default="nemo",
                    help="nemo: scripts/pretrain.py (the README main job); core: scripts/train_megatron_core.py")
    ap.add_argument("--bare", action="append", default=[], help="a stack run with its own site alone")
    args = ap.parse_args(argv)
    t0 = time.time()
    stacks = [s.split("=", 1) for s in args.stack]
    shutil.rmtree(args.scratch, ignore_errors=True)
    os.makedirs(args.scratch)
    os.makedirs(args.out, exist_ok=True)
    sites = {name: _site(name, wheels, args.scratch) for name, wheels in stacks}
    _BARE.update(sites[name] for name in args.bare)
    for name, site in sites.items():
        probe = subprocess.run([sys.executable, "-c", "import megatron.core as m, torch, triton; "
                                "print(m.__version__, torch.__version__, triton.__version__)"],
                               env=_env(site, "0"), capture_output=True, text=True)
        print(f"[stack] {name}: megatron-core, torch, triton = {probe.stdout.strip() or probe.stderr[-500:]}",
              flush=True)
    common = [f"train.max_steps={args.steps}", "train.val_check_interval=100", "train.limit_val_batches=1",
              "compare_to=[]", "seed=1234", "model.init_on_cpu=true"]
    runs, rows = {}, []

    def run_one(label, cmd, site, gpus, row):
        """One launch, logged to --out, killed at the budget (rc 124); its row in the table."""
        t = time.time()
        with open(os.path.join(args.out, f"{label}.log"), "w") as log:
            p = subprocess.Popen(cmd, cwd=REPO, env=_env(site, gpus), stdout=log, stderr=subprocess.STDOUT)
            try:
                rc = p.wait(timeout=max(5, args.budget - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = 124
        rows.append((row, rc, time.time() - t))
        print(f"[stack] {row}: rc {rc} in {time.time() - t:.0f} s", flush=True)

    # stage 1: every stack on its own GPU, its attentions one after another
    lanes = []
    for gpu, (name, _) in enumerate(stacks):
        chain = []
        for att in args.attentions.split(","):
            label = f"{name}-{att}"
            runs[label] = os.path.join(args.scratch, label)
            chain.append((label, _pretrain(f"attention={att}", f"run_dir={runs[label]}", *common)
                          if args.entry == "nemo" else _core(runs[label], att, args.steps)))
        lanes.append((name, str(gpu), chain))

    def run_lane(name, gpu, chain):
        for label, cmd in chain:
            run_one(label, cmd, sites[name], gpu, label)

    import threading

    threads = [threading.Thread(target=run_lane, args=lane) for lane in lanes]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # stage 2: DP2 on the last stack, stopped at half the run with a checkpoint, then resumed
    name = stacks[-1][0]
    label = f"{name}-dp2-resume"
    runs[label] = os.path.join(args.scratch, label)
    att = args.attentions.split(",")[0]
    half = args.steps // 2
    ck = os.path.join(runs[label], "checkpoints")
    for i, extra in enumerate([(f"stop_after={half}", f"train.ckpt_every_n_steps={half}"),
                               ("resume=true", f"train.ckpt_every_n_steps={half}")]):
        if args.entry == "nemo":
            cmd = _pretrain(f"attention={att}", f"run_dir={runs[label]}", *common, *extra, world=2)
        else:  # the first launch saves at half and stops there; the second loads and finishes
            cmd = _core(runs[label], att, half, "--save", ck, world=2) if i == 0 else \
                _core(runs[label], att, args.steps, "--load", ck, world=2)
        run_one(f"{label}-{i}", cmd, sites[name], "0,1", f"{label} ({'stop' if i == 0 else 'resume'})")
    if args.entry == "core":
        for d in runs.values():
            _core_metrics(d)
    # gates: each stack's curve against the first stack's, same attention
    gates = []
    base = stacks[0][0]
    pairs = [(f"{name} {att} vs {base}", runs[f"{base}-{att}"], runs[f"{name}-{att}"])
             for name, _ in stacks[1:] for att in args.attentions.split(",")]
    pairs.append((f"{label} (stopped + resumed) vs {name} {att} on one GPU", runs[f"{name}-{att}"], runs[label]))
    for title, ref, new in pairs:
        if not (os.path.isfile(os.path.join(ref, "metrics.csv")) and os.path.isfile(os.path.join(new, "metrics.csv"))):
            gates.append((title, "no run"))
            continue
        out = os.path.join(args.out, "cmp-" + os.path.basename(new))
        rc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_losses.py"),
                             f"ref={ref}", f"new={new}", "--ema", "0.9", "--from-step", "50",
                             "--max-delta", "0.05", "--out", out, "--no-plot"], cwd=REPO).returncode
        gates.append((title, "PASS" if rc == 0 else f"FAIL (rc {rc})"))
    for label, d in runs.items():
        for f in ("metrics.csv", "summary.json"):
            if os.path.isfile(os.path.join(d, f)):
                shutil.copy2(os.path.join(d, f), os.path.join(args.out, f"{label}-{f}"))
    lines = ["| run | rc | s |", "|---|---|---|"] + [f"| {a} | {b} | {c:.0f} |" for a, b, c in rows]
    lines += ["", "| gate (EMA 0.9, max abs delta 0.05 from step 50) | result |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in gates]
    text = "\n".join(lines)
    open(os.path.join(args.out, "table.md"), "w").write(text + "\n")
    print(text, flush=True)
    ok = all(rc == 0 for _, rc, _ in rows) and all(g == "PASS" for _, g in gates)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
