"""The two-GPU runs of the parallel paths (DP2, TP2 + sequence parallel, CP2): train, bring
the small files back, check.

Step 1, on a 2-GPU machine (nvidia-h200-x2 or nvidia-h100-x2), two device commands of
under 9 minutes each (``.whl`` carried; docs/two-gpu.md has the whole call)::

    python scripts/two_gpu.py run --part dp --out $OUT/dp
    python scripts/two_gpu.py run --part tp_cp --out $OUT/tp_cp

Step 2, here, on what came back::

    python scripts/two_gpu.py check <files_at>/dp/two_gpu-dp.tgz <files_at>/tp_cp/two_gpu-tp_cp.tgz \\
        --out docs/results/<date>-two-gpu

``python scripts/two_gpu.py plan`` prints every command of both parts and runs nothing.

Every run is the 114M recipe through ``scripts/pretrain.py`` (local corpus, bf16, seq
1024, ``train=gpu_9min``), 300 steps, seed 1234, global batch 64 of micro batch 32: the
same per-GPU micro batch at every layout (weak scaling, as Megatron scales), so a 1-GPU
run accumulates 2 micro batches where DP2 runs one per rank. Two-rank runs are started by
``torchrun --nproc-per-node=2``. Each part trains its own 1-GPU reference in the same
command (the one it is judged against):

* ``dp``: ssa_triton and softmax on 1 GPU (side by side, one per GPU), then each at DP2.
* ``tp_cp``: ssa_triton at TP2 + sequence parallel to step 150 (checkpoint); then, side by
  side, the 1-GPU reference (GPU 0) and a copy of the TP2 run resumed on one GPU (GPU 1,
  steps 151-300); then the TP2 run resumed at TP2 to step 300; then ssa_triton at CP2.

The check (exit 1 if a gate fails; tables in ``<out>/two_gpu.md``):

* loss: each 2-GPU run against its part's 1-GPU run, EMA 0.9 curves from step 50, max |Δ|
  0.05 (scripts/parity.py's gate; the seed-to-seed band of this corpus is wider, 0.13 mean);
  the TP2 -> 1-GPU resume against the 1-GPU run with Megatron's golden rtol 0.05 per step;
* n: every rank's n per layer bit-identical at the end (``ranks/rank_*.json``, written by
  every rank), and the TP2 checkpoint's saved n equal to rank 0's;
* speed: DP2 tokens/s >= 1.8x its 1-GPU run (median step rate); TP2 and CP2 reported.

``--cpu-smoke`` runs the same plan on CPU (gloo, the tiny model, a few steps, no speed
gate): tests/scripts/test_two_gpu.py runs it, so the GPU command is not its first run.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

STEPS, STOP = 300, 150
SEED = 1234
GPU_COMMON = ["train=gpu_9min", f"train.max_steps={STEPS}", "train.micro_batch_size=32", "train.global_batch_size=64",
              "train.val_check_interval=150", "train.limit_val_batches=1", "compare_to=[]", f"seed={SEED}"]
CPU_STEPS, CPU_STOP = 6, 3
CPU_COMMON = [f"train.max_steps={CPU_STEPS}", "train.seq_length=32", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.log_every_n_steps=1", "model.cpu_arch.hidden_size=32",
              "model.cpu_arch.ffn_hidden_size=64", "data.vocab_size=512", "data.max_bytes=400000",
              "train.distributed_optimizer=auto", "compare_to=[]", f"seed={SEED}"]
KEEP = ("metrics.csv", "summary.json", "config.yaml", "complete.json", "cpu_run.json")
MAX_DELTA, EMA, FROM_STEP, GOLDEN_RTOL, DP_SPEEDUP = 0.05, 0.9, 50, 0.05, 1.8
REFERENCE_OF = {"ssa-dp2": "ssa-1gpu", "softmax-dp2": "softmax-1gpu", "ssa-tp2sp": "ssa-1gpu",
                "ssa-cp2": "ssa-1gpu"}
RESUMED = {"ssa-tp2to1": "ssa-1gpu"}


# ----------------------------------------------------------------------------- plan

class Job:
    """Launches run one after another in one run directory, on the GPUs in ``gpus``."""

    def __init__(self, label: str, launches: List[List[str]], gpus: str, copy_from: Optional[str] = None):
        self.label, self.launches, self.gpus, self.copy_from = label, launches, gpus, copy_from


def _pretrain(world: int, overrides: List[str]) -> List[str]:
    script = os.path.join(REPO, "scripts", "pretrain.py")
    if world == 1:
        return [sys.executable, script, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", script,
            f"train.num_gpus_per_node={world}", *overrides]


def plan(part: str, scratch: str, cpu: bool, extra: Sequence[str] = ()) -> List[List[Job]]:
    """Stages of jobs: the jobs of a stage run side by side, stages one after another."""
    common = (CPU_COMMON if cpu else GPU_COMMON) + list(extra)
    steps, stop = (CPU_STEPS, CPU_STOP) if cpu else (STEPS, STOP)
    ssa = "ssa" if cpu else "ssa_triton"  # on CPU `ssa` runs the reference kernel; same parameters

    def run(label, world, attention, *extra):
        return _pretrain(world, [f"attention={attention}", f"run_dir={os.path.join(scratch, label)}",
                                 *common, *extra])

    if part == "dp":
        return [
            [Job("ssa-1gpu", [run("ssa-1gpu", 1, ssa)], "0"),
             Job("softmax-1gpu", [run("softmax-1gpu", 1, "softmax")], "1")],
            [Job("ssa-dp2", [run("ssa-dp2", 2, ssa)], "0,1")],
            [Job("softmax-dp2", [run("softmax-dp2", 2, "softmax")], "0,1")],
        ]
    if part == "tp_cp":
        tp = ["train.tensor_parallel=2", "train.sequence_parallel=true"]
        first = [f"stop_after={stop}", f"train.ckpt_every_n_steps={stop}"]
        return [
            [Job("ssa-tp2sp", [run("ssa-tp2sp", 2, ssa, *tp, *first)], "0,1")],
            [Job("ssa-1gpu", [run("ssa-1gpu", 1, ssa)], "0"),
             Job("ssa-tp2to1", [run("ssa-tp2to1", 1, ssa, f"train.ckpt_every_n_steps={stop}", "resume=true")], "1",
                 copy_from="ssa-tp2sp")],
            [Job("ssa-tp2sp", [run("ssa-tp2sp", 2, ssa, *tp, f"train.ckpt_every_n_steps={stop}", "resume=true")],
                 "0,1")],
            [Job("ssa-cp2", [run("ssa-cp2", 2, ssa, "train.context_parallel=2")], "0,1")],
        ]
    raise SystemExit(f"unknown part {part!r}: dp or tp_cp")


PARTS = ("dp", "tp_cp")


# ----------------------------------------------------------------------------- run

def _checkpoint_of(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint of a run: NeMo's ``-last`` (GPU) or the CPU loop's."""
    from nemo_ssa.megatron.checkpoints import nemo_resume_checkpoint
    from nemo_ssa.nemo.cpu_loop import latest_checkpoint

    for d in sorted(glob.glob(os.path.join(run_dir, "*", "checkpoints"))):
        found = nemo_resume_checkpoint(d)
        if found:
            return found
    return latest_checkpoint(os.path.join(run_dir, "checkpoints"))


