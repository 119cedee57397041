"""Where a fused attention call spends its time: host (CPU) cost vs GPU kernel time.

    python benchmarks/attention_overhead.py                 # B1 N128, B8 N1024, B32 N1024
    python benchmarks/attention_overhead.py --out $OUT/overhead.md --trace $OUT/trace.json

For each implementation (``softmax_triton``, ``ssa_triton``, SDPA cuDNN / flash) and shape:

* **host us/call**: CPU time to *enqueue* one forward (or forward+backward). The GPU is
  first given a long ``torch.cuda._sleep`` so it is busy while the CPU enqueues N calls;
  the CPU wall time over N is then pure host cost (Python, dispatch, validation,
  allocations, launch), independent of kernel time.
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
import os
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

SHAPES = {"B1-N128": (1, 128), "B8-N1024": (8, 1024), "B32-N1024": (32, 1024)}


def host_us(fn: Callable[[], None], n: int = 200) -> float:
    """CPU microseconds per call while the GPU is kept busy (queue never drains)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU work: the enqueue below never waits on it
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def gpu_us(fn: Callable[[], None], n: int = 50) -> float:
    """Kernel time per call from CUDA-graph replays (no host cost, no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e3


def wall_us(fn: Callable[[], None]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, rep=100, return_mode="median") * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--out", default=None, help="markdown table path")
    ap.add_argument("--trace", default=None, help="chrome trace of one B8-N1024 ssa_triton fwd+bwd")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_overhead.py needs CUDA", file=sys.stderr)
        return 2

    from nemo_ssa.ops.common import attn_bwd
    from nemo_ssa.ops.ssa import flash

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, HKV, D = 24, 8, 32
    rows: List[Dict] = []
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 causal H{H}/{HKV} D{D}", flush=True)
    for label in args.shapes.split(","):
        B, N = SHAPES[label]
        torch.manual_seed(0)
        q = torch.randn(B, H, N, D, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(B, HKV, N, D, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(B, HKV, N, D, device=dev, dtype=dt, requires_grad=True)
        go = torch.randn(B, H, N, D, device=dev, dtype=dt)
        n = torch.tensor([1.5], device=dev, requires_grad=True)
        b = torch.tensor([0.8], device=dev)
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

        impls = {
            "softmax_triton": lambda q, k, v: flash.softmax_attention_triton(q, k, v, causal=True),
            "ssa_triton": lambda q, k, v: flash.ssa_attention_triton(q, k, v, n, b, causal=True),
            "sdpa_cudnn": sdpa("cudnn"),
            "sdpa_flash": sdpa("flash"),
        }
        for name, fn in impls.items():
            def fwd():
                with torch.no_grad():
                    fn(q, k, v)

            def fwd_bwd():
                q.grad = k.grad = v.grad = n.grad = None
                fn(q, k, v).backward(go)

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
            print(f"  {label:10s} {name:15s} " + " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                if k not in ("shape", "impl")), flush=True)

        if label == "B8-N1024":
            # layers of the Triton path, ssa forward: where does the host time go?
            scale = D ** -0.5
            layers = {
                "validate": lambda: flash._validate_flash(q, k, v, transform="ssa", n=n, b=b, keep_mask=None,
                                                          dropout_p=0.0, softmax_scale=None, varlen=False,
                                                          input_precision=None),
                "custom_op_fwd": lambda: torch.ops.nemo_ssa.flash_attn_fwd(
                    q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa", True, scale, 0.0,
                    N, N, "tf32", True),
                "raw_launcher_fwd": lambda: flash._flash_fwd(
                    q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa", True, scale, 0.0,
                    N, N, "tf32", True),
                "empty_like_x2": lambda: (torch.empty_like(q), torch.empty(B, H, N, device=dev)),
                "torch_add": lambda: q.detach().add(1.0),
            }
            o, M = flash._flash_fwd(q.detach(), k.detach(), v.detach(), n.detach(), b, None, None, None, "ssa",
                                    True, scale, 0.0, N, N, "tf32", True)
            layers["attention_bwd_direct"] = lambda: attn_bwd.attention_bwd(
                go, q.detach(), k.detach(), v.detach(), o, M, transform="ssa", n=n.detach(), b=b, causal=True,
                scale=scale)
            layers["attention_bwd_no_dparams"] = lambda: attn_bwd.attention_bwd(
                go, q.detach(), k.detach(), v.detach(), o, M, transform="ssa", n=n.detach(), b=b, causal=True,
                scale=scale, need_dparams=False)
            part = torch.randn(B, H, N, device=dev)
            layers["dn_db_fp64_reduce"] = lambda: (part.to(torch.float64).sum().to(torch.float32).reshape(1),
                                                   part.to(torch.float64).sum().to(torch.float32).reshape(1))
            for name, fn in layers.items():
                r = dict(shape=label, impl=f"[ssa] {name}", host_fwd=host_us(fn, 300))
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
    md = "\n".join(lines)
    print("\n(us per call; host = CPU enqueue cost with the GPU busy, gpu = CUDA-graph replay, wall = do_bench)\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Attention call overhead, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n"
                    f"`{' '.join(sys.argv)}`\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
