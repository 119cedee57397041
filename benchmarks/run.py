"""The one runner of the registered op benchmarks (``benchmarks/registry.py``).

    python benchmarks/run.py --list                                # ops, entries, shape sets
    python benchmarks/run.py --op attention --shape recipe         # time, ratios vs the baseline
    python benchmarks/run.py --op attention,nsa --shape recipe,long --out $OUT/ops   # + .csv/.md
    python benchmarks/run.py --op attention --shape recipe --ab main    # this tree vs git ref main
    python benchmarks/run.py --op attention --shape recipe --timer host --ab main   # host cost per call
    python benchmarks/run.py --dry-run [--op nsa --only window]    # CPU: tiny shapes, outputs vs reference

Timing (CUDA only): every entry of an op at a shape on the same inputs, forward (no grad)
and forward+backward (``autograd.grad`` of the output against the entry's leaves with a
fixed output gradient), with ``benchmarks/timing.median_ms`` (do_bench median, call-count
floors), plus the peak extra memory of one fwd+bwd. ``x_base`` = ms / the entry's
baseline's ms at the same shape and mode (> 1: slower than the baseline).
``--timer host``: instead, the median CPU time of one call started on an idle, synchronized
device (``timing.host_ms``) -- the host cost of a host-bound row, which do_bench's wall time
hides under a spread of up to 1.4x between runs of one process; no peak memory.
``--timer enqueue``: the median host time per call of 20 calls issued back to back behind a
device-side wait (``timing.enqueue_ms``): no device round trip in the time (``host`` times
a first launch on an idle device, and read the same SDPA call up to 1.7x apart between
processes); a row whose calls waited on the device (a
synchronization inside the call) is marked ``late k/31``.
``--timer kernel``: GPU time per call, the profiler's sum of the call's device activity over 50
calls (``timing.kernel_ms``): no host cost, no launch gaps -- on a host-bound row, the part a
kernel change moves (a wall A/B of the RoPE pass read 0.68-1.21 both ways; this timer read
its kernel 2.5x faster in all six processes, docs/results/2026-11-29-rope-tables-graphs).

``--ab REF``: the same entries, shapes and timer, run a second time in a subprocess whose
``nemo_ssa`` is git ref REF's (``git worktree add`` into a temp dir, put first on
``sys.path`` with ``--code-root``); the benchmarks' own code is this tree's in both runs.
The table gets both columns and ``here/ref``. With ``--dry-run`` both trees run the check.

``--dry-run``: on the CPU, Triton kernels under ``TRITON_INTERPRET=1``, every entry at the
op's ``tiny`` shapes in fp32; each callable's output must be finite and within
``tiny_rtol`` (relative error) of the torch reference on the same inputs. Entries that need
CUDA are listed as skipped. Exit 1 when any entry fails.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Optional

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

import torch  # noqa: E402

from benchmarks import registry  # noqa: E402
from benchmarks.ab import use_code_root, worktree  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NO_CUDA = ("run.py: timing needs a CUDA GPU and none is visible here. "
           "On a CPU, --list shows the registry and --dry-run checks every entry's outputs at tiny shapes.")


ENQUEUE_REPS = 31  # samples per row of --timer enqueue (the median's)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="attention", help=f"comma list of {sorted(registry.REGISTRY)} or 'all'")
    p.add_argument("--shape", default="recipe", help="comma list of shape sets (recipe, wide, long, tiny) or 'all'")
    p.add_argument("--only", default="", help="comma list of entry names (default: every entry of the op)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd")
    p.add_argument("--warmup-ms", type=float, default=25)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--timer", default="wall", choices=("wall", "host", "enqueue", "kernel"),
                   help="wall: do_bench median (kernels + launch gaps); host: median CPU time of one call "
                        "started on an idle device (timing.host_ms); enqueue: median host time per call "
                        "issued behind a device-side wait (timing.enqueue_ms), for host-bound shapes; kernel: GPU time "
                        "per call, the profiler's sum of device activity (timing.kernel_ms)")
    p.add_argument("--host-calls", type=int, default=200, help="calls per row of --timer host")
    p.add_argument("--out", default=None, help="x.csv, x.md, or a directory (gets ops.csv and ops.md)")
    p.add_argument("--list", action="store_true", help="print the registry and exit (CPU)")
    p.add_argument("--dry-run", action="store_true", help="CPU agreement check at tiny shapes (Triton interpreter)")
    p.add_argument("--ab", default=None, metavar="REF", help="also run with git ref REF's nemo_ssa and compare")
    p.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # the --ab subprocess: its nemo_ssa
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)  # the --ab subprocess: its rows
    return p.parse_args(argv)


def _ops(args) -> List[registry.OpBench]:
    names = sorted(registry.REGISTRY) if args.op == "all" else [o for o in args.op.split(",") if o]
    return [registry.get(o) for o in names]


def _names(bench: registry.OpBench, only: str) -> List[str]:
    want = [n for n in only.split(",") if n]
    if not want:
        return [e.name for e in bench.entries]
    known = {e.name for e in bench.entries}
    return [n for n in want if n in known]


def needed(bench: registry.OpBench, names: List[str]) -> List[str]:
    """``names`` and, once each, the baselines their ratios divide by (timed whatever
    ``--only`` says). Two entries sharing a baseline must not time it twice: the second
    timing became a second row and the ratios read whichever came last."""
    out = list(dict.fromkeys(names))
    for e in bench.entries:
        if e.name in out and e.baseline and e.baseline not in out:
            out.append(e.baseline)
    return out


# ------------------------------------------------------------------------------------ list
def list_registry() -> str:
    lines = []
    for bench in registry.REGISTRY.values():
        lines.append(f"{bench.op}: {bench.doc}")
        for e in bench.entries:
            lines.append(f"  {e.name:15s} {e.role:9s} vs {e.baseline or '-':12s} modes {','.join(e.modes)}"
                         + ("  (CUDA only)" if e.needs_cuda else ""))
        for name, shps in bench.shapes.items():
            lines.append(f"  shapes {name:7s} " + "; ".join(str(s) for s in shps))
    return "\n".join(lines)


# --------------------------------------------------------------------------------- dry run
def dry_run(ops: List[registry.OpBench], only: str = "") -> List[Dict]:
    """Every entry's output at the tiny shapes vs its reference, on the CPU (fp32)."""
    from nemo_ssa.testing import rel_err

    rows = []
    for bench in ops:
        names = _names(bench, only)
        for shape in bench.shapes["tiny"]:
            built = bench.build(shape, torch.float32, torch.device("cpu"), names)
            for name in names:
                entry = bench.entry(name)
                row = dict(op=bench.op, shape=shape.label, impl=name, role=entry.role)
                if name in built.skipped:
                    ok = entry.needs_cuda
                    row.update(status="skip" if ok else "FAIL", detail=built.skipped[name])
                elif name not in built.refs:
                    with torch.no_grad():
                        out = built.fns[name]()
                    outs = out if isinstance(out, tuple) else (out,)
                    finite = all(bool(torch.isfinite(o.float()).all()) for o in outs if o.is_floating_point())
                    row.update(status="ran" if finite else "FAIL", detail="no reference; output finite" if finite
                               else "non-finite output")
                else:
                    try:
                        with torch.no_grad():
                            out, ref = built.fns[name](), built.refs[name]()
                        # an op may return several tensors (rope: q, k, v): the worst of them
                        pairs = zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,))
                        err = max(rel_err(o.float(), r.float()) for o, r in pairs)
                    except Exception as e:
                        err, row["detail"] = math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                    ok = err <= bench.tiny_rtol  # NaN fails
                    row.update(status="ok" if ok else "FAIL", rel_err=err)
                    row.setdefault("detail", f"rel_err {err:.2e} (bound {bench.tiny_rtol:g})")
                rows.append(row)
                print(f"  {bench.op:9s} {shape.label:6s} {name:15s} {row['status']:5s} {row['detail']}", flush=True)
    return rows


