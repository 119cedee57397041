"""The machine code a GPU would run for each benchmark row, compiled for sm_90 on a CPU.

Every entry of the benchmark registry (``benchmarks/registry.py``) is called at its shapes,
forward and backward, through the public ops -- the same host code, dispatcher and tile
tables as on an H100 -- with a stand-in sm_90 driver: each Triton or Gluon launch compiles
for ``cuda:90`` and returns instead of running. For every kernel a call would launch it
records the dispatcher's choice, registers, spills, instruction count and a hash of the
SASS (addresses and encodings stripped).

    python -m benchmarks.sass_ab --op attention --shape recipe          # the table
    python -m benchmarks.sass_ab --op all --shape all --ab HEAD~3      # this tree vs a git ref

``--ab REF`` compiles the same rows with git ref REF's ``nemo_ssa`` (a worktree) and says,
per kernel, whether the SASS is ``identical``, comes from the ``same IR`` (Triton's TTGIR
without source locations: the backend was given the same program, and LLVM/ptxas still
move a few instructions when only line numbers moved -- seen on NSA's dK/dV kernel),
is ``reordered`` (the same instructions, loop bodies, registers and spills in another order)
or how it ``differs``: a restructuring whose every kernel
compiles to the same instructions cannot have changed speed or numerics on that GPU, so
the device time goes to the rows that differ. Exit status 1 if any kernel differs (or
exists on one side only), or the dispatcher chose otherwise. Static, not a timing: a row that differs still needs ``benchmarks/run.py`` on
a GPU. What it cannot see: host cost per call, and kernels chosen by a real device probe
that the stand-in answers differently (it says sm_90 with TMA and wgmma).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file
    import _bootstrap  # noqa: F401

import argparse
import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

if __name__ == "__main__":  # the --ab run: the ref's nemo_ssa, before anything imports it
    from benchmarks.ab import use_code_root

    for _i, _a in enumerate(sys.argv[1:]):
        if _a == "--code-root" or _a.startswith("--code-root="):
            use_code_root(_a.split("=", 1)[1] if "=" in _a else sys.argv[_i + 2], "sass_ab")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from benchmarks import registry  # noqa: E402
from benchmarks.ab import REPO, worktree  # noqa: E402

__all__ = ["SM90Driver", "sm90_stand_in", "sass_of", "fingerprint", "collect", "compare", "main"]


class SM90Driver:
    """The slice of Triton's driver interface that compiling a launch uses: an sm_90 target."""

    def __init__(self, capability: int = 90):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:  # pragma: no cover - launcher only
        return ty


# A ref from before ``ops.common.target`` probed the device in several modules: the names
# those probes had, and what an H100 answers (only the --ab run against such a ref uses this).
_LEGACY_PROBES = {"use_fast_math": lambda device: True, "tma_capable": lambda device: True,
                  "wgmma_capable": lambda device: True, "_sm90": lambda device: True,
                  "_check_device": lambda *a, **k: None, "check_kernel_tensors": lambda *a, **k: None}


