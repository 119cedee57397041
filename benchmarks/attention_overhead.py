"""Where a fused attention call spends its time: host (CPU) cost vs GPU kernel time.

    python benchmarks/attention_overhead.py                 # B1 N128, B8 N1024, B32 N1024
    python benchmarks/attention_overhead.py --out $OUT/overhead.md --trace $OUT/trace.json

For each implementation (``softmax_triton``, ``ssa_triton``, SDPA cuDNN / flash) and shape:

* **host us/call**: CPU time of ONE forward (or forward+backward) call, started after a
  ``torch.cuda.synchronize()`` so the launch queue is empty (median over N calls): pure host
  cost (Python, dispatch, validation, allocations, launch), independent of kernel time.
  (The previous version enqueued N calls behind a ``_sleep`` and filled the CUDA launch
  queue for fwd+bwd, which made its host_fb column invalid.)
* **gpu us/call**: kernel time alone, from CUDA-graph replays of one call (no launch gaps).
* **wall us/call**: ``triton.testing.do_bench`` median (what a benchmark or a model sees:
  max(host, gpu) plus gaps).

Then the Triton path is broken into layers (validation, custom-op dispatch, the raw host
launcher, a single bare kernel launch) so the fixed cost can be attributed, and one
``torch.profiler`` pass lists the CPU ops and CUDA kernels of one fwd+bwd.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.bench_attention import make_inputs  # noqa: E402

SHAPES = {"B1-N128": (1, 128), "B8-N1024": (8, 1024), "B32-N1024": (32, 1024)}


def host_us(fn: Callable[[], None], n: int = 100) -> float:
    """Median CPU microseconds of one call, each started on an idle, synchronized device
    (empty launch queue, so no call ever waits for queue space)."""
    fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6


def gpu_us(fn: Callable[[], None], n: int = 50) -> float:
    """Kernel time per call from CUDA-graph replays (no host cost, no launch gaps)."""
    from benchmarks.timing import graph_ms

    return graph_ms(fn, n=n) * 1e3


def wall_us(fn: Callable[[], None]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, rep=100, return_mode="median") * 1e3


def host_profile(calls: int, dev, dt, H: int, HKV: int, D: int) -> int:
    """cProfile of the host path (Python and the C calls it makes, wall time per function)
    and the bare costs it is built from: one Triton launch through ``launch.launch`` (cached
    path), ``CompiledKernel.run`` with prepared arguments, ``launch_key``, a one-argument
    Triton kernel, one ``torch.empty`` and one small torch kernel."""
    import cProfile
    import pstats

    import triton
    import triton.language as tl

    from nemo_ssa.ops.common import launch as attn_bwd
    from nemo_ssa.ops.attention import flash

    B, N = 1, 128
    q, k, v, go, n, b = make_inputs(B, H, HKV, N, D, dt, dev)
    fns = {"ssa_triton": lambda: flash.ssa_attention_triton(q, k, v, n, b, causal=True).backward(go),
           "softmax_triton": lambda: flash.softmax_attention_triton(q, k, v, causal=True).backward(go)}
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"\n## {name} fwd+bwd B{B} N{N}: {(t1 - t0) / calls * 1e6:.1f} us host per call "
              f"(back to back, {calls} calls)")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(30)

    @triton.jit
    def _one_arg(X):
        tl.store(X, 1.0)

    x = torch.zeros(1, device=dev)
    _one_arg[(1,)](x)
    scale = D ** -0.5
    qd, kd, vd, nd = q.detach(), k.detach(), v.detach(), n.detach()
    captured = {}
    real_launch = attn_bwd.launch

    def spy(kernel, grid, a, meta, ntensors=None, cached=True):
        captured.setdefault("fwd", (kernel, grid, a, meta, ntensors))
        return real_launch(kernel, grid, a, meta, ntensors, cached)
    real_launch_kw = attn_bwd.launch_kw

    def spy_kw(kernel, grid, tensors, scalars, meta, **kw):
        captured.setdefault("fwd_kw", (kernel, grid, tensors, scalars, meta, kw))
        return real_launch_kw(kernel, grid, tensors, scalars, meta, **kw)
    attn_bwd.launch, flash.launch_kw = spy, spy_kw  # launch_kw ends in the module's launch
    try:
        flash._flash_fwd(qd, kd, vd, nd, b, None, None, None, "ssa", True, scale, 0.0, N, N, "tf32", True)
    finally:
        attn_bwd.launch, flash.launch_kw = real_launch, real_launch_kw
    kern, grid, kargs, meta, nt = captured["fwd"]
    kw_call = captured["fwd_kw"]
    compiled = real_launch(kern, grid, kargs, meta, nt)
    full = tuple(attn_bwd._full_args(kern, kargs, meta))
    stream = attn_bwd._current_stream(torch.cuda.current_device())
    g = tuple(grid) + (1, 1)

    def bare_run():
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *full)
    micro = {
        "attn_bwd.launch (cached path), fwd kernel, %d args" % len(kargs): lambda: real_launch(kern, grid, kargs,
                                                                                               meta, nt),
        "launch.launch_kw (by name: bind, then the cached path), fwd kernel": lambda: real_launch_kw(
            kw_call[0], kw_call[1], kw_call[2], kw_call[3], kw_call[4], **kw_call[5]),
        "launch.bind_kw alone, fwd kernel": lambda: attn_bwd.bind_kw(kw_call[0], kw_call[2], kw_call[3], kw_call[4],
                                                                     kw_call[5].get("absent")),
        "attn_bwd.launch, generic key (ntensors=None)": lambda: real_launch(kern, grid, kargs, meta),
        "CompiledKernel.run alone, same args": bare_run,
        "launch_key alone (generic key)": lambda: attn_bwd.launch_key(kern, 0, kargs, meta),
        "one-argument Triton kernel, JITFunction.run": lambda: _one_arg[(1,)](x),
        "torch.empty [B,H,N] fp32": lambda: torch.empty(B, H, N, device=dev),
        "torch x.add(1) (one small kernel)": lambda: x.add(1.0),
        "_flash_fwd (allocs + launch)": lambda: flash._flash_fwd(qd, kd, vd, nd, b, None, None, None, "ssa", True,
                                                                 scale, 0.0, N, N, "tf32", True),
    }
    class _Identity(torch.autograd.Function):
        """The floor of any Python autograd.Function: forward and backward do no work."""

        @staticmethod
        def forward(ctx, a, b_, c, d):
            ctx.set_materialize_grads(False)
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None

    xa = torch.randn(8, device=dev, requires_grad=True)
    xb = torch.randn(8, device=dev, requires_grad=True)
    gx = torch.ones(8, device=dev)

    def ident_fb():
        xa.grad = None
        _Identity.apply(xa, xb, None, None).backward(gx)

    def cpp_fb():
        xa.grad = None
        xa.mul(2.0).backward(gx)
    micro["floor: empty Python autograd.Function fwd+bwd (CUDA leaf)"] = ident_fb
    micro["floor: x.mul(2) fwd+bwd (C++ autograd node)"] = cpp_fb
    print("\n| bare cost (back to back, idle GPU) | us per call |\n|---|---|")
    for name, fn in micro.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"| {name} | {(t1 - t0) / calls * 1e6:.1f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--out", default=None, help="markdown table path")
    ap.add_argument("--trace", default=None, help="chrome trace of one B8-N1024 ssa_triton fwd+bwd")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="only profile the host path: cProfile of N back-to-back ssa_triton and softmax_triton "
                         "fwd+bwd calls at B1-N128 (the GPU is idle, every microsecond is host) plus the bare "
                         "launch costs, then exit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_overhead.py needs CUDA", file=sys.stderr)
        return 2

    from nemo_ssa.ops.common import bwd
    from nemo_ssa.ops.common import launch as attn_bwd
    from nemo_ssa.ops.attention import flash

    attn_bwd_fast = attn_bwd.FAST_LAUNCH

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, HKV, D = 24, 8, 32
    if args.cprofile:
        return host_profile(args.cprofile, dev, dt, H, HKV, D)
    rows: List[Dict] = []
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 causal H{H}/{HKV} D{D}", flush=True)
    for label in args.shapes.split(","):
        B, N = SHAPES[label]
        q, k, v, go, n, b = make_inputs(B, H, HKV, N, D, dt, dev)
        ke, ve = (t.detach().repeat_interleave(H // HKV, 1).requires_grad_() for t in (k, v))

        def sdpa(backend):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

            def f(q, k, v):
                with sdpa_kernel(be):
                    try:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    except RuntimeError:
                        return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
            return f

        def legacy(fn):
            """Marks the generic host path, with both fast paths off: custom-op autograd and
            JITFunction.run launches (set for the whole fwd / fwd+bwd call, backward included),
            so the fast paths' saving is measured in the same process."""
            fn.legacy = True
            return fn

        impls = {
            "softmax_triton": lambda q, k, v: flash.softmax_attention_triton(q, k, v, causal=True),
            "ssa_triton": lambda q, k, v: flash.ssa_attention_triton(q, k, v, n, b, causal=True),
            "softmax_triton[legacy]": legacy(lambda q, k, v: flash.softmax_attention_triton(q, k, v, causal=True)),
            "ssa_triton[legacy]": legacy(lambda q, k, v: flash.ssa_attention_triton(q, k, v, n, b, causal=True)),
            "sdpa_cudnn": sdpa("cudnn"),
            "sdpa_flash": sdpa("flash"),
        }
        def set_legacy(on: bool) -> None:
            flash.EAGER_FASTPATH = not on
            attn_bwd.FAST_LAUNCH = attn_bwd_fast and not on

        for name, fn in impls.items():
            leg = getattr(fn, "legacy", False)

            def fwd():
                set_legacy(leg)
                try:
                    with torch.no_grad():
                        fn(q, k, v)
                finally:
                    set_legacy(False)

            def fwd_bwd():
                set_legacy(leg)
                try:
                    q.grad = k.grad = v.grad = n.grad = None
                    fn(q, k, v).backward(go)
                finally:
                    set_legacy(False)

            try:
                r = dict(shape=label, impl=name,
                         host_fwd=host_us(fwd), host_fb=host_us(fwd_bwd),
                         gpu_fwd=gpu_us(fwd), wall_fwd=wall_us(fwd), wall_fb=wall_us(fwd_bwd))
                try:
                    r["gpu_fb"] = gpu_us(fwd_bwd)
                except Exception as e:  # graph capture of autograd may fail for some paths
                    r["gpu_fb"] = math.nan
                    r["note"] = f"no graph fwd+bwd: {type(e).__name__}"
            except Exception as e:
                r = dict(shape=label, impl=name, note=f"failed: {type(e).__name__}: {str(e)[:80]}")
            rows.append(r)
            print(f"  {label:10s} {name:22s} " + " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                if k not in ("shape", "impl")), flush=True)

        if label == "B8-N1024":
            # layers of the Triton path, ssa forward: where does the host time go?
            scale = D ** -0.5
            layers = {
                "validate": lambda: flash._validate_flash(q, k, v, transform="ssa", n=n, b=b, causal=True,
                                                          keep_mask=None, dropout_p=0.0, softmax_scale=None,
                                                          varlen=False, input_precision=None),
                "eager_function_fwd": lambda: flash._FlashAttnFn.apply(
                    q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, None,
                    ("ssa", True, scale, 0.0, N, N, "tf32", True, False, False, None)),
                "custom_op_fwd": lambda: torch.ops.nemo_ssa.flash_attn_fwd(
                    q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa", True, scale, 0.0,
                    N, N, "tf32", True),
                "raw_launcher_fwd": lambda: flash._flash_fwd(
                    q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa", True, scale, 0.0,
                    N, N, "tf32", True),
                "empty_like_x2": lambda: (torch.empty_like(q), torch.empty(B, H, N, device=dev)),
                "torch_add": lambda: q.detach().add(1.0),
            }
            o, M, _ = flash._flash_fwd(q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa",
                                    True, scale, 0.0, N, N, "tf32", True)
            layers["attention_bwd_direct"] = lambda: bwd.attention_bwd(
                go, q.detach(), k.detach(), v.detach(), o, M, transform="ssa", n=n.detach(), b=b, causal=True,
                scale=scale)
            layers["attention_bwd_no_dparams"] = lambda: bwd.attention_bwd(
                go, q.detach(), k.detach(), v.detach(), o, M, transform="ssa", n=n.detach(), b=b, causal=True,
                scale=scale, need_dparams=False)
            part = torch.randn(B, H, N, device=dev)
            layers["dn_db_fp64_reduce_old"] = lambda: (part.to(torch.float64).sum().to(torch.float32).reshape(1),
                                                       part.to(torch.float64).sum().to(torch.float32).reshape(1))
            part2 = torch.randn(2, B, H, N, device=dev)
            layers["dn_db_fp64_reduce_new"] = lambda: part2.sum(dim=(1, 2, 3), dtype=torch.float64).to(torch.float32)

            def raw_fwd_slow_launch():
                attn_bwd.FAST_LAUNCH = False
                try:
                    flash._flash_fwd(q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa",
                                     True, scale, 0.0, N, N, "tf32", True)
                finally:
                    attn_bwd.FAST_LAUNCH = attn_bwd_fast
            layers["raw_launcher_fwd_jit_run"] = raw_fwd_slow_launch
            for name, fn in layers.items():
                r = dict(shape=label, impl=f"[ssa] {name}", host_fwd=host_us(fn, 200))
                rows.append(r)
                print(f"  {label:10s} {r['impl']:28s} host={r['host_fwd']:.1f} us", flush=True)

            prof_fn = impls["ssa_triton"]
            for _ in range(3):
                prof_fn(q, k, v).backward(go)
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    q.grad = k.grad = v.grad = n.grad = None
                    prof_fn(q, k, v).backward(go)
                torch.cuda.synchronize()
            print("\n## torch.profiler: ssa_triton fwd+bwd x5 at B8-N1024, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            print("\n## by CUDA time")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
            if args.trace:
                prof.export_chrome_trace(args.trace)
        del q, k, v, go, ke, ve
        torch.cuda.empty_cache()

    cols = ["shape", "impl", "host_fwd", "host_fb", "gpu_fwd", "gpu_fb", "wall_fwd", "wall_fb", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(
            (f"{r[c]:.1f}" if isinstance(r.get(c), float) and not math.isnan(r[c]) else
             ("-" if isinstance(r.get(c), float) or c not in r else str(r[c]))) for c in cols) + " |")
    # B8 -> B32 ratio of fwd+bwd wall time (4x the work; ~4 means no fixed cost left)
    by = {(r["shape"], r["impl"]): r for r in rows}
    ratio = ["", "| impl | wall_fb B8-N1024 | wall_fb B32-N1024 | B32/B8 | B1-N128 host_fb | B1-N128 wall_fb |",
             "|---|---|---|---|---|---|"]
    for name in impls:
        a, c, t = by.get(("B8-N1024", name), {}), by.get(("B32-N1024", name), {}), by.get(("B1-N128", name), {})
        f = lambda x: f"{x:.1f}" if isinstance(x, float) and not math.isnan(x) else "-"  # noqa: E731
        rr = (c.get("wall_fb", math.nan) / a["wall_fb"]) if a.get("wall_fb") else math.nan
        ratio.append(f"| {name} | {f(a.get('wall_fb'))} | {f(c.get('wall_fb'))} | {f(rr) if rr == rr else '-'} | "
                     f"{f(t.get('host_fb'))} | {f(t.get('wall_fb'))} |")
    lines += ratio
    md = "\n".join(lines)
    print("\n(us per call; host = CPU time of one call on an idle synced device, gpu = CUDA-graph replay, "
          "wall = do_bench; [legacy] = custom-op autograd + JITFunction.run launches)\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Attention call overhead, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n"
                    f"`{' '.join(sys.argv)}`\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