def _collect(run_dir: str, dest: str, log: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for name in KEEP:
        if os.path.isfile(os.path.join(run_dir, name)):
            shutil.copy2(os.path.join(run_dir, name), os.path.join(dest, name))
    if os.path.isdir(os.path.join(run_dir, "ranks")):
        shutil.copytree(os.path.join(run_dir, "ranks"), os.path.join(dest, "ranks"), dirs_exist_ok=True)
    if os.path.isfile(log):
        shutil.copy2(log, os.path.join(dest, "launch.log"))
    ckpt = _checkpoint_of(run_dir)
    if ckpt:
        from nemo_ssa.megatron.checkpoints import read_ssa_scalars

        try:
            vals = read_ssa_scalars(ckpt)
            with open(os.path.join(dest, "ckpt_ssa.json"), "w") as f:
                json.dump({"checkpoint": ckpt, "n": {str(k): v for k, v in vals["n"].items()},
                           "b": {str(k): v for k, v in vals["b"].items()}}, f, indent=1)
        except Exception as e:  # noqa: BLE001 -- recorded, the check reports it
            with open(os.path.join(dest, "ckpt_ssa.json"), "w") as f:
                json.dump({"checkpoint": ckpt, "error": f"{type(e).__name__}: {e}"}, f)


def run(args) -> int:
    out = os.path.abspath(args.out)
    scratch = os.path.abspath(args.scratch or os.path.join(tempfile.gettempdir(), f"two_gpu_{args.part}"))
    if os.path.isdir(scratch):
        shutil.rmtree(scratch)
    os.makedirs(scratch)
    os.makedirs(out, exist_ok=True)
    data_dir = args.data_dir or (os.path.join(scratch, "corpus") if args.cpu_smoke else None)
    stages = plan(args.part, scratch, args.cpu_smoke, [f"data.dir={data_dir}"] if data_dir else [])
    t_start = time.time()
    deadline = t_start + args.budget
    table: List[Tuple[str, int, float]] = []
    env_base = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    _prepare_corpus(args.cpu_smoke, data_dir)
    for stage in stages:
        procs = []
        for job in stage:
            if job.copy_from:
                shutil.copytree(os.path.join(scratch, job.copy_from), os.path.join(scratch, job.label),
                                dirs_exist_ok=True)
                # the copy is its own run: its rank files must come from its own launch
                shutil.rmtree(os.path.join(scratch, job.label, "ranks"), ignore_errors=True)
            env = dict(env_base)
            if not args.cpu_smoke:
                env["CUDA_VISIBLE_DEVICES"] = job.gpus
            procs.append((job, env))
        running = []
        for job, env in procs:
            log = os.path.join(out, f"{job.label}.log")
            running.append((job, env, log, _start(job, env, log)))
        for job, env, log, proc in running:
            rc, seconds = _wait(job, env, log, proc, deadline)
            table.append((job.label, rc, seconds))
            print(f"[two_gpu] {job.label}: rc {rc} in {seconds:.0f} s", flush=True)
    for label in sorted({j.label for stage in stages for j in stage}):
        _collect(os.path.join(scratch, label), os.path.join(out, label), os.path.join(out, f"{label}.log"))
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump({"part": args.part, "cpu_smoke": args.cpu_smoke, "seconds": time.time() - t_start,
                   "jobs": [{"label": lab, "rc": rc, "seconds": s} for lab, rc, s in table],
                   "plan": [[{"label": j.label, "gpus": j.gpus, "launches": j.launches} for j in st] for st in stages]},
                  f, indent=1)
    tgz = os.path.join(out, f"two_gpu-{args.part}.tgz")
    with tarfile.open(tgz, "w:gz") as tar:
        for name in sorted(os.listdir(out)):
            if not name.endswith(".tgz"):
                tar.add(os.path.join(out, name), arcname=name)
    for name in os.listdir(out):  # the device tool returns few files: keep the archive
        path = os.path.join(out, name)
        if not name.endswith(".tgz") and name != "runs.json":
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    print("\n| job | rc | s |\n|---|---|---|")
    for lab, rc, s in table:
        print(f"| {lab} | {rc} | {s:.0f} |")
    print(f"[two_gpu] part {args.part}: {time.time() - t_start:.0f} s; logs in {tgz}", flush=True)
    return 0 if all(rc == 0 for _, rc, _ in table) else 1


def _prepare_corpus(cpu: bool, data_dir: Optional[str]) -> None:
    """Build the embedded corpus once, before side-by-side runs would race to build it."""
    from omegaconf import OmegaConf

    from nemo_ssa.data import build_corpus, default_corpus_dir

    data = OmegaConf.load(os.path.join(REPO, "configs", "data", "stdlib.yaml"))
    kw = dict(vocab_size=512, max_bytes=400_000) if cpu else dict(vocab_size=int(data.vocab_size),
                                                                   max_bytes=data.get("max_bytes"))
    build_corpus(data_dir or data.get("dir") or default_corpus_dir(), source=data.source, quiet=True, **kw)


def _start(job: Job, env: Dict[str, str], log: str):
    """Start the job's launches as one shell chain (the next starts when the last ends)."""
    import shlex

    chain = " && ".join(" ".join(shlex.quote(a) for a in cmd) for cmd in job.launches)
    f = open(log, "a")
    f.write(f"$ {chain}\n")
    f.flush()
    return subprocess.Popen(["bash", "-c", chain], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True), f, time.time()


def _wait(job, env, log, started, deadline) -> Tuple[int, float]:
    import signal

    proc, f, t0 = started
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = 124
        f.write(f"\n[two_gpu] killed at the budget\n")
    f.close()
    return rc, time.time() - t0


# ----------------------------------------------------------------------------- check

def _unpack(paths: Sequence[str], into: str) -> Dict[str, str]:
    """{label: run dir} of every returned part (a .tgz or a directory); a label seen in two
    parts (each part has its own ssa-1gpu) is prefixed with the part."""
    runs: Dict[str, Dict[str, str]] = {}
    for i, path in enumerate(paths):
        if path.endswith(".tgz"):
            dest = os.path.join(into, f"part{i}")
            with tarfile.open(path) as tar:
                tar.extractall(dest)
            path = dest
        meta = os.path.join(path, "runs.json")
        part = json.load(open(meta))["part"] if os.path.isfile(meta) else f"part{i}"
        runs[part] = {d: os.path.join(path, d) for d in sorted(os.listdir(path))
                      if os.path.isfile(os.path.join(path, d, "metrics.csv"))}
    return runs


def _rate(run_dir: str) -> Optional[float]:
    """Median tokens/s: summary.json's (NeMo, rank 0), else metrics.csv's after 10 steps."""
    s = os.path.join(run_dir, "summary.json")
    if os.path.isfile(s):
        v = json.load(open(s)).get("tokens_per_s_median")
        if v:
            return float(v)
    rates = [float(r["tokens_per_s"]) for r in csv.DictReader(open(os.path.join(run_dir, "metrics.csv")))
             if r.get("tokens_per_s") not in (None, "", "nan")]
    rates = rates[10:] or rates
    return statistics.median(rates) if rates else None


def check_ranks(run_dir: str) -> Tuple[bool, str]:
    """Every rank's n (and b) per layer bit-identical; the checkpoint's n equal to rank 0's."""
    files = sorted(glob.glob(os.path.join(run_dir, "ranks", "rank_*.json")))
    if not files:
        return False, "no ranks/rank_*.json"
    recs = [json.load(open(f)) for f in files]
    world = recs[0].get("world_size", 1)
    if len(recs) != world:
        return False, f"{len(recs)} rank files for world size {world}"
    if not recs[0]["n"]:
        return True, f"{world} rank(s), no SSA layers"
    bad = [r["rank"] for r in recs if r["n"] != recs[0]["n"] or r["b"] != recs[0]["b"]]
    if bad:
        layer = next(k for k in recs[0]["n"] if any(r["n"].get(k) != recs[0]["n"][k] for r in recs))
        vals = ", ".join(f"rank {r['rank']} (tp {r.get('tp_rank')}) {float.fromhex(r['n'][layer]):.9g}" for r in recs)
        return False, f"n differs between ranks: layer {layer}: {vals}"
    msg = f"{world} rank(s) identical ({len(recs[0]['n'])} layers, e.g. n_1 = {float.fromhex(recs[0]['n']['1']):.6f})"
    ck = os.path.join(run_dir, "ckpt_ssa.json")
    if os.path.isfile(ck):
        saved = json.load(open(ck))
        if "error" in saved:
            return False, msg + f"; checkpoint unreadable: {saved['error']}"
        diff = [k for k, v in recs[0]["n"].items() if saved["n"].get(k) != float.fromhex(v)]
        if diff:
            return False, msg + f"; checkpoint n differs from rank 0's at layers {diff}"
        msg += "; checkpoint n = rank 0's"
    return True, msg


def check(args) -> int:
    from nemo_ssa.compare import main as compare_main

    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="two_gpu_check_")
    parts = _unpack(args.logs, tmp)
    rows, ok = [], True

    def gate(name, passed, detail):
        nonlocal ok
        ok &= bool(passed)
        rows.append((name, "PASS" if passed else "FAIL", detail))

    for part, runs in parts.items():
        for run_label, ref_label in REFERENCE_OF.items():
            if run_label not in runs:
                continue
            if ref_label not in runs:
                gate(f"{part}: {run_label} loss", False, f"no {ref_label} in this part")
                continue
            out = os.path.join(args.out, part, f"{run_label}_vs_{ref_label}")
            rc = compare_main([f"{ref_label}={runs[ref_label]}", f"{run_label}={runs[run_label]}",
                               "--gate", f"{run_label}={ref_label}", "--max-delta", str(args.max_delta),
                               "--ema", str(EMA), "--from-step", str(args.from_step), "--out", out,
                               "--title", f"{run_label} vs {ref_label} ({part})"] + (["--no-plot"] if args.no_plot else []))
            gate(f"{part}: {run_label} loss vs {ref_label}", rc == 0,
                 f"EMA {EMA}, steps >= {args.from_step}, max |Δ| <= {args.max_delta}; {out}/summary.md")
        for run_label, ref_label in RESUMED.items():
            if run_label in runs and ref_label in runs:
                out = os.path.join(args.out, part, f"{run_label}_resume")
                rc = compare_main([f"{ref_label}={runs[ref_label]}", f"{run_label}={runs[run_label]}",
                                   "--gate", f"{run_label}={ref_label}", "--rtol", str(GOLDEN_RTOL), "--ema", "0",
                                   "--out", out, "--title", f"TP2 checkpoint resumed on 1 GPU vs {ref_label}"]
                                  + (["--no-plot"] if args.no_plot else []))
                segs = sorted({r.get("segment") for r in csv.DictReader(open(os.path.join(runs[run_label], "metrics.csv")))})
                gate(f"{part}: {run_label} resume", rc == 0 and len(segs) >= 2,
                     f"raw loss, rtol {GOLDEN_RTOL} per step; {len(segs)} segment(s) in its metrics.csv")
        for label, run_dir in runs.items():
            if label.endswith("1gpu") and label != "ssa-tp2to1":
                continue
            passed, detail = check_ranks(run_dir)
            gate(f"{part}: {label} n on every rank", passed, detail)
        for label, run_dir in runs.items():
            ref = REFERENCE_OF.get(label)
            if ref is None or ref not in runs:
                continue
            r, r1 = _rate(run_dir), _rate(runs[ref])
            ratio = (r / r1) if (r and r1) else None
            detail = f"{r or float('nan'):,.0f} vs {r1 or float('nan'):,.0f} tokens/s ({ratio or float('nan'):.2f}x)"
            if label.endswith("dp2") and not args.no_speed_gate:
                gate(f"{part}: {label} speed >= {DP_SPEEDUP}x", ratio is not None and ratio >= DP_SPEEDUP, detail)
            else:
                rows.append((f"{part}: {label} speed", "reported", detail))
    lines = ["| check | result | detail |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "two_gpu.md"), "w") as f:
        f.write(f"# Two-GPU check\n\n`python scripts/two_gpu.py check {' '.join(args.logs)}`\n\n{text}\n")
    print(text)
    shutil.rmtree(tmp, ignore_errors=True)
    if not rows:
        print("[two_gpu] nothing to check: no run directories with metrics.csv", file=sys.stderr)
        return 2
    print(f"[two_gpu] {'all gates passed' if ok else 'a gate FAILED'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train one part (on the 2-GPU machine)")
    r.add_argument("--part", choices=PARTS, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--scratch", default=None, help="run directories and checkpoints (default: a temp dir)")
    r.add_argument("--budget", type=float, default=500.0, help="seconds for the whole part (jobs killed at it)")
    r.add_argument("--cpu-smoke", action="store_true", help="the same plan on CPU: tiny model, gloo, few steps")
    r.add_argument("--data-dir", default=None, help="corpus directory (default: the config's; --cpu-smoke: in scratch)")
    p = sub.add_parser("plan", help="print the commands of every part, run nothing")
    p.add_argument("--cpu-smoke", action="store_true")
    c = sub.add_parser("check", help="gate the returned logs")
    c.add_argument("logs", nargs="+", help="two_gpu-<part>.tgz files or unpacked part directories")
    c.add_argument("--out", required=True)
    c.add_argument("--max-delta", type=float, default=MAX_DELTA)
    c.add_argument("--from-step", type=int, default=FROM_STEP)
    c.add_argument("--no-speed-gate", action="store_true", help="report DP2's speed-up without gating it (CPU)")
    c.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        for part in PARTS:
            print(f"## part {part}")
            for i, stage in enumerate(plan(part, "<scratch>", args.cpu_smoke), 1):
                for job in stage:
                    for cmd in job.launches:
                        gpus = "" if args.cpu_smoke else f"CUDA_VISIBLE_DEVICES={job.gpus} "
                        copy = f"(copy of {job.copy_from}'s run dir) " if job.copy_from else ""
                        print(f"stage {i} {job.label}: {copy}{gpus}{' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}")
        return 0
    return run(args) if args.cmd == "run" else check(args)


if __name__ == "__main__":
    sys.exit(main())