@contextlib.contextmanager
def sm90_stand_in() -> Iterator[List[Tuple[str, object]]]:
    """Inside: every Triton/Gluon launch compiles for sm_90 and does not run; the yielded
    list collects ``(kernel name, CompiledKernel)`` in launch order. The device facts the
    dispatcher asks (``ops.common.target``) answer as an H100 does."""
    from nemo_ssa.ops.common import launch

    if launch.is_interpreter():
        raise SystemExit("sass_ab compiles for sm_90: run it without TRITON_INTERPRET=1")
    got: List[Tuple[str, object]] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        got.append((self.fn.__name__, kernel))
        return kernel

    # every launch through JITFunction.run: the cached launcher would bypass compile_only
    patches = [(launch, "FAST_LAUNCH", False)]
    try:
        from nemo_ssa.ops.common.target import H100, stand_in
    except ImportError:  # an older ref: patch its probes where they are, in every ops module
        import importlib
        import pkgutil

        import nemo_ssa.ops
        for info in pkgutil.walk_packages(nemo_ssa.ops.__path__, "nemo_ssa.ops."):
            importlib.import_module(info.name)
        stand_in = None
        for name, mod in list(sys.modules.items()):
            if name.startswith("nemo_ssa.ops") and mod is not None:
                patches += [(mod, attr, fn) for attr, fn in _LEGACY_PROBES.items() if hasattr(mod, attr)]
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    driver = triton.runtime.driver._active  # None on a machine without a GPU driver
    triton.runtime.driver.set_active(SM90Driver())
    JITFunction.run = compile_only
    for m, a, v in patches:
        setattr(m, a, v)
    try:
        with (stand_in(H100) if stand_in else contextlib.nullcontext()):
            yield got
    finally:
        JITFunction.run = run
        for m, a, v in saved:
            setattr(m, a, v)
        triton.runtime.driver._active = driver


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_of(compiled) -> Tuple[str, int]:
    """``(SASS text, registers per thread)`` of a compiled kernel, from Triton's ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], check=True, capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+)", res)
    return sass, int(m.group(1)) if m else -1


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_OPCODE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_LOC = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")


def fingerprint(compiled, dump: Optional[str] = None) -> Dict[str, object]:
    """What the A/B compares of one kernel: registers, spills, instruction count, the body
    length of every loop (a branch back), and two hashes -- ``sass`` of the instructions
    (no addresses, encodings or kernel name: the same code under another name hashes the
    same) and ``mix`` of the opcode counts without ``NOP`` padding (the same instructions
    in another order or other registers: ptxas reorders when only debug line numbers
    moved). ``dump``: also write the instructions to ``dump/<sass>.sass`` (diff two)."""
    sass, regs = sass_of(compiled)
    parsed = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]
    instrs = [text for _, text in parsed]
    ops = [m.group(1) for m in map(_OPCODE.match, instrs) if m]
    at = {addr: i for i, (addr, _) in enumerate(parsed)}
    loops = sorted(i - at[int(b.group(1), 16)] + 1 for i, (addr, text) in enumerate(parsed)
                   for b in [_BRANCH.search(text)] if b and int(b.group(1), 16) < addr and int(b.group(1), 16) in at)
    counts = sorted(collections.Counter(o for o in ops if o != "NOP").items())
    digest = hashlib.sha1("\n".join(instrs).encode()).hexdigest()[:12]
    ir = "\n".join(line for line in _LOC.sub("", compiled.asm.get("ttgir", "")).splitlines()
                   if line.strip() and not line.startswith("#loc"))
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{digest}.sass"), "w") as fh:
            fh.write("\n".join(instrs) + "\n")
    return dict(regs=regs, spills=sum(1 for o in ops if o.split(".")[0] in ("STL", "LDL")),
                instrs=sum(1 for o in ops if o != "NOP"), loops=loops, sass=digest,
                mix=hashlib.sha1(repr(counts).encode()).hexdigest()[:12],
                ir=hashlib.sha1(ir.encode()).hexdigest()[:12])


def _dispatch():
    try:
        from nemo_ssa.ops.common import dispatch
    except ImportError:  # a ref before the dispatcher
        return None
    return dispatch


def collect(ops: List[registry.OpBench], sets: str, only: str = "", max_n: int = 0,
            dtype=torch.bfloat16, dump: Optional[str] = None) -> List[Dict]:
    """One row per kernel launch of every kernel entry (role ``kernel``) at the shapes
    (``max_n``: only those of at most that many tokens), forward then backward (``fwd+bwd``
    entries)."""
    rows = []
    prints: Dict[int, Dict[str, object]] = {}  # one cuobjdump per compiled kernel
    cpu = torch.device("cpu")
    with sm90_stand_in() as got:
        for bench in ops:
            names = [e.name for e in bench.entries if e.role == "kernel" and not e.needs_cuda
                     and (not only or e.name in only.split(","))]
            for shape in registry.shapes(bench.op, sets):
                if max_n and shape.N > max_n:
                    continue
                built = bench.build(shape, dtype, cpu, names)
                for name in names:
                    if name in built.skipped:
                        rows.append(dict(op=bench.op, shape=shape.label, impl=name, mode="-", kernel="-",
                                         error=f"skipped: {built.skipped[name]}"))
                        continue
                    for mode in bench.entry(name).modes:
                        dispatch = _dispatch()
                        if dispatch is not None:  # every call's choices, not only the first of a key
                            dispatch.reset()
                        got.clear()
                        base = dict(op=bench.op, shape=shape.label, impl=name, mode=mode)
                        try:
                            for leaf in built.leaves[name]:
                                leaf.grad = None
                            if mode == "fwd":
                                with torch.no_grad():
                                    built.fns[name]()
                            else:
                                built.fns[name]().backward(built.grad_out)
                        except Exception as e:  # an API the code under test lacks, a host-side failure
                            rows.append(dict(base, kernel="-", error=f"{type(e).__name__}: {str(e)[:120]}"))
                            continue
                        picks = [f"{c['op']}: {c['path']}" for c in dispatch.chosen()] if dispatch else []
                        for i, (kname, compiled) in enumerate(got):
                            if id(compiled) not in prints:
                                prints[id(compiled)] = fingerprint(compiled, dump)
                            rows.append(dict(base, kernel=f"{i}:{kname}", **prints[id(compiled)]))
                        if picks:
                            rows.append(dict(base, kernel="dispatch", choice="; ".join(picks)))
                        print(f"  {bench.op} {shape.label} {name} {mode}: {len(got)} kernels", file=sys.stderr,
                              flush=True)
    return rows


def _key(r: Dict) -> Tuple:
    return (r["op"], r["shape"], r["impl"], r["mode"], r["kernel"])


def compare(here: List[Dict], ref: List[Dict]) -> Tuple[List[Dict], int]:
    """Rows with the ref's figures beside this tree's and a verdict; the count that differ."""
    by_ref = {_key(r): r for r in ref}
    out, bad = [], 0
    keys = [_key(r) for r in here] + [k for k in by_ref if k not in {_key(r) for r in here}]
    mine = {_key(r): r for r in here}
    for k in keys:
        a, b = mine.get(k), by_ref.get(k)
        row = dict(a or b)
        if a is None or b is None:
            row["ab"] = "only in ref" if a is None else "only here"
        elif k[-1] == "dispatch":
            row["ab"] = "same" if a.get("choice") == b.get("choice") else f"was: {b.get('choice')}"
        elif "error" in a or "error" in b:
            row["ab"] = "same" if a.get("error") == b.get("error") else f"was: {b.get('error', 'compiled')}"
        elif a["sass"] == b["sass"]:
            row["ab"] = "identical"
        elif a.get("ir") and a.get("ir") == b.get("ir"):
            row["ab"] = "same IR"  # the backend got the same program; its SASS moved with line numbers alone
        elif (a.get("mix"), a["regs"], a["spills"], a.get("loops")) == (b.get("mix"), b["regs"], b["spills"],
                                                                        b.get("loops")):
            row["ab"] = "reordered"  # the same instructions and loop bodies, other order or registers
        else:
            loops = "" if a.get("loops") == b.get("loops") else f", loops {b.get('loops')}->{a.get('loops')}"
            row["ab"] = (f"differs (regs {b['regs']}->{a['regs']}, instrs {b['instrs']}->{a['instrs']}, "
                         f"spills {b['spills']}->{a['spills']}{loops})")
        bad += row["ab"] not in ("identical", "same IR", "reordered", "same")
        out.append(row)
    return out, bad


def run_ref(ref: str, argv: List[str]) -> List[Dict]:
    """These rows with git ref ``ref``'s ``nemo_ssa`` (a worktree in a temp dir)."""
    with worktree(ref) as (tmp, wt):
        out = os.path.join(tmp, "rows.json")
        keep, skip = [], False
        for a in argv:  # the ref's run gets the same rows, no --ab, its own --json
            if skip:
                skip = False
            elif a in ("--ab", "--json"):
                skip = True
            elif not a.startswith(("--ab=", "--json=")):
                keep.append(a)
        cmd = [sys.executable, "-m", "benchmarks.sass_ab", *keep, "--code-root", wt, "--json", out]
        print(f"# --ab {ref}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=REPO)
        if not os.path.exists(out):
            raise SystemExit(f"sass_ab --ab {ref}: the ref's run wrote no rows (exit {proc.returncode})")
        with open(out) as fh:
            return json.load(fh)


def table(rows: List[Dict], ab: Optional[str]) -> str:
    cols = ["op", "shape", "impl", "mode", "kernel", "regs", "spills", "instrs", "sass"] + (["ab"] if ab else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r.get(c, "")) for c in cols]
        if r["kernel"] == "dispatch":
            cells[5] = r.get("choice", "")
        elif "error" in r:
            cells[5] = r["error"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pinned_run(argv: List[str]) -> Optional[int]:
    """Run this tool again with Python's string-hash seed fixed, no line table and a fresh
    Triton cache, or None when this is that run. Triton's compile depends on the hash seed (an iteration order:
    NSA's dK/dV kernel compiles to one of two instruction orders by seed) and reuses a cached
    binary whatever seed made it; a seed-0 compile into an empty cache gives the same SASS for
    the same source in every run, so an A/B's "differs" is the source's doing."""
    if "--pinned" in argv and os.environ.get("PYTHONHASHSEED") == "0":
        return None
    cache = tempfile.mkdtemp(prefix="nemo_ssa_sass_ab_cache_")
    try:
        # no debug line table either: ptxas schedules some kernels differently when only their
        # source line numbers move (NSA's dK/dV kernel: +-3 instructions, its source unchanged)
        env = dict(os.environ, PYTHONHASHSEED="0", TRITON_CACHE_DIR=cache, TRITON_DISABLE_LINE_INFO="1")
        return subprocess.run([sys.executable, "-m", "benchmarks.sass_ab", *argv, "--pinned"], env=env,
                              cwd=REPO).returncode
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = _pinned_run(argv)
    if rc is not None:
        return rc
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="attention", help="registry ops, comma list, or all")
    ap.add_argument("--shape", default="recipe", help="shape sets, comma list, or all (every set but tiny)")
    ap.add_argument("--only", default="", help="entries, comma list (default: every kernel entry)")
    ap.add_argument("--max-n", type=int, default=0,
                    help="skip shapes longer than this many tokens (NSA's torch parts at 64K take minutes on a CPU)")
    ap.add_argument("--ab", default=None, metavar="REF", help="also compile with git ref REF's nemo_ssa and compare")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--dump", default=None, help="write each kernel's instructions to DIR/<hash>.sass")
    ap.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # the --ab subprocess: its nemo_ssa
    ap.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)  # the run _pinned_run starts
    args = ap.parse_args(argv)
    ops = [registry.get(o) for o in (sorted(registry.REGISTRY) if args.op == "all" else args.op.split(","))]
    rows = collect(ops, args.shape, args.only, args.max_n, dump=args.dump)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    bad = 0
    if args.ab:
        rows, bad = compare(rows, run_ref(args.ab, argv))
    print("sm_90 SASS of every kernel launch (bf16; stand-in driver, nothing runs)"
          + (f" | A/B: this tree vs {args.ab}: {bad} differ" if args.ab else ""))
    print(table(rows, args.ab))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
