"""What ``model.cuda_graphs=auto`` (the launcher's default) rests on: the checks that make it ``local``.

``auto`` is ``local`` only where these passed (nemo_ssa.config.check.resolve_cuda_graphs: one
GPU and megatron-core 0.15 so far; the DP 2 check widens it to data parallel once it passes).
One device command (two GPUs: ``nvidia-h200-x2``; on one GPU the DP 2 check is "not run")::

    python scripts/device/graphs_default.py --out $OUT

The measured speed-up and ssa_triton's 1,000-step parity are in
docs/results/2026-11-29-cuda-graphs-nemo; the default also runs resumed and data parallel,
which had not run with graphs. Three checks, each PASS / FAIL in ``{out}/graphs-default.md``:

1. **softmax_triton parity**: the NeMo main job at micro batch 32, 1,000 steps, without and with
   graphs (at once: one run per GPU, or both on one GPU -- ~10 GiB each; tokens/s are then
   the shared GPU's), ``compare_losses.py --ema 0.9 --max-delta 0.05``; tokens/s
   of both.
2. **resume with graphs**: ssa_triton, 60 steps, a checkpoint every 20 and a validation every 20;
   the run is killed (SIGKILL, as a device call's end kills) once it has logged step 45, then
   relaunched with ``resume=true``. PASS when the first re-done step's loss equals the killed
   run's to the last digit (the forward of the same weights on the same batch), the run reaches
   step 60, and the held-out steps are 20, 40, 60 (the checkpoint at 40 is one Lightning saves
   before counting the batch: ``ResumeCadenceCallback`` keeps the cadence, e89e1da).
3. **data parallel 2 with graphs**: the README's two-GPU line (``torchrun --nproc-per-node=2``),
   100 steps without and with graphs; loss parity as in 1.

Each run's directory is under ``--out`` (the session archive leaves checkpoints out). Checks run
in order (1's two runs at once); ~450 s on two H200s; ``--only`` picks some.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "scripts", "pretrain.py")
COMPARE = os.path.join(REPO, "scripts", "compare_losses.py")

#: the resume check: steps, checkpoint / validation interval, the step after which the run is killed
RESUME_STEPS, RESUME_EVERY, KILL_AFTER = 60, 20, 45


def pretrain_args(run_dir: str, attention: str, graphs: str, *extra: str) -> List[str]:
    """The README main job's overrides for one run of a check."""
    return [f"attention={attention}", "compare_to=[]", "train=gpu_9min", f"model.cuda_graphs={graphs}",
            f"run_dir={run_dir}", *extra]


def read_rows(run_dir: str) -> List[Dict[str, str]]:
    path = os.path.join(run_dir, "metrics.csv")
    return list(csv.DictReader(open(path))) if os.path.isfile(path) else []


def last_step(run_dir: str) -> int:
    """The last step metrics.csv logged (-1 before any; a row still being written is skipped)."""
    steps = [-1]
    for r in read_rows(run_dir):
        try:
            steps.append(int(r["step"]))
        except (TypeError, ValueError):
            continue
    return max(steps)


def heldout_steps(run_dir: str) -> List[int]:
    path = os.path.join(run_dir, "heldout.csv")
    return sorted({int(r["step"]) for r in csv.DictReader(open(path))}) if os.path.isfile(path) else []


