"""Megatron-LM's own loop (``python -m nemo_ssa.megatron.lm_pretrain``) on GPUs, megatron-core
0.19 (issue 42): the runs and gates of docs/results/2026-11-27-stack, one device command.

    python scripts/device/lm_loop_gpu.py --site /tmp/site19 --out $OUT/lm --budget 540

``--site``: a directory with megatron-core 0.19 (and the nemo_ssa wheel) installed, used alone
on ``PYTHONPATH`` (the image has torch, triton, transformers). Runs, ``--steps`` iterations each,
the README's Megatron-LM command with ``--log-interval 1`` and the embedded corpus:

1. ``ssa_triton`` on one GPU (``--spec nemo_ssa.megatron.block_specs ssa_triton``, the preset:
   the recipe's 114M model, fused MLP, layernorm1p; micro batch 32);
2. the softmax pair on GPU 0 and 1 side by side, both without ``--apply-layernorm-1p`` (which
   megatron's local final norm refuses): our ``softmax`` block spec, and megatron's own local
   layer (no ``--spec``: its ``DotProductAttention``, its MLP, its norms) -- the reference;
3. ``ssa_triton`` at DP2 with the same global batch (micro 16 x 2 = 32, so every step sees
   run 1's samples), saving at ``steps/2`` and exiting there (``--exit-interval``), then a
   second launch that loads it (``--load``) and runs to ``steps``.

Gates (``scripts/compare_losses.py``, EMA 0.9, from step 50, max |delta| 0.05): our softmax
against megatron's; the stopped + resumed DP2 curve against run 1. Losses are read from
megatron's iteration lines into ``<run>/metrics.csv`` (step, loss, segment). ``--out`` gets
table.md, each run's metrics and logs.tgz (the logs and compare summaries: the device returns
only a few files per call). Stops at the first run that fails (its log tail is printed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)")
NO_1P = "--apply-layernorm-1p"


def losses_from_log(text: str):
    """(step, loss) of every iteration line megatron printed (``--log-interval 1``)."""
    return [(int(m.group(1)), float(m.group(2))) for m in ITERATION.finditer(text)]


def write_metrics(run_dir: str, logs: List[str]) -> int:
    """metrics.csv from one or more launches' logs (segment = launch); returns the row count."""
    rows = []
    for seg, log in enumerate(logs, 1):
        if os.path.isfile(log):
            rows += [(s, v, seg) for s, v in losses_from_log(open(log, errors="replace").read())]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.csv"), "w") as f:
        f.write("step,loss,segment\n" + "".join(f"{s},{v},{g}\n" for s, v, g in rows))
    return len(rows)


