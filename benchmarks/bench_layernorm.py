"""Tile sweep of LayerNorm1P's Triton kernels (nemo_ssa.ops.norm) at the model's shapes.

    python benchmarks/bench_layernorm.py --out $OUT/ln-tiles.md

For hidden 768 at 8 x 1024 and 32 x 1024 tokens (megatron's ``[s, b, h]``, bf16) and the
wide shapes of ``benchmarks/run.py --op layernorm``: every candidate ``[BLOCK_M, BLOCK_N,
warps, backward programs per SM]`` is first checked against torch's fp32 LayerNorm (output
and dx, dw, db within 2x the bf16 eager error + 1e-5) and then timed fwd+bwd
(``benchmarks.timing.median_ms``), beside torch's kernels (the ``model.fused_layernorm=false``
path). The last table names the fastest candidate per shape and ``tile()``'s current choice,
so the default can be replaced by a measured one. A head-to-head of the chosen tiles against
the libraries is ``benchmarks/run.py --op layernorm``.
"""

from __future__ import annotations

import argparse
import sys
from typing import List

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.timing import median_ms  # noqa: E402
from nemo_ssa.ops.norm import fused, layer_norm_1p  # noqa: E402
from nemo_ssa.testing import rel_err  # noqa: E402

SHAPES = {"recipe-B8": (1024, 8, 768), "recipe-B32": (1024, 32, 768), "h2048-B8": (1024, 8, 2048),
          "h4096-B4": (1024, 4, 4096)}
BLOCK_MS = (1, 2, 4, 8)
WARPS = (4, 8)
PROGRAMS_PER_SM = (2, 4, 8)


def fwd_bwd(fn, x, w, b, dy):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = b.detach().requires_grad_()
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--out", default=None, help="markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layernorm.py needs CUDA", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines: List[str] = [f"# LayerNorm1P tiles, {torch.cuda.get_device_name()} ({sms} SMs), bf16, fwd+bwd\n",
                        "| shape | tile [BLOCK_M, BLOCK_N, warps, programs] | ms | x torch | check |",
                        "|---|---|---|---|---|"]
    best_lines = ["| shape | torch ms | tile() default | default ms | fastest | fastest ms |", "|---|---|---|---|---|---|"]
    for name in args.shapes.split(","):
        s, bsz, h = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(s, bsz, h, device="cuda", generator=g).bfloat16()
        w = (0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
        b = (0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
        dy = torch.randn(s, bsz, h, device="cuda", generator=g).bfloat16()
        eager = lambda t, ww, bb: F.layer_norm(t, (h,), ww + 1, bb, 1e-5)  # noqa: E731 -- LayerNorm1P's torch path
        # fp32 leaves: gradients of bf16 leaves would be rounded to bf16 like the candidates'
        ref = fwd_bwd(lambda t, ww, bb: F.layer_norm(t, (h,), ww + 1, bb, 1e-5), x.float(), w.float(), b.float(),
                      dy.float())
        eager_out = fwd_bwd(eager, x, w, b, dy)
        torch_ms = median_ms(lambda: fwd_bwd(eager, x, w, b, dy))
        default = fused.tile(h, x.device)
        results = []
        block_n = fused.tile(h, x.device)[1]
        cands = [[bm, block_n, wp, pp * sms] for bm in BLOCK_MS for wp in WARPS for pp in PROGRAMS_PER_SM
                 if bm * block_n <= 16384]
        if default not in cands:
            cands.append(default)
        for t in cands:
            fn = (lambda tt, ww, bb, t=t: layer_norm_1p(tt, ww, bb, impl="triton", tiles=t))
            try:
                got = fwd_bwd(fn, x, w, b, dy)
                bad = [n for n, gg, e, r in zip(("y", "dx", "dw", "db"), got, eager_out, ref)
                       if not rel_err(gg, r) <= 2 * rel_err(e, r) + 1e-5]
                ms = median_ms(lambda: fwd_bwd(fn, x, w, b, dy))
            except Exception as e:  # noqa: BLE001 -- a tile that does not compile is a row, not a stop
                lines.append(f"| {name} | {t} | fail | - | {type(e).__name__} |")
                continue
            results.append((ms, t, bad))
            lines.append(f"| {name} | {t} | {ms:.4f} | {torch_ms / ms:.2f} | {'ok' if not bad else 'FAIL ' + ','.join(bad)} |")
        ok = [r for r in results if not r[2]]
        d = next((r for r in results if r[1] == default), None)
        if ok:
            f_ms, f_t, _ = min(ok, key=lambda r: r[0])
            best_lines.append(f"| {name} | {torch_ms:.4f} | {default} | {d[0] if d else float('nan'):.4f} | {f_t} | "
                              f"{f_ms:.4f} |")
        print(f"{name}: torch {torch_ms:.4f} ms, default {default} {d[0] if d else float('nan'):.4f} ms, "
              f"fastest {min(ok)[1] if ok else '-'} {min(ok)[0] if ok else float('nan'):.4f} ms", flush=True)
    text = "\n".join(lines) + "\n\n## Fastest per shape (programs = per SM x SMs)\n\n" + "\n".join(best_lines) + "\n"
    print("\n" + "\n".join(best_lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
