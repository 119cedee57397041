"""Run a planned list of GPU steps in one device command, each under its own time limit.

    python scripts/gpu_session.py --out $OUT --budget 560 \
        "flash-tests:150:python -m pytest -m gpu tests/ops/test_ssa_flash_gpu.py -q" \
        "bench:120:python benchmarks/bench_attention.py --quick --out {out}/bench_attention.md"

Each step is ``NAME:SECONDS:COMMAND`` (``{out}`` expands to the output folder). Steps run
in order; a step gets ``min(SECONDS, budget left)`` and is killed at its limit, the next
step still runs. Every step's full log goes to ``{out}/<name>.log``; at the end all files
under ``--out`` are packed into ``{out}/session.tgz`` (the device tool returns only a few
files; the loose files are removed) and a table of steps, exit codes and seconds is printed last, preceded by each
log's tail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="+", metavar="NAME:SECONDS:COMMAND")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for all steps together")
    ap.add_argument("--tail", type=int, default=25, help="log lines shown per step")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    rows = []
    for spec in args.steps:
        try:
            name, secs, cmd = spec.split(":", 2)
            secs = float(secs)
        except ValueError:
            raise SystemExit(f"step {spec!r} is not NAME:SECONDS:COMMAND") from None
        left = args.budget - (time.time() - t0)
        if left < 5:
            rows.append((name, "skipped (budget)", 0.0))
            continue
        limit = min(secs, left)
        log_path = os.path.join(out, f"{name}.log")
        start = time.time()
        with open(log_path, "w") as log:
            log.write(f"$ {cmd}\n")
            log.flush()
            proc = subprocess.Popen(cmd.replace("{out}", out), shell=True, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"killed at {limit:.0f} s"
        rows.append((name, rc, time.time() - start))
        print(f"[session] {time.time() - t0:6.0f}s {name}: {rc} ({time.time() - start:.0f} s)", flush=True)
    tails = {}
    for name, _, _ in rows:
        path = os.path.join(out, f"{name}.log")
        if os.path.isfile(path):
            tails[name] = open(path, errors="replace").read().splitlines()[-args.tail:]
    tgz = os.path.join(out, "session.tgz")
    entries = [e for e in sorted(os.listdir(out)) if e != "session.tgz"]
    with tarfile.open(tgz, "w:gz") as tar:
        for entry in entries:
            tar.add(os.path.join(out, entry), arcname=entry)
    for entry in entries:  # only the archive goes back
        path = os.path.join(out, entry)
        (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
    for name, lines in tails.items():
        print(f"\n===== {name} (last {args.tail} lines)\n" + "\n".join(lines))
    print("\n| step | exit | seconds |\n|---|---|---|")
    for name, rc, secs in rows:
        print(f"| {name} | {rc} | {secs:.0f} |")
    return 0 if all(rc == 0 for _, rc, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
