"""Library candidates for the non-attention parts of the 114M layer, timed against megatron's path.

    python benchmarks/bench_layer_libs.py --out $OUT/layer_libs.md

At the recipe's shapes (tokens = micro batch x 1024, hidden 768, vocab 50,304, ffn 3072,
bf16), fwd+bwd median ms and peak extra memory of:

* output layer + cross entropy: megatron (bf16 logits GEMM + ``vocab_parallel_cross_entropy``,
  which upcasts the [tokens, vocab] logits to fp32), liger-kernel's fused linear cross
  entropy, cut-cross-entropy, and ``torch.compile`` of the plain torch expression;
* LayerNorm (zero-centred gamma, as LayerNorm1P): torch eager, liger, torch.compile;
* squared-ReLU MLP: torch eager (``relu(x W1^T)^2 W2^T``), torch.compile of it.

Libraries that are not installed are reported, not fatal.
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

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.timing import median_ms, peak_mib  # noqa: E402


def bench(fn: Callable[[], None], leaves) -> Dict[str, float]:
    ms = median_ms(fn, rep_ms=100, grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    peak = peak_mib(fn)
    for t in leaves:
        t.grad = None
    return {"ms": ms, "peak_mib": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", default="8,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, V, FFN = 768, 50304, 3072
    rows: List[Dict] = []

    def add(group, name, tokens, fn, leaves, ref=None):
        try:
            r = bench(fn, leaves)
        except Exception as e:
            r = {"ms": math.nan, "peak_mib": math.nan, "note": f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"}
        r.update(group=group, impl=name, tokens=tokens)
        rows.append(r)
        print(f"  {group:8s} T={tokens:6d} {name:28s} {r['ms']:8.3f} ms  peak {r['peak_mib']:8.0f} MiB "
              f"{r.get('note', '')}", flush=True)

    for mb in [int(x) for x in args.micro_batches.split(",")]:
        T = mb * 1024
        torch.manual_seed(0)
        x = (torch.randn(T, H, device=dev, dtype=dt) * 0.5).requires_grad_()
        w = (torch.randn(V, H, device=dev, dtype=dt) * 0.02).requires_grad_()
        tgt = torch.randint(0, 50257, (T,), device=dev)

        def megatron_ce():
            logits = (x @ w.t()).view(T, 1, V)  # megatron: [s, b, v]
            loss = vocab_parallel_cross_entropy(logits, tgt.view(T, 1))
            loss.mean().backward()
        add("loss", "megatron (bf16 GEMM + fp32 CE)", T, megatron_ce, [x, w])

        def torch_ce():
            F.cross_entropy((x @ w.t()).float(), tgt).backward()
        add("loss", "torch F.cross_entropy fp32", T, torch_ce, [x, w])

        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            def liger():
                liger_fused_linear_cross_entropy(x, w, tgt).backward()
            add("loss", "liger fused linear CE", T, liger, [x, w])
        except ImportError as e:
            print(f"  liger-kernel not importable: {e}")
        try:
            from cut_cross_entropy import linear_cross_entropy

            def cce():
                linear_cross_entropy(x, w, tgt).backward()
            add("loss", "cut-cross-entropy", T, cce, [x, w])
        except ImportError as e:
            print(f"  cut-cross-entropy not importable: {e}")
        ce_c = torch.compile(lambda x, w, t: F.cross_entropy((x @ w.t()).float(), t))

        def compiled_ce():
            ce_c(x, w, tgt).backward()
        add("loss", "torch.compile(linear + CE)", T, compiled_ce, [x, w])

        from nemo_ssa.ops.cross_entropy import lm_cross_entropy

        def nemo_ssa_ce():  # what the recipe runs: megatron's bf16 GEMM + our compiled loss
            logits = (x @ w.t()).view(T, 1, V)
            lm_cross_entropy(logits, tgt.view(1, T)).mean().backward()
        add("loss", "nemo_ssa (bf16 GEMM + compiled CE)", T, nemo_ssa_ce, [x, w])
        with torch.no_grad():  # agreement with megatron's loss on the same logits
            logits = (x @ w.t()).view(T, 1, V)
            a = vocab_parallel_cross_entropy(logits.clone(), tgt.view(T, 1)).view(-1)
            b = lm_cross_entropy(logits, tgt.view(1, T)).view(-1)
            print(f"  loss T={T}: nemo_ssa vs megatron max |diff| {float((a - b).abs().max()):.3e} "
                  f"(mean loss {float(a.mean()):.4f})", flush=True)
        del w
        torch.cuda.empty_cache()

        # LayerNorm1P: (1 + gamma)
        g = torch.zeros(H, device=dev, dtype=dt, requires_grad=True)
        bb = torch.zeros(H, device=dev, dtype=dt, requires_grad=True)
        go = torch.randn(T, H, device=dev, dtype=dt)

        def ln_eager():
            F.layer_norm(x, (H,), g + 1, bb, 1e-5).backward(go)
        add("ln", "torch eager (w+1)", T, ln_eager, [x, g, bb])
        ln_c = torch.compile(lambda x, g, b: F.layer_norm(x, (H,), g + 1, b, 1e-5))

        def ln_comp():
            ln_c(x, g, bb).backward(go)
        add("ln", "torch.compile", T, ln_comp, [x, g, bb])
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            def ln_liger():
                LigerLayerNormFunction.apply(x, g + 1, bb, 1e-5).backward(go)
            add("ln", "liger LayerNorm", T, ln_liger, [x, g, bb])
        except ImportError as e:
            print(f"  liger LayerNorm not importable: {e}")

        # squared-ReLU MLP
        w1 = (torch.randn(FFN, H, device=dev, dtype=dt) * 0.02).requires_grad_()
        w2 = (torch.randn(H, FFN, device=dev, dtype=dt) * 0.02).requires_grad_()

        def mlp_eager():
            (F.relu(x @ w1.t()).square() @ w2.t()).backward(go)
        add("mlp", "torch eager relu^2", T, mlp_eager, [x, w1, w2])
        mlp_c = torch.compile(lambda x, a, b: F.relu(x @ a.t()).square() @ b.t())

        def mlp_comp():
            mlp_c(x, w1, w2).backward(go)
        add("mlp", "torch.compile relu^2", T, mlp_comp, [x, w1, w2])

        def gemms_only():
            ((x @ w1.t()) @ w2.t()).backward(go)
        add("mlp", "GEMMs only (no activation)", T, gemms_only, [x, w1, w2])
        del x, w1, w2, go, g, bb
        torch.cuda.empty_cache()

    lines = ["| group | tokens | impl | fwd+bwd ms | peak extra MiB | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['tokens']} | {r['impl']} | {r['ms']:.3f} | {r['peak_mib']:.0f} | "
                     f"{r.get('note', '')} |")
    md = "\n".join(lines)
    print("\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Layer library candidates, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n"
                    f"`{' '.join(sys.argv)}`\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