def resume_verdict(run_dir: str, steps: int = RESUME_STEPS, every: int = RESUME_EVERY) -> Dict[str, object]:
    """PASS / FAIL of the resume check from the run's metrics.csv (segments 1 and 2) and heldout.csv."""
    rows = read_rows(run_dir)
    seg = {}
    for r in rows:
        seg.setdefault(r.get("segment", "1"), {})[int(r["step"])] = r["loss"]
    first, second = seg.get("1", {}), seg.get("2", {})
    redo = min(second) if second else None
    reasons = []
    if redo is None:
        reasons.append("no resumed segment in metrics.csv")
    elif redo not in first:
        reasons.append(f"the resumed run's first step {redo} is not in the killed run's rows")
    elif first[redo] != second[redo]:
        reasons.append(f"step {redo}: loss {second[redo]} resumed vs {first[redo]} killed")
    last = max(second) if second else max(first, default=0)
    if last != steps:
        reasons.append(f"ended at step {last}, not {steps}")
    if summary(run_dir).get("cuda_graphs_captured") is not True:
        reasons.append("the resumed run captured no CUDA graphs (summary.json)")
    want = list(range(every, steps + 1, every))
    got = heldout_steps(run_dir)
    if got != want:
        reasons.append(f"held-out at {got}, expected {want}")
    return {"check": "resume with graphs", "result": "FAIL" if reasons else "PASS",
            "detail": "; ".join(reasons) or f"step {redo} re-done to the last digit ({second[redo]}), "
                                            f"held-out at {got}"}


