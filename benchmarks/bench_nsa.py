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

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.timing import median_ms  # noqa: E402

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


def bench(fn: Callable[[], None], warmup: int, rep: int) -> float:
    return median_ms(fn, warmup_ms=warmup, rep_ms=rep)


ROW_NAMES = ("sdpa_flash", "nsa_layer", "compressed", "selection", "selected", "window", "fla_nsa")
#: the CPU smoke's NSA block sizes (N=128)
SMOKE_NSA = dict(block_len=8, stride=4, select_block=16, top_n=4, window=32)


def build_case(D: int, N: int, *, batch: int, hq: int, hkv: int, dtype, device, transform: str = "softmax",
               compress: str = "mlp", small_blocks: bool = False) -> Dict:
    """Inputs and callables of every row of one (D, N) case.

    Returns a dict: ``fns`` {row: fn() -> output}, ``leaves`` {row: tensors its fwd+bwd
    differentiates}, ``refs`` {row: fn() -> the torch reference's output on the same
    inputs} (rows with one), ``do`` (output gradient), ``skipped`` {row: why}, ``tokens``.
    ``small_blocks``: the CPU smoke's NSA sizes (``SMOKE_NSA``) instead of the defaults.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nemo_ssa.ops.nsa import NSAConfig, compress_kv, init_phi_params, nsa_attention
    from nemo_ssa.ops.nsa.naive import compressed_visibility, masked_attention, selection_keep_mask, window_mask
    from nemo_ssa.ops.nsa.range_attn import compressed_attention, window_attention
    from nemo_ssa.ops.nsa.select import select_blocks_triton
    from nemo_ssa.ops.nsa.selected_attn import selected_attention

    dev, dt = torch.device(device), dtype
    B, HQ, HKV = batch, hq, hkv
    cfg = NSAConfig(compress=compress, **(SMOKE_NSA if small_blocks else {}))
    g = torch.Generator(device=dev).manual_seed(N + D)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g).requires_grad_()

    q = r(B, HQ, N, D)
    kv = [r(B, HKV, N, D) for _ in range(6)]
    gates = r(B, HQ, N, 3)
    phi = [init_phi_params(cfg, D, dtype=dt, device=dev, std=0.02, requires_grad=True) for _ in range(2)]
    ssa = {}
    if transform == "ssa":
        ssa = dict(n=torch.tensor([1.5], device=dev, requires_grad=True), b=torch.tensor([0.8], device=dev))
    do = torch.randn(B, HQ, N, D, device=dev, dtype=dt, generator=g)
    kw = dict(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5], transform=transform, **ssa)
    if cfg.compress == "mlp":
        kw.update(phi_k=phi[0], phi_v=phi[1])
    tokens = B * N

    def layer():
        return nsa_attention(q, kv[0], kv[1], gates, cfg, impl="triton", **kw)

    def compressed():
        kc = compress_kv(kv[0], cfg, phi[0] if cfg.compress == "mlp" else None)
        vc = compress_kv(kv[1], cfg, phi[1] if cfg.compress == "mlp" else None)
        return compressed_attention(q, kc, vc, cfg.block_len, cfg.stride, transform=transform, **ssa)[0]

    with torch.no_grad():
        kc0 = compress_kv(kv[0], cfg, phi[0] if cfg.compress == "mlp" else None)
        _, lse0 = compressed_attention(q, kc0, kc0, cfg.block_len, cfg.stride, transform=transform, **ssa)
        idx0 = select_blocks_triton(q, kc0, lse0, cfg, transform=transform, **ssa)

    def selection():
        with torch.no_grad():
            return select_blocks_triton(q, kc0, lse0, cfg, transform=transform, **ssa)

    def selected():
        return selected_attention(q, kv[2], kv[3], idx0, cfg.select_block, transform=transform, **ssa)

    def window():
        return window_attention(q, kv[4], kv[5], cfg.window, transform=transform, **ssa)

    kexp = kv[0].detach().repeat_interleave(HQ // HKV, 1).requires_grad_()
    vexp = kv[1].detach().repeat_interleave(HQ // HKV, 1).requires_grad_()
    qd = q.detach().requires_grad_()

    def sdpa():
        if dev.type == "cpu":
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

    # torch references on the same inputs (the dry run's agreement check)
    attn = dict(transform=transform, **ssa)
    causal = torch.ones(N, N, dtype=torch.bool, device=dev).tril()

    def ref_layer():
        return nsa_attention(q, kv[0], kv[1], gates, cfg, impl="torch", **kw)

    def ref_compressed():
        kc = compress_kv(kv[0], cfg, phi[0] if cfg.compress == "mlp" else None)
        vc = compress_kv(kv[1], cfg, phi[1] if cfg.compress == "mlp" else None)
        return masked_attention(q, kc, vc, compressed_visibility(N, cfg, dev), **attn)[0]

    def ref_selected():
        keep = (selection_keep_mask(idx0, N, cfg) & causal).repeat_interleave(HQ // HKV, dim=1)
        return masked_attention(q, kv[2], kv[3], keep, **attn)[0]

    def ref_window():
        return masked_attention(q, kv[4], kv[5], window_mask(N, cfg.window, dev), **attn)[0]

    def ref_sdpa():  # SDPA is plain softmax whatever the transform
        return masked_attention(qd, kexp, vexp, causal)[0]

    refs = dict(sdpa_flash=ref_sdpa, nsa_layer=ref_layer, compressed=ref_compressed, selected=ref_selected,
                window=ref_window)
    leaf_map = {name: leaves(name) for name in ROW_NAMES if name not in ("selection",) and fns[name] is not None}
    return dict(fns=fns, leaves=leaf_map, refs=refs, do=do, skipped={"fla_nsa": fla_why} if fla_nsa is None else {},
                tokens=tokens, cfg=cfg)


def run_case(args, D: int, N: int, only: set) -> List[Dict]:
    dev, dt = ("cpu", torch.float32) if args.cpu_smoke else ("cuda", DTYPES[args.dtype])
    case = build_case(D, N, batch=args.batch, hq=args.hq, hkv=args.hkv, dtype=dt, device=dev,
                      transform=args.transform, compress=args.compress, small_blocks=args.cpu_smoke)
    fns, do, tokens = case["fns"], case["do"], case["tokens"]
    fla_why = case["skipped"].get("fla_nsa", "")
    warm, rep = args.warmup_ms, args.rep_ms
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
                    ins = case["leaves"][name]

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
    del case, fns
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