def lm_command(world: int, *args: str, port: Optional[int] = None) -> List[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    launch += ["--standalone"] if port is None else ["--master-port", str(port)]
    return [*launch, "-m", "nemo_ssa.megatron.lm_pretrain", *args]


def _pack(out: str) -> None:
    """Logs and compare folders into one logs.tgz (the device returns few files per call);
    table.md and the metrics stay beside it."""
    import tarfile

    names = sorted(n for n in os.listdir(out) if n.endswith(".log") or n.startswith("cmp-"))
    if not names:
        return
    with tarfile.open(os.path.join(out, "logs.tgz"), "w:gz") as tar:
        for n in names:
            tar.add(os.path.join(out, n), arcname=n)
    for n in names:
        path = os.path.join(out, n)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True, help="site directory with megatron-core 0.19 (alone on PYTHONPATH)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scratch", default="/tmp/lm_loop_gpu")
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--extra", default="", help="arguments added to every launch (tests: a tiny shape)")
    args = ap.parse_args(argv)
    t0 = time.time()
    shutil.rmtree(args.scratch, ignore_errors=True)
    os.makedirs(args.scratch)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.path.abspath(args.site) if args.site else "") if p))
    extra = args.extra.split()
    common = ["--train-iters", str(args.steps), "--log-interval", "1", "--eval-interval", str(args.steps),
              "--eval-iters", "1", *extra]
    rows, failed = [], []

    def run(label: str, cmd: List[str], gpus: str) -> int:
        t = time.time()
        log = os.path.join(args.out, f"{label}.log")
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            p = subprocess.Popen(cmd, cwd=args.scratch, env=dict(env, CUDA_VISIBLE_DEVICES=gpus),
                                 stdout=f, stderr=subprocess.STDOUT)
            try:
                rc = p.wait(timeout=max(5, args.budget - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = 124
        rows.append((label, rc, time.time() - t))
        print(f"[lm] {label}: rc {rc} in {time.time() - t:.0f} s", flush=True)
        if rc != 0:
            failed.append(label)
            print("".join(open(log, errors="replace").readlines()[-40:]), flush=True)
        return rc

    ours = ["--spec", "nemo_ssa.megatron.block_specs"]
    from nemo_ssa.megatron.lm_pretrain import PRESETS

    no_1p = ["--preset", "none", *[a for a in PRESETS["nemotron-114m"] if a != NO_1P]]
    runs = {name: os.path.join(args.scratch, name) for name in
            ("ssa_triton", "softmax-no1p", "megatron-softmax-no1p", "ssa_triton-dp2-resume")}
    logs = {name: [os.path.join(args.out, f"{name}.log")] for name in runs}
    # 1. ssa_triton on one GPU: the first launch also builds the corpus; a failure stops here
    if run("ssa_triton", lm_command(1, *ours, "ssa_triton", *common), "0") == 0:
        # 2. the softmax pair, side by side on their own GPUs
        pair = [("softmax-no1p", lm_command(1, *no_1p, *ours, "softmax", *common, port=29611), "0"),
                ("megatron-softmax-no1p", lm_command(1, *no_1p, *common, port=29612), "1")]
        threads = [threading.Thread(target=run, args=p) for p in pair]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        # 3. DP2 at run 1's global batch: save at half and exit, then load and finish
        ck = os.path.join(runs["ssa_triton-dp2-resume"], "ck")
        dp2 = [*ours, "ssa_triton", *common, "--micro-batch-size", "16", "--global-batch-size", "32", "--save", ck,
               "--save-interval", str(args.steps // 2)]
        name = "ssa_triton-dp2-resume"
        logs[name] = [os.path.join(args.out, f"{name}-{i}.log") for i in range(2)]
        if run(f"{name}-0", lm_command(2, *dp2, "--exit-interval", str(args.steps // 2)), "0,1") == 0:
            run(f"{name}-1", lm_command(2, *dp2, "--load", ck), "0,1")
    counts = {name: write_metrics(runs[name], logs[name]) for name in runs}
    gates = []
    for title, ref, new in [("our softmax vs megatron's local softmax (no layernorm1p)",
                             "megatron-softmax-no1p", "softmax-no1p"),
                            ("ssa_triton DP2 stopped at half + resumed vs one GPU", "ssa_triton",
                             "ssa_triton-dp2-resume")]:
        if not (counts[ref] and counts[new]):
            gates.append((title, "no run"))
            continue
        out = os.path.join(args.out, f"cmp-{new}")
        rc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_losses.py"),
                             f"ref={runs[ref]}", f"new={runs[new]}", "--ema", "0.9", "--from-step",
                             str(min(50, args.steps // 4)), "--max-delta", "0.05", "--out", out, "--no-plot"],
                            cwd=REPO, env=env).returncode
        gates.append((title, "PASS" if rc == 0 else f"FAIL (rc {rc})"))
    for name, d in runs.items():
        if os.path.isfile(os.path.join(d, "metrics.csv")):
            shutil.copy2(os.path.join(d, "metrics.csv"), os.path.join(args.out, f"{name}-metrics.csv"))
    lines = ["| run | rc | s | logged steps |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c:.0f} | {counts.get(a.rsplit('-', 1)[0] if a[-2:] in ('-0', '-1') else a, '')} |"
              for a, b, c in rows]
    lines += ["", "| gate (EMA 0.9, max abs delta 0.05) | result |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in gates]
    text = "\n".join(lines)
    open(os.path.join(args.out, "table.md"), "w").write(text + "\n")
    _pack(args.out)
    print(text, flush=True)
    return 0 if not failed and all(g == "PASS" for _, g in gates) else 1


if __name__ == "__main__":
    sys.exit(main())
