"""SSA through FlexAttention: cost of a learnable n, per dn strategy, vs SDPA flash.

All rows run in one process on the same inputs (model shape by default: B=4, N=4096,
Hq=24, Hkv=8, D=32, causal, bf16; n learnable, b fixed at 0.8 as in the training policy)::

    python -m benchmarks.bench_flex                     # all rows
    python -m benchmarks.bench_flex --quick             # fewer repetitions
    python -m benchmarks.bench_flex --learnable-b       # dn and db
    python -m benchmarks.bench_flex --out docs/results/flex.md   # also write markdown (.csv works)

Rows: ``sdpa_flash`` (softmax, SDPA pinned to flash, GQA via ``enable_gqa``);
``flex_softmax`` (compiled flex, causal BlockMask); ``flex_ssa_const`` (n, b constant:
q/k/v gradients only); ``flex_ssa_<mode>`` with learnable n for every ``dn_mode`` of
``nemo_ssa.ops.attention.flex``: ``capture`` (the naive captured 1-element tensor, flex's
captured-gradient atomics), ``capture_rows`` (n materialised per (b, h, q) row),
``triton`` (default: flex with n detached + a Triton dn pass), ``flex`` (an extra fp32
flex forward with log-weights), ``chunked`` (torch); and ``dnpass_<mode>``: the extra
dn/db pass alone (its time is in the fwd+bwd column). Columns: median ms of the forward
(grad mode on, no backward) and of forward+backward, ratios of fwd+bwd to SDPA flash
and to ``flex_ssa_const``, the first call's wall time (compile included), peak memory
of one fwd+bwd above the inputs, and dn (db) relative error against ``chunked`` (fp32
torch, checked against the float64 reference in the tests). The table is printed last.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

MODES = ("capture", "capture_rows", "triton", "flex", "chunked")
ROWS = (("sdpa_flash", "flex_softmax", "flex_ssa_const")
        + tuple(f"flex_ssa_{m}" for m in MODES) + ("dnpass_triton", "dnpass_flex", "dnpass_chunked"))


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (same rows)")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--hq", type=int, default=24)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--D", type=int, default=32)
    ap.add_argument("--full", action="store_true", help="non-causal instead of causal")
    ap.add_argument("--learnable-b", action="store_true", help="b learnable too (db computed)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list from {ROWS}")
    ap.add_argument("--rep", type=int, default=None, help="do_bench budget per row in ms (default 100, quick 30)")
    ap.add_argument("--out", default=None, help="also write the table (.md or .csv)")
    return ap.parse_args(argv)


def _time(fn: Callable[[], object], rep_ms: int, slow_reps: int) -> float:
    """Median ms: triton's do_bench, or a few plain timed calls for very slow rows."""
    import triton.testing

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    if once > 200.0:  # e.g. the captured-gradient row (~1.4 s per call): no 5-call estimate
        ts = []
        for _ in range(slow_reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2]
    return triton.testing.do_bench(fn, rep=rep_ms, return_mode="median")