# ---------------------------------------------------------------------------------- timing
def time_ops(ops: List[registry.OpBench], args) -> List[Dict]:
    from benchmarks.timing import enqueue_ms, host_ms, kernel_ms, median_ms, peak_mib

    dtype, dev = DTYPES[args.dtype], torch.device("cuda")
    modes = [m for m in args.modes.split(",") if m]
    rows = []
    for bench in ops:
        need = needed(bench, _names(bench, args.only))
        for shape in registry.shapes(bench.op, args.shape):
            print(f"## {bench.op} {shape}", flush=True)
            try:
                built = bench.build(shape, dtype, dev, need)
            except torch.cuda.OutOfMemoryError:
                built = registry.Built(fns={}, leaves={}, grad_out=None, skipped={n: "OOM" for n in need})
            for name in need:
                entry = bench.entry(name)
                for mode in entry.modes:
                    if mode not in modes:
                        continue
                    row = dict(op=bench.op, shape=shape.label, B=shape.B, N=shape.N, Hq=shape.Hq, Hkv=shape.Hkv,
                               D=shape.D, impl=name, role=entry.role, mode=mode, baseline=entry.baseline or "",
                               ms=math.nan, peak_mib=math.nan, note=built.notes.get(name, ""))
                    if name in built.skipped:
                        row["note"] = built.skipped[name]
                    else:
                        fn, leaves = built.fns[name], [t for t in built.leaves.get(name, []) if t.requires_grad]
                        if mode == "fwd":
                            def call(fn=fn):
                                with torch.no_grad():
                                    fn()
                        else:
                            def call(fn=fn, leaves=leaves):
                                torch.autograd.grad(fn(), leaves, built.grad_out, allow_unused=True)
                        try:
                            if args.timer == "host":
                                row["ms"] = host_ms(call, n=args.host_calls)
                            elif args.timer == "kernel":
                                row["ms"] = kernel_ms(call)
                            elif args.timer == "enqueue":
                                row["ms"], late = enqueue_ms(call, reps=ENQUEUE_REPS)
                                if late:  # samples that waited on the device: a sync in the call
                                    row["note"] = f"late {late}/{ENQUEUE_REPS}"
                            else:
                                row["ms"] = median_ms(call, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                            if mode == "fwd+bwd" and args.timer == "wall":
                                row["peak_mib"] = peak_mib(call)
                        except torch.cuda.OutOfMemoryError:
                            row["note"] = "OOM"
                        except Exception as e:  # an API the code under test lacks (an --ab ref)
                            row["note"] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''})"
                        torch.cuda.empty_cache()
                    rows.append(row)
                    print(f"   {name:15s} {mode:8s} {row['ms']:9.3f} ms  {row['note']}", flush=True)
            del built
            torch.cuda.empty_cache()
    _ratios(rows)
    return rows


