"""The host path of one attention fwd+bwd on the CPU, every kernel launch stubbed.

At the recipe's micro batch 8 the fused attention is host-bound on a GPU, and timers on a
GPU read one callable up to 1.7x apart between processes (docs/results/
2026-11-28-consolidation-gpu). Here the same public op runs on the CPU with the device
facts answering as an H100 (``ops.common.target.stand_in``) and Triton's launch replaced by
a function that returns at once: what is left is the Python and torch host work of a call
-- validation, dispatch, allocation, argument binding, autograd -- and nothing of the
device. Tensors are CPU tensors (allocation through torch's C++ path, as on a GPU; on the
``meta`` device torch runs Python meta kernels that a GPU call never runs). Nothing in the
recipe's call computes on them but a few one-element ops.

    python benchmarks/host_path.py                              # this tree: calls and us per fwd+bwd
    python benchmarks/host_path.py --trees .,/tmp/ref07 --rounds 3 --cpu 1   # alternating processes
    python benchmarks/host_path.py --trees .,main --launches   # the launches each tree makes

Per impl (``softmax_triton``, ``ssa_triton``) and call style it reports:

* ``py calls`` / ``all calls``: calls per fwd+bwd counted by cProfile, of Python functions
  and of every function (C functions too: torch's, builtins); deterministic, so one process
  per tree is enough to compare trees;
* ``min us`` / ``median us``: host time per fwd+bwd over ``--calls`` back-to-back calls
  (``time.perf_counter_ns`` around each); on a loaded machine the minimum is the figure to
  compare, the median moves between processes;
* ``launches``: kernels launched per fwd+bwd and a digest of every launch (kernel, grid,
  each argument's shape, strides and dtype or value, constexprs): two trees with the same
  digest made the same launches.

``--call run`` is the call ``benchmarks/run.py --op attention`` times (contiguous
``[B, H, S, D]`` leaves, ``autograd.grad`` with a fixed output gradient); ``--call
megatron`` the one ``nemo_ssa.megatron.core_attention`` makes (the same plus
``deterministic=False`` from the kernel options, ``out=`` a ``[B, H, S, D]`` view of
megatron's ``[s, b, h*d]`` output buffer, and the gradient arriving as ``[s, b, h*d]``, so
the backward sees a permuted ``dO``).

``--trees``: each tree runs in its own process (``.`` = this checkout; a directory holding
``nemo_ssa/``, e.g. ``git archive REF nemo_ssa | tar -x -C DIR``, or a git ref checked out
in a temp worktree), ``--rounds`` times, the starting tree alternating; ``--cpu N`` pins
each process to core N (``taskset``). A tree from before ``ops.common.target`` has its
device probes patched to an H100's answers (``benchmarks.sass_ab``'s list); its
``_resolve`` still turns fast math off for non-CUDA tensors (``FAST_LOG2`` 0 in its
launches), which changes a constexpr, not the host work.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file
    import _bootstrap  # noqa: F401

import argparse
import contextlib
import cProfile
import hashlib
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

if __name__ == "__main__":  # a tree's process: its nemo_ssa, before anything imports it
    from benchmarks.ab import use_code_root

    for _i, _a in enumerate(sys.argv[1:]):
        if _a == "--code-root" or _a.startswith("--code-root="):
            use_code_root(_a.split("=", 1)[1] if "=" in _a else sys.argv[_i + 2], "host_path")

import torch  # noqa: E402

from benchmarks.ab import worktree  # noqa: E402

__all__ = ["IMPLS", "LAYER_OPS", "CALLS", "stubbed", "fwd_bwd", "measure", "main"]

IMPLS = ("softmax_triton", "ssa_triton")
#: the recipe layer's other Triton ops whose host path is the launch's (one call style: their
#: call); not the fused MLP, whose cuBLAS GEMMs would run for real on the CPU
LAYER_OPS = ("rope_qkv",)
CALLS = ("run", "megatron")
RECIPE = dict(B=8, Hq=24, Hkv=8, N=1024, D=32)  # micro batch 8 of the training recipe


@contextlib.contextmanager
def stubbed(record: Optional[List[tuple]] = None) -> Iterator[None]:
    """Inside: every kernel launch of ``nemo_ssa.ops`` returns at once (appending ``(kernel,
    grid, args, meta)`` to ``record`` if given) and the device facts answer as an H100's."""
    import importlib
    import pkgutil

    import nemo_ssa.ops
    from nemo_ssa.ops.common import launch

    for info in pkgutil.walk_packages(nemo_ssa.ops.__path__, "nemo_ssa.ops."):
        importlib.import_module(info.name)
    real = launch.launch

    if record is None:
        def stub(kernel, grid, args, meta, ntensors=None, cached=True):
            return None
    else:
        def stub(kernel, grid, args, meta, ntensors=None, cached=True):
            record.append((kernel, tuple(grid), tuple(args), dict(meta)))

    # an older tree imported ``launch`` by name into each launcher module
    patches = [(m, "launch", stub) for name, m in list(sys.modules.items())
               if name.startswith("nemo_ssa.ops") and m is not None and getattr(m, "launch", None) is real]
    try:
        from nemo_ssa.ops.common.target import H100, stand_in
    except ImportError:  # before ops.common.target: its probes, where they are
        from benchmarks.sass_ab import _LEGACY_PROBES

        stand_in = None
        for name, m in list(sys.modules.items()):
            if name.startswith("nemo_ssa.ops") and m is not None:
                patches += [(m, a, fn) for a, fn in _LEGACY_PROBES.items() if hasattr(m, a)]
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, v in patches:
        setattr(m, a, v)
    try:
        with (stand_in(H100) if stand_in else contextlib.nullcontext()):
            yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def fwd_bwd(impl: str, call: str, device: torch.device, dtype=torch.bfloat16) -> Callable[[], None]:
    """One fwd+bwd of ``impl`` at the recipe's micro batch 8, as ``call`` makes it (the
    layer ops: as the recipe's layer calls them, whatever ``call``)."""
    from nemo_ssa.ops.attention import flash

    B, Hq, Hkv, N, D = (RECIPE[k] for k in ("B", "Hq", "Hkv", "N", "D"))
    torch.manual_seed(0)

    def leaf(*shape):
        t = torch.empty(shape, device=device, dtype=dtype)
        return t.normal_().requires_grad_()

    if impl == "rope_qkv":  # FusedRopeSelfAttention: q, k, v from the QKV buffer, rotary_percent 0.5
        from nemo_ssa.ops.rope import rope_layout_qkv_triton

        p = Hq // Hkv
        mixed = leaf(N, B, Hkv, (p + 2) * D)
        freqs = torch.randn(N, 1, 1, D // 2, device=device)
        gos = [torch.empty(B, h, N, D, device=device, dtype=dtype).normal_() for h in (Hq, Hkv, Hkv)]

        def one():
            torch.autograd.grad(rope_layout_qkv_triton(mixed, p, freqs, freqs), [mixed], gos)
        return one

    q, k, v = leaf(B, Hq, N, D), leaf(B, Hkv, N, D), leaf(B, Hkv, N, D)
    go = torch.empty(B, Hq, N, D, device=device, dtype=dtype)
    n = torch.full((1,), 1.5, device=device, requires_grad=True)
    b = torch.full((1,), 0.8, device=device)
    ssa = impl == "ssa_triton"
    op = flash.ssa_attention_triton if ssa else flash.softmax_attention_triton
    params = (n, b) if ssa else ()
    leaves = [q, k, v, n] if ssa else [q, k, v]
    if call == "run":
        def one():
            torch.autograd.grad(op(q, k, v, *params, causal=True), leaves, go, allow_unused=True)
    elif call == "megatron":
        go_sbh = torch.empty(N, B, Hq * D, device=device, dtype=dtype).normal_()  # the projection's gradient

        def one():
            # core_attention: the [sq, b, h*d] buffer the op writes through a [b, h, s, d] view
            buf = torch.empty((N, B, Hq * D), dtype=dtype, device=device)
            o = op(q, k, v, *params, causal=True, softmax_scale=None, keep_mask=None, dropout_p=0.0,
                   deterministic=False, out=buf.view(N, B, Hq, D).permute(1, 2, 0, 3))
            torch.autograd.grad(o.permute(2, 0, 1, 3).reshape(N, B, -1), leaves, go_sbh, allow_unused=True)
    else:
        raise ValueError(f"unknown call {call!r}; choose from {CALLS}")
    return one


def _describe(launches: List[tuple]) -> List[str]:
    """One line per launch: kernel, grid, arguments (tensors by first appearance in the
    call, shape, strides, dtype; scalars by value), constexprs."""
    ids: Dict[int, int] = {}
    lines = []
    for kernel, grid, args, meta in launches:
        parts = []
        for a in args:
            if isinstance(a, torch.Tensor):
                parts.append(f"T{ids.setdefault(id(a), len(ids))}{tuple(a.shape)}{a.stride()}{a.dtype}")
            else:
                parts.append(repr(a))
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        lines.append(f"{name} {grid} ({', '.join(parts)}) {sorted(meta.items())}")
    return lines


def measure(impl: str, call: str, device: torch.device, calls: int, profile_calls: int) -> Dict:
    """Calls per fwd+bwd (cProfile), host us per fwd+bwd (min, median), and the launches."""
    one = fwd_bwd(impl, call, device)
    record: List[tuple] = []
    with stubbed(record):
        one()  # first call: choices logged, binders built
        record.clear()
        one()
    launches = _describe(record)
    del record
    with stubbed():
        for _ in range(20):
            one()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(profile_calls):
            one()
        prof.disable()
        st = pstats.Stats(prof)
        total = st.total_calls
        # Python functions only (cProfile files C functions under "~")
        py = sum(nc for (fname, _, _), (_, nc, _, _, _) in st.stats.items() if fname != "~")
        times = []
        clock = time.perf_counter_ns
        for _ in range(calls):
            t0 = clock()
            one()
            times.append(clock() - t0)
    return dict(impl=impl, call=call, py_calls=py / profile_calls, all_calls=total / profile_calls, min_us=min(times) / 1e3,
                median_us=statistics.median(times) / 1e3, n=calls, launches=launches,
                digest=hashlib.sha1("\n".join(launches).encode()).hexdigest()[:12])


def _one_process(args) -> List[Dict]:
    from nemo_ssa.ops.common import launch

    if launch.is_interpreter():
        raise SystemExit("host_path times the host path of a GPU call: run it without TRITON_INTERPRET=1")
    device = torch.device("cpu")
    rows = []
    for call in args.call.split(","):
        for impl in args.impl.split(","):
            rows.append(measure(impl, call, device, args.calls, args.profile_calls))
    return rows


def _table(results: Dict[str, List[List[Dict]]]) -> str:
    """Per tree, impl and call: py calls, min over processes of the per-process min, the
    per-process minima and medians, launches and their digest."""
    out = ["| tree | call | impl | py calls / fwd+bwd | all calls | min us | per-process min us | per-process median us "
           "| launches | digest |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tree, procs in results.items():
        keys = [(r["call"], r["impl"]) for r in procs[0]]
        for call, impl in keys:
            rs = [r for p in procs for r in p if (r["call"], r["impl"]) == (call, impl)]
            pyc = "/".join(f"{c:g}" for c in sorted({round(r["py_calls"], 1) for r in rs}))
            allc = "/".join(f"{c:g}" for c in sorted({round(r["all_calls"], 1) for r in rs}))
            mins = " ".join(f"{r['min_us']:.1f}" for r in rs)
            meds = " ".join(f"{r['median_us']:.1f}" for r in rs)
            out.append(f"| {tree} | {call} | {impl} | {pyc} | {allc} | {min(r['min_us'] for r in rs):.1f} | {mins} | {meds} "
                       f"| {len(rs[0]['launches'])} | {rs[0]['digest']} |")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma list of {IMPLS + LAYER_OPS}")
    p.add_argument("--call", default="run", help=f"comma list of {CALLS}")
    p.add_argument("--calls", type=int, default=2000, help="timed fwd+bwd per impl and process")
    p.add_argument("--profile-calls", type=int, default=50, help="fwd+bwd under cProfile per impl and process")
    p.add_argument("--trees", default=".", help="comma list: '.' (this checkout), a directory with nemo_ssa/, "
                                                "or a git ref")
    p.add_argument("--rounds", type=int, default=1, help="processes per tree, the starting tree alternating")
    p.add_argument("--cpu", type=int, default=None, help="pin every process to this core (taskset)")
    p.add_argument("--launches", action="store_true", help="print each tree's launches of one fwd+bwd")
    p.add_argument("--out", default=None, help="markdown file for the table")
    p.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # a tree's process
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a tree's process: rows on stdout
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.json:
        print(json.dumps(_one_process(args)))
        return 0
    trees = [t for t in args.trees.split(",") if t]
    with contextlib.ExitStack() as stack:
        roots = {t: (None if t == "." else stack.enter_context(worktree(t))[1]) for t in trees}
        results: Dict[str, List[List[Dict]]] = {t: [] for t in trees}
        me = os.path.abspath(__file__)
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for t in order:
                cmd = [sys.executable, me, "--json", "--impl", args.impl, "--call", args.call, "--calls", str(args.calls), "--profile-calls", str(args.profile_calls)]
                if roots[t] is not None:
                    cmd += ["--code-root", roots[t]]
                if args.cpu is not None and shutil.which("taskset"):
                    cmd = ["taskset", "-c", str(args.cpu)] + cmd
                proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr)
                    raise SystemExit(f"host_path: tree {t} failed (exit {proc.returncode})")
                rows = json.loads(proc.stdout.strip().splitlines()[-1])
                results[t].append(rows)
                print(f"round {r + 1} {t}: " + ", ".join(
                    f"{x['call']}/{x['impl']} {x['py_calls']:g}/{x['all_calls']:g} calls {x['min_us']:.1f}/{x['median_us']:.1f} us"
                    for x in rows), flush=True)
    table = _table(results)
    print("\n" + table)
    if args.launches:
        for t, procs in results.items():
            for row in procs[0]:
                print(f"\n## {t} {row['call']} {row['impl']}: {len(row['launches'])} launches, {row['digest']}")
                print("\n".join(row["launches"]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"`{' '.join(sys.argv)}`\n\n(host us per fwd+bwd, launches stubbed, device facts of an H100; "
                    f"CPU tensors; {time.strftime('%Y-%m-%d')})\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
