"""NSA speed vs SDPA-flash (full causal), per branch and whole layer, in one run.

For each head dim D and sequence length N (B=1, Hq=24, Hkv=8 by default, bf16), times
with ``triton.testing.do_bench`` (median, ms), forward and forward+backward:

  sdpa_flash   F.scaled_dot_product_attention(is_causal=True), flash backend, K/V
               expanded to Hq outside the timed region
  nsa_layer    nemo_ssa.ops.nsa.nsa_attention(impl="triton"): φ compression, compressed
               attention, selection, selected attention, window attention, gates
  compressed   φ(k), φ(v) + compressed attention (the branch as the layer runs it)
  selection    selection scores + top-n (forward only; no gradient)
  selected     selected-block attention on a fixed selection
  window       sliding-window attention
  fla_nsa      fla's ``parallel_nsa`` (fla-core, when installed; GQA a power of 2 >= 16) with
               compressed + selected branches and no window branch (fla runs that one through
               flash_attn), non-overlapping 64-token compression blocks: a forward/backward
               speed reference, not the same configuration as ours (l=32, d=16, window 512)

and prints (last) a table with ms, tokens/s and the speedup of SDPA time over the
row's time (``x_sdpa`` > 1: faster than SDPA-flash), plus the compressed/window
per-token cost ratio. Targets: nsa_layer fwd+bwd faster than SDPA from
N=16K and >= 3x at 64K; compressed within 2x of window per token.

Usage:
    python benchmarks/bench_nsa.py                    # N = 4K, 16K, 32K, 64K; D = 32, 128
    python benchmarks/bench_nsa.py --quick            # N = 4K, 16K; D = 32; shorter timing
    python benchmarks/bench_nsa.py --out results.md   # also write the table (.md or .csv)
    python benchmarks/bench_nsa.py --dkv-split 1      # A/B: range backward's dK/dV without a query split
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COLUMNS = ["D", "N", "what", "mode", "ms", "tok_per_s", "x_sdpa"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", default="4096,16384,32768,65536", help="comma-separated sequence lengths")
    p.add_argument("--dims", default="32,128", help="comma-separated head dims")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hq", type=int, default=24)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--transform", default="softmax", choices=["softmax", "ssa"])
    p.add_argument("--compress", default="mlp", choices=["mlp", "mean"])
    p.add_argument("--quick", action="store_true", help="N = 4K, 16K; D = 32; shorter timing")
    p.add_argument("--warmup-ms", type=int, default=50)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--only", default="", help="comma-separated subset of rows (sdpa_flash,nsa_layer,...)")
    p.add_argument("--out", default=None, help="write the table to this .md or .csv path")
    p.add_argument("--dkv-split", type=int, default=0,
                   help="query chunks of the range backward's dK/dV kernel (0: automatic; A/B switch)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script itself on CPU: Triton interpreter, N=128, one timed call (numbers meaningless)")
    args = p.parse_args(argv)
    if args.dkv_split < 0:
        p.error("--dkv-split must be >= 0")
    if args.cpu_smoke:
        args.ns, args.dims, args.hq, args.hkv = "128", "32", 6, 2
    if args.quick:
        args.ns, args.dims, args.warmup_ms, args.rep_ms = "4096,16384", "32", 25, 100
    return args


def fmt_table(rows: List[Dict]) -> str:
    """Markdown table of the result rows (also what is printed)."""
    cols = COLUMNS + ["note"]
    head = "| " + " | ".join(cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, float):
                v = "nan" if math.isnan(v) else (f"{v:.3f}" if c in ("ms", "x_sdpa") else f"{v:,.0f}")
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_out(path: str, rows: List[Dict], preamble: str) -> None:
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS + ["note"], extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow(r)
    else:
        with open(path, "w") as f:
            f.write(preamble + "\n\n" + fmt_table(rows) + "\n")


MIN_WARMUP_CALLS = 3
MIN_TIMED_CALLS = 10


def bench(fn: Callable[[], None], warmup: int, rep: int) -> float:
    if not torch.cuda.is_available():  # --cpu-smoke: one call, wall clock
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    # do_bench sizes its loops from a 5-call estimate: at 64K a 130 ms call got one warm-up
    # and ONE timed call, and the first case in a process ran up to 9% slow
    # (docs/results/2026-11-26-nsa-qmajor-dq, calls 9-10). So at least MIN_WARMUP_CALLS
    # warm-up and MIN_TIMED_CALLS timed calls, whatever the time budgets say.
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    warmup = max(warmup, MIN_WARMUP_CALLS * est)
    rep = max(rep, MIN_TIMED_CALLS * est)
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def run_case(args, D: int, N: int, only: set) -> List[Dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nemo_ssa.ops.nsa import NSAConfig, compress_kv, init_phi_params, nsa_attention
    from nemo_ssa.ops.nsa.range_attn import compressed_attention, window_attention
    from nemo_ssa.ops.nsa.select import select_blocks_triton
    from nemo_ssa.ops.nsa.selected_attn import selected_attention

    dev, dt = ("cpu", torch.float32) if args.cpu_smoke else ("cuda", DTYPES[args.dtype])
    B, HQ, HKV = args.batch, args.hq, args.hkv
    cfg = NSAConfig(compress=args.compress)
    if args.cpu_smoke:
        cfg = NSAConfig(block_len=8, stride=4, select_block=16, top_n=4, window=32, compress=args.compress)
    g = torch.Generator(device=dev).manual_seed(N + D)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g).requires_grad_()

    q = r(B, HQ, N, D)
    kv = [r(B, HKV, N, D) for _ in range(6)]
    gates = r(B, HQ, N, 3)
    phi = [init_phi_params(cfg, D, dtype=dt, device=dev, std=0.02, requires_grad=True) for _ in range(2)]
    ssa = {}
    if args.transform == "ssa":
        ssa = dict(n=torch.tensor([1.5], device=dev, requires_grad=True), b=torch.tensor([0.8], device=dev))
    do = torch.randn(B, HQ, N, D, device=dev, dtype=dt, generator=g)
    kw = dict(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5], transform=args.transform, **ssa)
    if cfg.compress == "mlp":
        kw.update(phi_k=phi[0], phi_v=phi[1])
    warm, rep = args.warmup_ms, args.rep_ms
    tokens = B * N

    def layer():
        return nsa_attention(q, kv[0], kv[1], gates, cfg, impl="triton", **kw)

    def compressed():
        kc = compress_kv(kv[0], cfg, phi[0] if cfg.compress == "mlp" else None)
        vc = compress_kv(kv[1], cfg, phi[1] if cfg.compress == "mlp" else None)
        return compressed_attention(q, kc, vc, cfg.block_len, cfg.stride, transform=args.transform, **ssa)[0]

    with torch.no_grad():
        kc0 = compress_kv(kv[0], cfg, phi[0] if cfg.compress == "mlp" else None)
        _, lse0 = compressed_attention(q, kc0, kc0, cfg.block_len, cfg.stride, transform=args.transform, **ssa)
        idx0 = select_blocks_triton(q, kc0, lse0, cfg, transform=args.transform, **ssa)

    def selection():
        with torch.no_grad():
            return select_blocks_triton(q, kc0, lse0, cfg, transform=args.transform, **ssa)

    def selected():
        return selected_attention(q, kv[2], kv[3], idx0, cfg.select_block, transform=args.transform, **ssa)

    def window():
        return window_attention(q, kv[4], kv[5], cfg.window, transform=args.transform, **ssa)

    kexp = kv[0].detach().repeat_interleave(HQ // HKV, 1).requires_grad_()
    vexp = kv[1].detach().repeat_interleave(HQ // HKV, 1).requires_grad_()
    qd = q.detach().requires_grad_()

    def sdpa():
        if dev == "cpu":
            return F.scaled_dot_product_attention(qd, kexp, vexp, is_causal=True)
        backends = [SDPBackend.FLASH_ATTENTION] if dt != torch.float32 else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(qd, kexp, vexp, is_causal=True)

    fla_nsa, fla_why, fla_in = None, "", []
    group = HQ // HKV
    try:
        from fla.ops.nsa import parallel_nsa
    except ImportError:
        fla_why = "fla-core not installed"
    else:
        if group < 16 or group & (group - 1):
            fla_why = f"fla's parallel_nsa needs GQA a power of 2 >= 16 (here {group})"
        else:
            # fla's layout [B, T, H, D]; its compression pools non-overlapping blocks of its
            # selection block size (64) and it runs no window branch without flash_attn
            fq, fk, fv = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, kv[0], kv[1]))
            gc, gs = (torch.sigmoid(gates.detach()[..., i]).transpose(1, 2).contiguous().requires_grad_()
                      for i in (0, 1))
            fla_in = [fq, fk, fv, gc, gs]

            def fla_nsa():
                return parallel_nsa(fq, fk, fv, g_cmp=gc, g_slc=gs, block_counts=cfg.top_n,
                                    block_size=cfg.select_block, window_size=0).transpose(1, 2)

    def leaves(name):
        return {
            "fla_nsa": fla_in,
            "sdpa_flash": [qd, kexp, vexp],
            "nsa_layer": [q, *kv, gates] + ([*phi[0], *phi[1]] if cfg.compress == "mlp" else []),
            "compressed": [q, kv[0], kv[1]] + ([*phi[0], *phi[1]] if cfg.compress == "mlp" else []),
            "selected": [q, kv[2], kv[3]],
            "window": [q, kv[4], kv[5]],
        }[name]

    fns = dict(sdpa_flash=sdpa, nsa_layer=layer, compressed=compressed, selection=selection,
               selected=selected, window=window, fla_nsa=fla_nsa)
    rows: List[Dict] = []
    sdpa_ms: Dict[str, float] = {}
    for name, fn in fns.items():
        if only and name not in only and name != "sdpa_flash":
            continue
        if fn is None:  # fla: say why there is no row
            rows.append(dict(D=D, N=N, what=name, mode="-", ms=float("nan"), tok_per_s=float("nan"),
                             x_sdpa=float("nan"), note=fla_why))
            print(f"  D={D:<4} N={N:<6} {name:<11} skipped: {fla_why}", flush=True)
            continue
        modes = ["fwd"] if name == "selection" else ["fwd", "fwd+bwd"]
        for mode in modes:
            row = dict(D=D, N=N, what=name, mode=mode)
            try:
                if mode == "fwd":
                    def call(fn=fn):
                        with torch.no_grad():
                            fn()
                else:
                    ins = leaves(name)

                    def call(fn=fn, ins=ins):
                        out = fn()
                        torch.autograd.grad(out, ins, do, allow_unused=True)
                ms = bench(call, warm, rep)
                row.update(ms=ms, tok_per_s=tokens / (ms * 1e-3))
            except torch.OutOfMemoryError:
                row.update(ms=float("nan"), tok_per_s=float("nan"), note="OOM")
                torch.cuda.empty_cache()
            if name == "sdpa_flash":
                sdpa_ms[mode] = row["ms"]
            ref = sdpa_ms.get(mode, float("nan"))
            row["x_sdpa"] = ref / row["ms"] if row["ms"] == row["ms"] else float("nan")
            rows.append(row)
            print(f"  D={D:<4} N={N:<6} {name:<11} {mode:<8} {row['ms']:9.3f} ms  x_sdpa={row['x_sdpa']:.2f}",
                  flush=True)
    del q, kv, gates, phi, kexp, vexp, qd
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    elif not torch.cuda.is_available():
        print("bench_nsa.py needs a CUDA device (the NSA kernels are Triton GPU kernels); "
              "--cpu-smoke checks the script on CPU.", file=sys.stderr)
        return 2
    import triton

    if args.dkv_split:
        from nemo_ssa.ops.nsa import range_attn

        range_attn.TILE_OVERRIDE["dkv_split"] = args.dkv_split
    ns = [int(x) for x in args.ns.split(",") if x]
    dims = [int(x) for x in args.dims.split(",") if x]
    only = {x for x in args.only.split(",") if x}
    device = "CPU (interpreter smoke run)" if args.cpu_smoke else torch.cuda.get_device_name()
    preamble = (f"# bench_nsa: {device} | torch {torch.__version__} | triton "
                f"{triton.__version__} | B={args.batch} Hq={args.hq} Hkv={args.hkv} {'fp32' if args.cpu_smoke else args.dtype} "
                f"transform={args.transform} compress={args.compress} | NSA "
                + ("l=8 d=4 l'=16 n=4 w=32" if args.cpu_smoke else "l=32 d=16 l'=64 n=16 w=512"))
    print(preamble, flush=True)
    rows: List[Dict] = []
    for D in dims:
        for N in ns:
            rows += run_case(args, D, N, only)

    # compressed vs window per-token cost (fwd+bwd): same tokens, so a ratio of times
    notes = []
    for D in dims:
        for N in ns:
            t = {r["what"]: r["ms"] for r in rows if r["D"] == D and r["N"] == N and r["mode"] == "fwd+bwd"}
            if "compressed" in t and "window" in t:
                notes.append(f"D={D} N={N}: compressed/window per-token fwd+bwd cost = {t['compressed'] / t['window']:.2f}")
    if args.out:
        write_out(args.out, rows, preamble + "\n\n" + "\n".join(f"- {n}" for n in notes))
    print()
    print(preamble)
    for n in notes:
        print("- " + n)
    print(fmt_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