def _key(r: Dict, impl: Optional[str] = None):
    return (r["op"], r["shape"], impl or r["impl"], r["mode"])


def _ratios(rows: List[Dict]) -> None:
    by = {_key(r): r for r in rows}
    for r in rows:
        base = by.get(_key(r, r["baseline"])) if r["baseline"] else None
        r["x_base"] = r["ms"] / base["ms"] if base else math.nan


# ---------------------------------------------------------------------------------- tables
def _cell(v) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else (f"{v:.2e}" if abs(v) < 1e-2 and v else f"{v:.3f}")
    return str(v)


def table(rows: List[Dict], cols: List[str]) -> str:
    body = [[_cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(x.rjust(w) for x, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


TIME_COLS = ["op", "shape", "impl", "mode", "ms", "baseline", "x_base", "peak_mib", "note"]
AB_COLS = ["op", "shape", "impl", "mode", "ms", "ms_ref", "here/ref", "x_base", "x_base_ref", "note"]
DRY_COLS = ["op", "shape", "impl", "role", "status", "detail"]
AB_DRY_COLS = ["op", "shape", "impl", "status", "status_ref", "detail", "detail_ref"]


def merge_ab(here: List[Dict], ref: List[Dict], dry: bool) -> List[Dict]:
    """One row per (op, shape, impl, mode) with this tree's and the ref's results."""
    key = (lambda r: (r["op"], r["shape"], r["impl"])) if dry else _key
    theirs = {key(r): r for r in ref}
    out = []
    for r in here:
        o = theirs.get(key(r), {})
        m = dict(r)
        if dry:
            m.update(status_ref=o.get("status", "-"), detail_ref=o.get("detail", "-"))
        else:
            m.update(ms_ref=o.get("ms", math.nan), x_base_ref=o.get("x_base", math.nan))
            m["here/ref"] = m["ms"] / m["ms_ref"]
            if o.get("note"):
                m["note"] = (m.get("note", "") + f" ref: {o['note']}").strip()
        out.append(m)
    return out


def write_out(path: str, rows: List[Dict], cols: List[str], header: str) -> List[str]:
    if path.endswith(".csv") or path.endswith(".md"):
        stem, targets = path[:-4] if path.endswith(".csv") else path[:-3], [path]
    else:
        os.makedirs(path, exist_ok=True)
        stem = os.path.join(path, "ops")
        targets = [stem + ".csv", stem + ".md"]
    for t in targets:
        if t.endswith(".csv"):
            with open(t, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(cols)
                w.writerows([_cell(r.get(c, "")) for c in cols] for r in rows)
        else:
            with open(t, "w") as fh:
                fh.write(header + "\n\n" + table(rows, cols) + "\n")
    return targets


# -------------------------------------------------------------------------------------- A/B
def _strip_ab(argv: List[str]) -> List[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--ab" or a == "--out" or a == "--json":
            skip = True
            continue
        if a.startswith("--ab=") or a.startswith("--out=") or a.startswith("--json="):
            continue
        out.append(a)
    return out


def run_ref(ref: str, argv: List[str]) -> List[Dict]:
    """This runner's rows with git ref ``ref``'s ``nemo_ssa`` (a worktree in a temp dir)."""
    with worktree(ref) as (tmp, wt):
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), *_strip_ab(argv), "--code-root", wt, "--json", out]
        print(f"# --ab {ref}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd)
        if not os.path.exists(out):
            raise SystemExit(f"run.py --ab {ref}: the ref's run wrote no rows (exit {proc.returncode})")
        with open(out) as fh:
            return json.load(fh)


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.list:
        print(list_registry())
        return 0
    if args.code_root:
        use_code_root(args.code_root, "run.py")
    if args.dry_run:
        # before any kernel module is imported: Triton reads it when a kernel is defined
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run.py: unset TRITON_INTERPRET to time (the interpreter is not a speed)", file=sys.stderr)
        return 2
    ops = _ops(args)
    import nemo_ssa

    code = os.path.dirname(os.path.dirname(os.path.abspath(nemo_ssa.__file__)))
    where = "CPU dry run (Triton interpreter, fp32, tiny shapes)" if args.dry_run else torch.cuda.get_device_name()
    header = (f"# benchmarks/run.py: {where} | torch {torch.__version__} | nemo_ssa from {code}"
              + ("" if args.dry_run else f" | {args.dtype} | timer {args.timer}"))
    print(header, flush=True)
    rows = dry_run(ops, args.only) if args.dry_run else time_ops(ops, args)
    failed = any(r.get("status") == "FAIL" for r in rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, default=str)
    cols = DRY_COLS if args.dry_run else TIME_COLS
    if args.ab:
        ref_rows = run_ref(args.ab, argv)
        rows = merge_ab(rows, ref_rows, args.dry_run)
        cols = AB_DRY_COLS if args.dry_run else AB_COLS
        header += f" | A/B: this tree vs {args.ab}"
        failed = failed or any(r.get("status_ref") == "FAIL" for r in rows)
    md = table(rows, cols)
    print("\n" + header + "\n" + md)
    if args.out:
        for t in write_out(args.out, rows, cols, header):
            print(f"wrote {t}")
    if args.dry_run:
        print("dry run: " + ("FAIL" if failed else "every entry agrees with its reference or is skipped"))
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
