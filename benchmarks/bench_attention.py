"""Speed / memory of the fused SSA and softmax Triton kernels vs SDPA flash and cuDNN.

Every row is measured in the same process, on the same inputs, so the ratios are fair:

    python -m benchmarks.bench_attention               # the recipe's shape, B32, N4096, D64, D128
    python -m benchmarks.bench_attention --quick       # the three D=32 shapes
    python -m benchmarks.bench_attention --sweep       # + N sweep at constant tokens
    python -m benchmarks.bench_attention --out bench.md   # also write markdown (or .csv)
    NEMO_SSA_AUTOTUNE=1 python -m benchmarks.bench_attention --quick   # autotuned kernels

Rows per shape: ``softmax_triton`` (same kernel, TRANSFORM=softmax), ``ssa_triton``
(learnable ``n``: dn/db are computed), ``ssa_reference`` (eager bf16
``attention_naive(upcast=False)``, skipped on OOM), ``sdpa_flash``, ``sdpa_cudnn``
(GQA via ``enable_gqa``; if a backend rejects it, K/V are expanded outside the timed
region and the row is marked ``*``). Columns: fwd and fwd+bwd median ms
(``triton.testing.do_bench``), TFLOP/s (causal counts half the score matrix; backward =
2.5x forward), peak extra memory of one fwd+bwd (MiB above the inputs), and the ratios to
SDPA flash and cuDNN. Shapes: the recipe's training shape (B8 N1024 H24/8 D32), B32 N1024,
B2 N4096, D64 (B2 N8192 H16/16), D128 (B2 N8192 H8/8), and the same heads at B8 N4096
("D64 B8", "D128 B8"); ``--sweep`` adds an N sweep. Targets
(H100/H200): softmax_triton fwd+bwd <= 1.1x SDPA cuDNN, ssa_triton fwd+bwd <= 1.5x
and fwd <= 1.3x SDPA cuDNN at every shape.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.timing import graph_ms, median_ms, peak_mib  # noqa: E402

ROWS = ("softmax_triton", "ssa_triton", "ssa_triton_poly", "ssa_reference", "sdpa_flash", "sdpa_cudnn")
DEFAULT_ROWS = ("softmax_triton", "ssa_triton", "sdpa_flash", "sdpa_cudnn")
# ssa_triton_poly: ssa_triton with NEMO_SSA_POLY_LOG2=1 (half of the SSA log2 on FMA units)


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the three D=32 shapes only (no D64/D128)")
    ap.add_argument("--wide", action="store_true", help="the four D64/D128 shapes only (no D=32)")
    ap.add_argument("--gpu-time", action="store_true",
                    help="also time fwd+bwd as CUDA-graph replays (kernel time without host cost or launch "
                         "gaps; no L2 flush between replays): shows which rows are bound by host time")
    ap.add_argument("--sweep", action="store_true", help="add an N sweep at constant B*N tokens")
    ap.add_argument("--sweep-max", type=int, default=32768, help="largest N of the sweep")
    ap.add_argument("--tokens", type=int, default=16384, help="B*N kept constant in the sweep")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--full", action="store_true", help="non-causal instead of causal")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma list from {ROWS}")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--autotune", action="store_true", help="same as NEMO_SSA_AUTOTUNE=1")
    ap.add_argument("--out", default=None, help="also write the table (.csv or .md)")
    return ap.parse_args(argv)


def _shapes(args) -> List[Dict]:
    """(label, B, Hq, Hkv, N, D) of the runs: the recipe's training shape first."""
    shapes = [] if args.wide else [dict(label="recipe", B=8, Hq=24, Hkv=8, N=1024, D=32),
                                   dict(label="B32", B=32, Hq=24, Hkv=8, N=1024, D=32),
                                   dict(label="N4096", B=2, Hq=24, Hkv=8, N=4096, D=32)]
    if not args.quick:
        shapes += [dict(label="D64", B=2, Hq=16, Hkv=16, N=8192, D=64),
                   dict(label="D128", B=2, Hq=8, Hkv=8, N=8192, D=128),
                   dict(label="D64 B8", B=8, Hq=16, Hkv=16, N=4096, D=64),
                   dict(label="D128 B8", B=8, Hq=8, Hkv=8, N=4096, D=128)]
    if args.sweep:
        ns = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
        for n in ns:
            if n <= args.sweep_max:
                shapes.append(dict(label="sweep", B=max(1, args.tokens // n), Hq=24, Hkv=8, N=n, D=32))
    return shapes


def _flops(B, Hq, N, D, causal, bwd: bool) -> float:
    f = 4.0 * B * Hq * N * N * D * (0.5 if causal else 1.0)
    return f * 3.5 if bwd else f


def _sdpa_fn(backend_name: str, causal: bool, q, k, v):
    """SDPA pinned to one backend; returns (fn, expanded?) or raises if unavailable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    g = q.shape[1] // k.shape[1]

    def gqa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=g > 1)

    try:
        gqa(q, k, v).sum().backward()
        return gqa, False
    except RuntimeError:
        pass
    ke = k.detach().repeat_interleave(g, 1).requires_grad_()
    ve = v.detach().repeat_interleave(g, 1).requires_grad_()

    def expanded(q, k, v):  # k/v expanded outside the timed region
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)

    expanded(q, k, v).sum().backward()
    return expanded, True


def make_inputs(B: int, Hq: int, Hkv: int, N: int, D: int, dtype, device, seed: int = 0):
    """``(q, k, v, go, n, b)`` of one shape: q ``[B, Hq, N, D]``, k/v ``[B, Hkv, N, D]``
    (leaves), the output gradient ``go`` and the SSA scalars (``n`` learnable)."""
    torch.manual_seed(seed)
    q = torch.randn(B, Hq, N, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, requires_grad=True)
    go = torch.randn(B, Hq, N, D, device=device, dtype=dtype)
    n = torch.tensor([1.5], device=device, requires_grad=True)
    b = torch.tensor([0.8], device=device)
    return q, k, v, go, n, b


def row_fn(name: str, causal: bool, q, k, v, n, b):
    """``(fn(q, k, v) -> o, extra leaves, note)`` of one row of ``ROWS`` (``ssa_triton_poly``
    is ``ssa_triton``; the caller sets NEMO_SSA_POLY_LOG2). SDPA rows raise where the
    backend is missing (a CPU, a build without it)."""
    if name == "softmax_triton":
        from nemo_ssa.ops.attention.flash import softmax_attention_triton

        return (lambda q, k, v: softmax_attention_triton(q, k, v, causal=causal)), (), ""
    if name in ("ssa_triton", "ssa_triton_poly"):
        from nemo_ssa.ops.attention.flash import ssa_attention_triton

        return (lambda q, k, v: ssa_attention_triton(q, k, v, n, b, causal=causal)), (n,), ""
    if name == "ssa_reference":
        from nemo_ssa.ops.attention.naive import attention_naive

        return (lambda q, k, v: attention_naive(q, k, v, n=n, b=b, causal=causal, upcast=False)), (n,), ""
    if name in ("sdpa_flash", "sdpa_cudnn"):
        fn, expanded = _sdpa_fn(name, causal, q, k, v)
        return fn, (), "*" if expanded else ""
    raise ValueError(f"unknown row {name!r}; choose from {ROWS}")


def _bench_row(name: str, fn: Callable, q, k, v, go, rep: int, extra_grads=(), gpu_time: bool = False) -> Dict:
    leaves = [q, k, v, *extra_grads]

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        fn(q, k, v).backward(go)

    out = {}
    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    out["fwd_ms"] = median_ms(fwd, rep_ms=rep)
    out["fwdbwd_ms"] = median_ms(fwd_bwd, rep_ms=rep, grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    if gpu_time:
        def fresh_fwd_bwd():
            for t in leaves:
                t.grad = None
            fwd_bwd()
        try:
            out["gpu_fwdbwd_ms"] = graph_ms(fresh_fwd_bwd)
        except Exception as e:  # a path that cannot be captured: say so, keep the row
            out["gpu_fwdbwd_ms"] = math.nan
            print(f"   {name}: no CUDA-graph timing ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
        for t in leaves:
            t.grad = None
    out["peak_mib"] = peak_mib(fwd_bwd)
    for t in leaves:
        t.grad = None
    return out


def run(args) -> List[Dict]:
    if args.autotune:
        os.environ["NEMO_SSA_AUTOTUNE"] = "1"
    from nemo_ssa.ops.attention.flash import fwd_config
    from nemo_ssa.ops.common.bwd_config import bwd_config

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    causal = not args.full
    want = [r.strip() for r in args.rows.split(",") if r.strip()]
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | dtype {args.dtype} | "
          f"{'causal' if causal else 'full'} | autotune {os.environ.get('NEMO_SSA_AUTOTUNE', '0')}", flush=True)
    results = []
    for shp in _shapes(args):
        B, Hq, Hkv, N, D = shp["B"], shp["Hq"], shp["Hkv"], shp["N"], shp["D"]
        print(f"## {shp['label']}: B={B} N={N} Hq={Hq} Hkv={Hkv} D={D} | fwd cfg {tuple(fwd_config(D, causal, dtype))} "
              f"bwd cfg {tuple(bwd_config(D, causal, dtype))}", flush=True)
        q, k, v, go, n, b = make_inputs(B, Hq, Hkv, N, D, dtype, dev)
        rows: Dict[str, Dict] = {}
        for name in want:
            try:
                if name not in ROWS:
                    raise SystemExit(f"unknown row {name!r}; choose from {ROWS}")
                fn, extra, mark = row_fn(name, causal, q, k, v, n, b)
                old = os.environ.get("NEMO_SSA_POLY_LOG2")
                os.environ["NEMO_SSA_POLY_LOG2"] = "1" if name == "ssa_triton_poly" else "0"
                try:
                    r = _bench_row(name, fn, q, k, v, go, args.rep, extra, gpu_time=args.gpu_time)
                finally:
                    if old is None:
                        os.environ.pop("NEMO_SSA_POLY_LOG2", None)
                    else:
                        os.environ["NEMO_SSA_POLY_LOG2"] = old
                r["note"] = mark
            except torch.cuda.OutOfMemoryError:
                r = dict(fwd_ms=math.nan, fwdbwd_ms=math.nan, peak_mib=math.nan, note="OOM")
            except Exception as e:  # a backend missing on this build: report, keep going
                r = dict(fwd_ms=math.nan, fwdbwd_ms=math.nan, peak_mib=math.nan,
                         note=f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:60]})")
            finally:
                for t in (q, k, v, n):
                    t.grad = None
                torch.cuda.empty_cache()
            rows[name] = r
            print(f"   {name:15s} fwd {r['fwd_ms']:8.3f} ms  fwd+bwd {r['fwdbwd_ms']:8.3f} ms  "
                  f"peak {r['peak_mib']:9.1f} MiB {r['note']}", flush=True)
        for name, r in rows.items():
            fl, cu = rows.get("sdpa_flash", {}), rows.get("sdpa_cudnn", {})
            print(f"   {name:15s} x flash {r['fwd_ms'] / fl.get('fwd_ms', math.nan):5.2f} / "
                  f"{r['fwdbwd_ms'] / fl.get('fwdbwd_ms', math.nan):5.2f}   x cuDNN "
                  f"{r['fwd_ms'] / cu.get('fwd_ms', math.nan):5.2f} / {r['fwdbwd_ms'] / cu.get('fwdbwd_ms', math.nan):5.2f}"
                  "  (fwd / fwd+bwd)" + (f"   GPU-time fwd+bwd x cuDNN {r.get('gpu_fwdbwd_ms', math.nan) / cu.get('gpu_fwdbwd_ms', math.nan):5.2f}"
                                         if args.gpu_time else ""), flush=True)
        ref_flash = rows.get("sdpa_flash", {})
        ref_cudnn = rows.get("sdpa_cudnn", {})
        for name, r in rows.items():
            res = dict(shape=shp["label"], B=B, N=N, Hq=Hq, Hkv=Hkv, D=D, impl=name, **r)
            res["fwd_tflops"] = _flops(B, Hq, N, D, causal, False) / (r["fwd_ms"] * 1e-3) / 1e12
            res["fwdbwd_tflops"] = _flops(B, Hq, N, D, causal, True) / (r["fwdbwd_ms"] * 1e-3) / 1e12
            for tag, ref in (("flash", ref_flash), ("cudnn", ref_cudnn)):
                res[f"fwd_x_{tag}"] = r["fwd_ms"] / ref.get("fwd_ms", math.nan)
                res[f"fwdbwd_x_{tag}"] = r["fwdbwd_ms"] / ref.get("fwdbwd_ms", math.nan)
            if args.gpu_time:
                res["gpu_fwdbwd_x_cudnn"] = r.get("gpu_fwdbwd_ms", math.nan) / ref_cudnn.get("gpu_fwdbwd_ms", math.nan)
            results.append(res)
        del q, k, v, go
        torch.cuda.empty_cache()
    return results


COLS = [("shape", "{}"), ("B", "{}"), ("N", "{}"), ("Hq", "{}"), ("Hkv", "{}"), ("D", "{}"), ("impl", "{}"),
        ("fwd_ms", "{:.3f}"), ("fwdbwd_ms", "{:.3f}"), ("fwd_tflops", "{:.1f}"), ("fwdbwd_tflops", "{:.1f}"),
        ("peak_mib", "{:.0f}"), ("fwd_x_flash", "{:.2f}"), ("fwdbwd_x_flash", "{:.2f}"),
        ("fwd_x_cudnn", "{:.2f}"), ("fwdbwd_x_cudnn", "{:.2f}"), ("gpu_fwdbwd_ms", "{:.3f}"),
        ("gpu_fwdbwd_x_cudnn", "{:.2f}"), ("note", "{}")]


def _fmt(res: Dict) -> List[str]:
    out = []
    for key, f in COLS:
        val = res.get(key)
        out.append("-" if val is None or (isinstance(val, float) and math.isnan(val)) else f.format(val))
    return out


def table(results: List[Dict]) -> str:
    head = [c for c, _ in COLS]
    body = [_fmt(r) for r in results]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in body])


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to benchmark", file=sys.stderr)
        return 2
    results = run(args)
    md = table(results)
    print("\n" + md)
    if args.out:
        if args.out.endswith(".csv"):
            with open(args.out, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow([c for c, _ in COLS])
                w.writerows(_fmt(r) for r in results)
        else:
            with open(args.out, "w") as fh:
                fh.write(md + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