def run(args) -> List[Dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    import nemo_ssa.ops.attention.flex as fx

    cfgd = torch._dynamo.config  # one process compiles several flex graphs
    setattr(cfgd, "recompile_limit" if hasattr(cfgd, "recompile_limit") else "cache_size_limit", 64)
    B, N, Hq, Hkv, D = args.B, args.N, args.hq, args.hkv, args.D
    causal = not args.full
    rep = args.rep or (30 if args.quick else 100)
    slow_reps = 1 if args.quick else 3
    want = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in want:
        if r not in ROWS:
            raise SystemExit(f"unknown row {r!r}; choose from {ROWS}")
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | B={B} N={N} Hq={Hq} Hkv={Hkv} "
          f"D={D} {'causal' if causal else 'full'} bf16 | n learnable, b {'learnable' if args.learnable_b else 'fixed'}"
          f" | flex backends {fx.supported_backends()} | triton dn: {fx._triton_usable(dev) or 'ok'}", flush=True)

    torch.manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(B, Hq, N, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, Hkv, N, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, Hkv, N, D, device=dev, dtype=dt, requires_grad=True)
    go = torch.randn(B, Hq, N, D, device=dev, dtype=dt)
    n = torch.tensor([1.5], device=dev, requires_grad=True)
    b = torch.tensor([0.8], device=dev, requires_grad=args.learnable_b)
    n_c, b_c = n.detach().clone(), b.detach().clone()
    params = [n, b] if args.learnable_b else [n]

    def grads_of(out, leaves):
        return torch.autograd.grad(out, leaves, go)

    fns: Dict[str, tuple] = {}  # name -> (forward fn, leaves)
    sdpa_note = ""
    if "sdpa_flash" in want:
        sdpa, sdpa_note = _sdpa_flash_fn(q, k, v, causal, SDPBackend, sdpa_kernel)
        fns["sdpa_flash"] = (sdpa, [q, k, v])
    bm = create_block_mask(fx._causal_mask_mod(N, N), None, None, N, N, device=dev) if causal else None
    soft = fx._compiled_fn("softmax")
    fns["flex_softmax"] = (lambda: soft(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv), [q, k, v])
    fns["flex_ssa_const"] = (lambda: fx.ssa_attention_flex(q, k, v, n_c, b_c, causal=causal, compile=True),
                             [q, k, v])
    for m in MODES:
        fns[f"flex_ssa_{m}"] = (lambda m=m: fx.ssa_attention_flex(q, k, v, n, b, causal=causal, compile=True,
                                                                  dn_mode=m), [q, k, v, *params])

    # o, lse of the SSA forward for the stand-alone dn passes
    saved = {}

    def dn_pass(mode):
        if not saved:
            cfg = fx._make_cfg(q, k, mode="triton", scale=1.0 / math.sqrt(D), causal=causal, mask_mod=None,
                               keep_mask=None, mask_per_batch=True, mask_per_head=False, compiled=True,
                               kernel_options=None, compile_request=True)
            with torch.no_grad():
                o, lse = fx._flex_call(q.detach(), k.detach(), v.detach(), fx.ssa_score_mod(n_c, b_c),
                                       cfg.block_mask_for(1),
                                       cfg.scale, return_lse=True, cfg=cfg, kind="main")
            saved.update(o=o, lse=lse)
        return fx.ssa_flex_param_grads(q.detach(), k.detach(), v.detach(), saved["o"], go, saved["lse"], n_c, b_c,
                                       causal=causal, mode=mode, need_b=args.learnable_b, compile=True)

    rows: Dict[str, Dict] = {}
    ref_grads = {}
    for name in want:
        r = dict(impl=name, fwd_ms=math.nan, fwdbwd_ms=math.nan, first_s=math.nan, peak_mib=math.nan,
                 dn_rel=math.nan, db_rel=math.nan, note=sdpa_note if name == "sdpa_flash" else "")
        print(f"   {name:22s} ...", flush=True)
        try:
            if name.startswith("dnpass_"):
                mode = name[len("dnpass_"):]
                t0 = time.perf_counter()
                dn_pass(mode)
                torch.cuda.synchronize()
                r["first_s"] = time.perf_counter() - t0
                r["fwdbwd_ms"] = _time(lambda: dn_pass(mode), rep, slow_reps)
                r["note"] = "extra pass only"
            else:
                fwd, leaves = fns[name]
                t0 = time.perf_counter()
                g = grads_of(fwd(), leaves)  # compile + warm-up
                torch.cuda.synchronize()
                r["first_s"] = time.perf_counter() - t0
                r["fwd_ms"] = _time(fwd, rep, slow_reps)
                r["fwdbwd_ms"] = _time(lambda: grads_of(fwd(), leaves), rep, slow_reps)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                g = grads_of(fwd(), leaves)
                torch.cuda.synchronize()
                r["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                if name.startswith("flex_ssa_") and name != "flex_ssa_const":
                    npar = len(params)  # leaves are (q, k, v, *params): params last
                    ref_grads[name] = ([t.detach().float() for t in g[:-npar]],
                                       [t.detach().float() for t in g[-npar:]])
        except torch.cuda.OutOfMemoryError:
            r["note"] = "OOM"
        except Exception as e:  # report and keep going: the lead runs this once
            r["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        torch.cuda.empty_cache()
        rows[name] = r
        print(f"   {name:22s} fwd {r['fwd_ms']:9.3f} ms  fwd+bwd {r['fwdbwd_ms']:9.3f} ms  "
              f"first {r['first_s']:6.1f} s  peak {r['peak_mib']:8.0f} MiB  {r['note']}", flush=True)

    # accuracy of dn (db) per strategy against chunked; dq/dk/dv identity for the injector modes
    ref = ref_grads.get("flex_ssa_chunked")
    for name, (g_qkv, g_par) in ref_grads.items():
        rows[name]["note"] += f" dn={g_par[0].item():+.5e}"
        if ref is None:
            rows[name]["note"] += " (no chunked row: dn not compared)"
            continue
        rows[name]["dn_rel"] = _rel(g_par[0], ref[1][0])
        if args.learnable_b:
            rows[name]["db_rel"] = _rel(g_par[1], ref[1][1])
        if g_qkv and not all(torch.equal(x, y) for x, y in zip(g_qkv, ref[0])):
            rows[name]["note"] += f" dq rel diff {_rel(g_qkv[0], ref[0][0]):.1e}"
    base_sdpa = rows.get("sdpa_flash", {}).get("fwdbwd_ms", math.nan)
    base_const = rows.get("flex_ssa_const", {}).get("fwdbwd_ms", math.nan)
    out = []
    for name, r in rows.items():
        r["x_sdpa"] = r["fwdbwd_ms"] / base_sdpa
        r["x_const"] = r["fwdbwd_ms"] / base_const
        out.append(r)
    return out


def _rel(x, ref) -> float:
    return (torch.linalg.vector_norm((x - ref).double()) / torch.linalg.vector_norm(ref.double())).item()


def _sdpa_flash_fn(q, k, v, causal, SDPBackend, sdpa_kernel):
    """SDPA pinned to flash with ``enable_gqa``; if flash rejects GQA, K/V are expanded once
    outside the timed region (row marked ``*``)."""
    g = q.shape[1] // k.shape[1]

    def gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=g > 1)

    try:
        gqa()
        return gqa, ""
    except RuntimeError:
        pass
    ke = k.detach().repeat_interleave(g, 1).requires_grad_()
    ve = v.detach().repeat_interleave(g, 1).requires_grad_()

    def expanded():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)

    return expanded, "* K/V expanded outside timing (flash rejected enable_gqa)"


