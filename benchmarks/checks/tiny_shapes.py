"""Every public attention op at tiny sequence lengths: runs and matches its reference.

    python -m benchmarks.checks.tiny_shapes                       # a GPU: bf16 + fp16 + fp32, every op
    python -m benchmarks.checks.tiny_shapes --ops flash,varlen --lengths 1,2 --dtypes bf16
    python -m benchmarks.checks.tiny_shapes --no-specialize ALL   # an A/B of Triton's int specialisation

(Run it as a module from the repository root: ``python benchmarks/checks/tiny_shapes.py`` puts
``benchmarks/checks/`` first on the path, and an installed ``nemo_ssa`` -- the offline bundle
holds one -- would be imported instead of the checkout.)

The cases and checks are ``nemo_ssa.testing.tiny_shapes``: forward and backward of each
case against the fp32 reference, output and dq/dk/dv finite and within 2x the eager
same-dtype error (+1e-5). A case that raises is reported with the exception's first line
(a compiler crash surfaces as ``PTXASError``) and the sweep goes on; progress every 20
cases, the table last; exit code 1 when any case failed.

``--no-specialize NAMES`` marks those int parameters of every Triton kernel in the
attention ops ``do_not_specialize`` before anything compiles (an A/B switch used to find
the crash ``ops.common.launch.for_lengths`` avoids, not a setting).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from typing import List, Optional

import torch

from nemo_ssa.testing.tiny_shapes import OPS, cases, run_case


def _patch_no_specialize(names: List[str]) -> int:
    """Mark int params called ``names`` do_not_specialize in every attention kernel
    (``ALL``: every stride ``s_*`` and every upper-case non-constexpr parameter)."""
    import triton

    n = 0
    for mod in ("nemo_ssa.ops.attention.flash", "nemo_ssa.ops.common.bwd_kernels", "nemo_ssa.ops.elsa.scan",
                "nemo_ssa.ops.elsa.backward", "nemo_ssa.ops.nsa.range_attn", "nemo_ssa.ops.nsa.selected_attn",
                "nemo_ssa.ops.nsa.select"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for obj in vars(m).values():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                for p in obj.params:
                    every = "ALL" in names and (p.name.startswith("s_") or p.name.isupper())
                    if (p.name in names or every) and not p.is_constexpr:
                        p.do_not_specialize = True
                        n += 1
    return n


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--lengths", default="1,2,3,15,17")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--dims", default="32,64,128")
    ap.add_argument("--no-specialize", default="", help="int kernel params to mark do_not_specialize (A/B)")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.no_specialize:
        print(f"do_not_specialize on {_patch_no_specialize(args.no_specialize.split(','))} kernel params")
    todo = cases(args.ops.split(","), [int(x) for x in args.lengths.split(",")], args.dtypes.split(","),
                 [int(x) for x in args.dims.split(",")])
    print(f"{len(todo)} cases on {dev} ({torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'})", flush=True)
    rows, t0 = [], time.time()
    for i, c in enumerate(todo):
        if i and i % 20 == 0:
            print(f"  {i}/{len(todo)} cases, {sum(r[8] != 'ok' for r in rows)} not ok, {time.time() - t0:.0f} s",
                  flush=True)
        t = time.time()
        torch.manual_seed(i)
        try:
            status, why = run_case(*c, dev)
        except Exception as e:  # noqa: BLE001 -- the reference itself failed
            status, why = "REF-ERROR", f"{type(e).__name__}: {e}"[:160]
            traceback.print_exc()
        rows.append((*c, status, why, time.time() - t))
        if status != "ok":
            print(f"  {status:9s} {c}: {why}", flush=True)
    bad = [r for r in rows if r[8] != "ok"]
    lines = ["| op | dtype | D | N | transform | causal | Hq/Hkv | status | why |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]}/{r[7]} | {r[8]} | {r[9]} |" for r in bad]
    summary = f"{len(rows) - len(bad)} of {len(rows)} cases ok, {len(bad)} not, {time.time() - t0:.0f} s"
    text = "\n".join([summary, ""] + (lines if bad else ["(every case ok)"]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"`python -m benchmarks.checks.tiny_shapes {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{text}\n")
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