def summary(run_dir: str) -> Dict:
    path = os.path.join(run_dir, "summary.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def tokens_per_s(run_dir: str) -> Optional[float]:
    return summary(run_dir).get("tokens_per_s_median")


def parity(out: str, name: str, none_dir: str, local_dir: str, py: str = sys.executable) -> Dict[str, object]:
    """compare_losses.py's gate of ``local`` against ``none`` (EMA 0.9, 0.05) and both runs' tokens/s."""
    cmp_out = os.path.join(out, f"{name}-parity")
    proc = subprocess.run([py, COMPARE, f"graphs_none={none_dir}", f"graphs_local={local_dir}", "--baseline",
                           "graphs_none", "--ema", "0.9", "--max-delta", "0.05", "--out", cmp_out],
                          capture_output=True, text=True)
    rates = [tokens_per_s(d) for d in (none_dir, local_dir)]
    speed = (f"; tokens/s {rates[0]:,.0f} -> {rates[1]:,.0f} ({rates[1] / rates[0]:.2f}x)"
             if all(rates) else "; tokens/s missing")
    gate = [ln for ln in proc.stdout.splitlines() if ln.startswith("| graphs_local | graphs_none")]
    # the graphed run must have captured graphs, the other not: equal losses prove nothing otherwise
    captured = [summary(d).get("cuda_graphs_captured") for d in (none_dir, local_dir)]
    ok = proc.returncode == 0 and captured == [False, True]
    return {"check": name, "result": "PASS" if ok else "FAIL",
            "detail": (gate[0] if gate else proc.stdout[-300:] + proc.stderr[-300:]).strip() + speed
                      + f"; graphs captured none / local: {captured[0]} / {captured[1]}"}


def launch(args: List[str], log: str, gpus: Optional[str], torchrun: int = 0) -> subprocess.Popen:
    """A pretrain launch (``torchrun`` ranks when >0) with its output in ``log``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    cmd = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}", PRETRAIN] if torchrun
           else [sys.executable, PRETRAIN]) + args
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def kill_after(proc: subprocess.Popen, run_dir: str, step: int, timeout: float, poll: float = 1.0) -> bool:
    """SIGKILL ``proc``'s process group once metrics.csv has a row at ``step`` or later; False if it
    ended first or ``timeout`` passed."""
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        if last_step(run_dir) >= step:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(poll)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return False


def check_softmax_triton(out: str, gpus: Sequence[str], steps: int, start: Callable = launch) -> List[Dict]:
    dirs = {g: os.path.join(out, f"softmax_triton-{g}") for g in ("none", "local")}
    procs = []
    for i, g in enumerate(("none", "local")):
        p = start(pretrain_args(dirs[g], "softmax_triton", g, f"train.max_steps={steps}"),
                  os.path.join(out, f"softmax_triton-{g}.log"), gpus[i % len(gpus)] if gpus else None)
        procs.append(p)
    for p in procs:
        p.wait()
    return [parity(out, "softmax_triton parity", dirs["none"], dirs["local"])]


def start_resume(out: str, gpu: Optional[str], start: Callable = launch, graphs: str = "local"):
    run_dir = os.path.join(out, f"resume-{graphs}")
    extra = (f"train.max_steps={RESUME_STEPS}", f"train.ckpt_every_n_steps={RESUME_EVERY}",
             f"train.val_check_interval={RESUME_EVERY}", "train.log_every_n_steps=1")
    return run_dir, start(pretrain_args(run_dir, "ssa_triton", graphs, *extra), run_dir + ".log", gpu), extra


def finish_resume(out: str, run_dir: str, proc, extra, gpu: Optional[str], start: Callable = launch,
                  timeout: float = 240, graphs: str = "local") -> List[Dict]:
    check = "resume with graphs" + ("" if graphs == "local" else f" ({graphs})")
    if not kill_after(proc, run_dir, KILL_AFTER, timeout):
        return [{"check": check, "result": "FAIL",
                 "detail": f"the first launch ended or timed out before step {KILL_AFTER} "
                           f"(see {os.path.basename(run_dir)}.log)"}]
    start(pretrain_args(run_dir, "ssa_triton", graphs, *extra, "resume=true"), run_dir + ".log", gpu).wait()
    return [dict(resume_verdict(run_dir), check=check)]


def check_dp2(out: str, steps: int, start: Callable = launch) -> List[Dict]:
    dirs = {g: os.path.join(out, f"dp2-{g}") for g in ("none", "local")}
    for g in ("none", "local"):
        start(pretrain_args(dirs[g], "ssa_triton", g, "train.num_gpus_per_node=2", f"train.max_steps={steps}"),
              dirs[g] + ".log", None, torchrun=2).wait()
    return [parity(out, "data parallel 2 parity", dirs["none"], dirs["local"])]


def table(rows: Sequence[Dict]) -> str:
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {r['check']} | {r['result']} | {str(r['detail']).replace('|', '/')} |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="softmax_triton,resume,dp2", help="comma list of softmax_triton, resume, dp2")
    ap.add_argument("--parity-steps", type=int, default=1000)
    ap.add_argument("--dp2-steps", type=int, default=100)
    ap.add_argument("--resume-graphs", choices=("local", "full"), default="local",
                    help="the graphs of the resume check (full: megatron's whole-iteration graph, opt-in)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    unknown = only - {"softmax_triton", "resume", "dp2"}
    if unknown:
        raise SystemExit(f"[graphs-default] --only {sorted(unknown)}: the checks are softmax_triton, resume, dp2")
    os.makedirs(args.out, exist_ok=True)
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        raise SystemExit("[graphs-default] needs CUDA (model.cuda_graphs=local is refused without it)")
    gpus = [str(i) for i in range(n)]
    rows: List[Dict] = []
    t0 = time.time()

    def report() -> str:  # after every check: a call cut at its limit keeps what finished
        md = table(rows)
        with open(os.path.join(args.out, "graphs-default.md"), "w") as f:
            # the title names the graphs each check ran: the parity and dp2 checks are local's
            title = "local" if args.resume_graphs == "local" else (
                args.resume_graphs if only == {"resume"} else f"local (resume: {args.resume_graphs})")
            f.write(f"# model.cuda_graphs={title}: the checks before the default ({n} GPU(s), "
                    f"{time.time() - t0:.0f} s)\n\n" + md + "\n")
        return md

    if "softmax_triton" in only:  # at once: one run per GPU where there are two, else both on one
        rows += check_softmax_triton(args.out, gpus[:2], args.parity_steps)
        report()
    if "resume" in only:
        run_dir, proc, extra = start_resume(args.out, gpus[0], graphs=args.resume_graphs)
        rows += finish_resume(args.out, run_dir, proc, extra, gpus[0], graphs=args.resume_graphs)
        report()
    if "dp2" in only:
        if n >= 2:
            rows += check_dp2(args.out, args.dp2_steps)
        else:
            rows.append({"check": "data parallel 2 parity", "result": "not run", "detail": f"{n} GPU"})
    print(report(), flush=True)
    return 0 if all(r["result"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