COLS = [("impl", "{}"), ("fwd_ms", "{:.3f}"), ("fwdbwd_ms", "{:.3f}"), ("x_sdpa", "{:.2f}"),
        ("x_const", "{:.2f}"), ("first_s", "{:.1f}"), ("peak_mib", "{:.0f}"), ("dn_rel", "{:.1e}"),
        ("db_rel", "{:.1e}"), ("note", "{}")]


def _fmt(r, key, f):
    v = r.get(key, "")
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f.format(v)


def table_md(results: List[Dict]) -> str:
    head = "| " + " | ".join(c for c, _ in COLS) + " |"
    sep = "|" + "|".join("---" for _ in COLS) + "|"
    body = ["| " + " | ".join(_fmt(r, c, f) for c, f in COLS) + " |" for r in results]
    return "\n".join([head, sep, *body])


def main(argv=None):
    args = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_flex needs a CUDA device")
    results = run(args)
    if args.out:
        if args.out.endswith(".csv"):
            with open(args.out, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=[c for c, _ in COLS], extrasaction="ignore")
                w.writeheader()
                w.writerows(results)
        else:
            with open(args.out, "w") as fh:
                fh.write(f"# bench_flex: {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n"
                         f"B={args.B} N={args.N} Hq={args.hq} Hkv={args.hkv} D={args.D} "
                         f"{'full' if args.full else 'causal'} bf16; fwd+bwd ratios: x_sdpa vs sdpa_flash, "
                         f"x_const vs flex_ssa_const.\n\n" + table_md(results) + "\n")
        print(f"wrote {args.out}")
    print()
    print(table_md(results))


if __name__ == "__main__":
    main()
