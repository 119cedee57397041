"""The 114M model's squared-ReLU MLP: megatron's module vs torch.compile vs the fused op.

    python benchmarks/bench_mlp.py --out $OUT/mlp.md             # variants (~3-4 min, compile included)
    python benchmarks/bench_mlp.py --tiles --out $OUT/tiles.md   # tile sweep of the two Triton GEMMs

At hidden 768, ffn 3072, bf16, tokens = 8 x 1024 and 32 x 1024 ([s=1024, b, h] inputs,
megatron's layout), every variant first runs once against an fp32 reference (output and
dx, dw1, dw2; the 2x-eager rule: error <= 2 x the bf16 eager error + 1e-5), then is timed
(``triton.testing.do_bench``, median; forward with autograd recording, as in training,
and forward+backward) with its memory: "saved" = what the forward keeps for the backward
(allocated after the forward, output excluded), "peak" = peak extra over one fwd+bwd.

Variants (same weights, same inputs):
  megatron MLP        megatron-core's MLP module as the recipe builds it (local spec:
                      ColumnParallelLinear -> squared_relu -> RowParallelLinear, TP 1)
  torch eager         F.linear -> relu -> square -> F.linear
  GEMMs only          the two F.linear without the activation (a floor, not a candidate)
  compile default     torch.compile of the eager function
  compile max-autotune torch.compile(mode="max-autotune-no-cudagraphs"): inductor's Triton
                      GEMM templates with the activation fused in their epilogues
  nemo_ssa fused      nemo_ssa.ops.mlp.mlp_relu2 (two Triton GEMMs with fused epilogues +
                      three cuBLAS GEMMs)
  nemo_ssa module     FusedReLU2MLP, what ``model.fused_mlp`` puts in the model
  fused under compile torch.compile(mlp_relu2, fullgraph=True): the op traced through

Every variant runs in try/except: a failure prints its error and the rest go on. The
compile time of compiled variants (first fwd+bwd, both graphs) is reported.

``--tiles``: for each token count, the forward kernel (x w1^T, relu^2 epilogue) and the
backward kernel (dy w2, 2 sqrt(a) epilogue) over a list of tiles, each checked against
torch and timed against cuBLAS doing the plain GEMM of the same shape; prints the
``NEMO_SSA_MLP_TILES=...`` setting of the fastest.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.timing import median_ms  # noqa: E402

H, FFN, SEQ = 768, 3072, 1024
DT = torch.bfloat16
DEV = "cuda"
#: --smoke-cpu: the script's logic on CPU (tiny shapes, fp16 kernels in the Triton
#: interpreter, aot_eager instead of inductor, wall-clock timing, no memory figures)
SMOKE = False
TILE_CANDIDATES = ["128x128x64/3/4", "128x128x64/4/4", "128x128x64/4/8", "128x128x32/4/4", "64x128x64/4/4",
                   "64x256x64/4/4", "128x256x64/3/8", "128x256x64/4/8", "256x128x64/3/8", "128x256x32/4/8"]


def log(msg: str) -> None:
    print(msg, flush=True)


def init_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        # an in-process store: no port to collide with (an inherited MASTER_PORT may be taken)
        dist.init_process_group("gloo" if SMOKE else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if SMOKE:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def megatron_config():
    """The recipe's model config (fiddle-built, as NeMo builds it) or, if NeMo cannot be
    imported, a TransformerConfig with the recipe's MLP settings."""
    try:
        import fiddle as fdl

        from recipes import nemotron_114m

        cfg = fdl.build(nemotron_114m.model(attention="softmax").config)
        source = "recipes/nemotron_114m.py (NeMo config)"
    except Exception as e:  # noqa: BLE001 - the benchmark still runs without NeMo
        from megatron.core.activations import squared_relu
        from megatron.core.transformer.transformer_config import TransformerConfig

        log(f"[bench_mlp] recipe config unavailable ({type(e).__name__}: {str(e)[:120]}); "
            "using a TransformerConfig with the recipe's MLP settings")
        cfg = TransformerConfig(num_layers=12, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=24,
                                num_query_groups=8, activation_func=squared_relu, add_bias_linear=False,
                                gated_linear_unit=False, bias_activation_fusion=False)
        source = "TransformerConfig (recipe's MLP settings)"
    cfg.bf16, cfg.fp16 = True, False
    cfg.params_dtype = DT
    cfg.use_cpu_initialization = SMOKE
    if SMOKE:
        cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size = 1, H, FFN
        cfg.num_attention_heads, cfg.num_query_groups = 4, 2
    cfg.gradient_accumulation_fusion = False  # apex-only; the GPU image has no apex
    cfg.tensor_model_parallel_size = 1
    cfg.sequence_parallel = False
    log(f"[bench_mlp] megatron config from {source}: activation={getattr(cfg.activation_func, '__name__', '?')}, "
        f"add_bias_linear={cfg.add_bias_linear}, gated_linear_unit={cfg.gated_linear_unit}, "
        f"bias_activation_fusion={cfg.bias_activation_fusion}")
    return cfg


def build_modules(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    from nemo_ssa.megatron.mlp import FusedReLU2MLP

    sub = get_gpt_layer_local_spec(normalization="LayerNorm").submodules.mlp.submodules
    torch.manual_seed(1234)
    stock = MLP(cfg, sub, ffn_hidden_size=cfg.ffn_hidden_size).to(DEV, DT)
    fused = FusedReLU2MLP(cfg, sub, ffn_hidden_size=cfg.ffn_hidden_size).to(DEV, DT)
    fused.load_state_dict(stock.state_dict())
    return stock, fused


# --------------------------------------------------------------------------- measuring
def run_grads(fn: Callable, x, w1, w2, dy, params: Optional[List] = None):
    """(y, dx, dw1, dw2) of one fwd+bwd; ``params``: the module's (w1, w2) when fn is a module call."""
    leaves = [x] + (params or [w1, w2])
    for t in leaves:
        t.grad = None
    y = fn(x, w1, w2)
    y.backward(dy)
    out = [y.detach().float(), x.grad.float(), leaves[1].grad.float(), leaves[2].grad.float()]
    for t in leaves:
        t.grad = None
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double())).item()


def do_bench(fn, leaves=None) -> float:
    """Median ms: triton's do_bench on CUDA, a short wall-clock loop in the CPU smoke mode."""
    if not SMOKE:
        return median_ms(fn, grad_to_none=leaves)
    times = []
    for _ in range(3):
        for t in leaves or []:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def time_variant(fn, x, w1, w2, dy, leaves) -> Dict[str, float]:
    def fwd():
        fn(x, w1, w2)

    def fwdbwd():
        fn(x, w1, w2).backward(dy)

    out = {}
    out["fwd_ms"] = do_bench(fwd, leaves)
    out["fwdbwd_ms"] = do_bench(fwdbwd, leaves)
    if SMOKE:
        for t in leaves:
            t.grad = None
        return dict(out, saved_mib=float("nan"), peak_mib=float("nan"))
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = fn(x, w1, w2)
    torch.cuda.synchronize()
    out["saved_mib"] = (torch.cuda.memory_allocated() - base - y.numel() * y.element_size()) / 2 ** 20
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    for t in leaves:
        t.grad = None
    return out


def bench_variants(args) -> List[Dict]:
    from nemo_ssa.ops.mlp import fused as fused_mod
    from nemo_ssa.ops.mlp import mlp_relu2

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32
    torch.backends.cudnn.allow_tf32 = False
    stock = fused_module = None
    try:
        init_megatron()
        stock, fused_module = build_modules(megatron_config())
        w1_init = stock.linear_fc1.weight.detach().clone()
        w2_init = stock.linear_fc2.weight.detach().clone()
    except Exception:  # noqa: BLE001
        log("[bench_mlp] megatron modules unavailable:\n" + traceback.format_exc())
        torch.manual_seed(1234)
        w1_init = (torch.randn(FFN, H, device=DEV) * 0.0134).to(DT)
        w2_init = (torch.randn(H, FFN, device=DEV) * 0.0134 / math.sqrt(2 * 12)).to(DT)
    log(f"[bench_mlp] tiles: {{{', '.join(f'{k}: {v}' for k, v in fused_mod.tiles().items())}}}")

    def eager(x, w1, w2):
        return F.linear(torch.relu(F.linear(x, w1)).square(), w2)

    # one function object (code object) per compiled variant: dynamo caches per code object
    def eager_c1(x, w1, w2):
        return F.linear(torch.relu(F.linear(x, w1)).square(), w2)

    def eager_c2(x, w1, w2):
        return F.linear(torch.relu(F.linear(x, w1)).square(), w2)

    def fused_c(x, w1, w2):
        return mlp_relu2(x, w1, w2, impl="triton")

    def gemms_only(x, w1, w2):
        return F.linear(F.linear(x, w1), w2)

    def compile_(fn, **kw):
        if SMOKE:  # inductor's CPU path needs a C++ toolchain and minutes; aot_eager traces the same graph
            kw = {k: v for k, v in kw.items() if k != "mode"}
            return torch.compile(fn, backend="aot_eager", **kw)
        return torch.compile(fn, **kw)

    variants: Dict[str, Callable] = {}
    if stock is not None:
        variants["megatron MLP"] = lambda x, w1, w2: stock(x)[0]
    variants["torch eager"] = eager
    variants["GEMMs only (floor)"] = gemms_only
    variants["compile default"] = compile_(eager_c1, dynamic=False)
    variants["compile max-autotune"] = compile_(eager_c2, dynamic=False, mode="max-autotune-no-cudagraphs")
    variants["nemo_ssa fused"] = lambda x, w1, w2: mlp_relu2(x, w1, w2, impl="triton")
    if fused_module is not None:
        variants["nemo_ssa module"] = lambda x, w1, w2: fused_module(x)[0]
    variants["fused under compile"] = compile_(fused_c, dynamic=False, fullgraph=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rows: List[Dict] = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        b = tokens // SEQ
        g = torch.Generator(device=DEV).manual_seed(tokens)
        x = torch.randn(SEQ, b, H, device=DEV, generator=g).to(DT).requires_grad_()
        dy = torch.randn(SEQ, b, H, device=DEV, generator=g).to(DT)
        w1 = w1_init.clone().requires_grad_()
        w2 = w2_init.clone().requires_grad_()
        # fp32 reference and the eager bf16 error it is judged against
        xr, w1r, w2r = (t.detach().float().requires_grad_() for t in (x, w1, w2))
        ref = run_grads(eager, xr, w1r, w2r, dy.float())
        del xr, w1r, w2r
        eager_err = [rel(o, r) for o, r in zip(run_grads(eager, x, w1, w2, dy), ref)]
        log(f"\n[bench_mlp] tokens {tokens} ([{SEQ}, {b}, {H}]): eager {str(DT).replace('torch.', '')} rel err vs fp32 "
            f"y/dx/dw1/dw2 = {' / '.join(f'{e:.2e}' for e in eager_err)}")
        base_ms = None
        for name, fn in variants.items():
            if any(s and s in name for s in skip):
                log(f"  {name:22s} skipped (--skip)")
                continue
            row: Dict = {"tokens": tokens, "variant": name}
            try:
                is_module = name in ("megatron MLP", "nemo_ssa module")
                params = None
                if is_module:
                    mod = stock if name == "megatron MLP" else fused_module
                    with torch.no_grad():
                        mod.linear_fc1.weight.copy_(w1)
                        mod.linear_fc2.weight.copy_(w2)
                    params = [mod.linear_fc1.weight, mod.linear_fc2.weight]
                sync()
                t0 = time.perf_counter()
                got = run_grads(fn, x, w1, w2, dy, params)
                sync()
                first_s = time.perf_counter() - t0
                errs = [rel(o, r) for o, r in zip(got, ref)]
                row["errs"] = errs
                row["ok"] = (None if name.startswith("GEMMs only") else  # another function: no bound
                             all(e <= 2 * ee + 1e-5 for e, ee in zip(errs, eager_err)))
                if "compile" in name:
                    row["compile_s"] = first_s
                del got
                leaves = [x] + (params or [w1, w2])
                row.update(time_variant(fn, x, w1, w2, dy, leaves))
                if name == "megatron MLP":
                    base_ms = row["fwdbwd_ms"]
                row["vs_megatron"] = (base_ms / row["fwdbwd_ms"]) if base_ms else float("nan")
                log(f"  {name:22s} fwd {row['fwd_ms']:.3f} ms  fwd+bwd {row['fwdbwd_ms']:.3f} ms  "
                    f"({row['vs_megatron']:.2f}x megatron)  saved {row['saved_mib']:.0f} MiB  peak "
                    f"{row['peak_mib']:.0f} MiB  err y/dx/dw1/dw2 {' / '.join(f'{e:.2e}' for e in errs)} "
                    f"{OK_WORD[row['ok']]}"
                    + (f"  compile {row['compile_s']:.1f} s" if "compile_s" in row else ""))
            except Exception as e:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log(f"  {name:22s} ERROR {row['error']}")
                traceback.print_exc(limit=4)
            rows.append(row)
            empty_cache()
        del x, dy, w1, w2, ref
        empty_cache()
    return rows


OK_WORD = {True: "ok", False: "FAILS 2x-eager", None: "n/a"}


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def empty_cache() -> None:
    if not SMOKE:
        torch.cuda.empty_cache()


def variants_table(rows: List[Dict]) -> str:
    lines = ["| tokens | variant | fwd ms | fwd+bwd ms | speed-up vs megatron (fwd+bwd) | saved MiB | peak MiB | "
             "compile s | rel err y / dx / dw1 / dw2 (vs fp32) | 2x-eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['variant']} | error: {r['error'][:120]} | | | | | | | |")
            continue
        errs = " / ".join(f"{e:.1e}" for e in r.get("errs", []))
        lines.append(f"| {r['tokens']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
                     f"{r['vs_megatron']:.2f}x | {r['saved_mib']:.0f} | {r['peak_mib']:.0f} | "
                     f"{r.get('compile_s', float('nan')):.1f} | {errs} | {OK_WORD[r['ok']]} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- tile sweep
def bench_tiles(args) -> str:
    from nemo_ssa.ops.mlp import fused as fm

    lines = ["| tokens | kernel | tile | ms | cuBLAS plain GEMM ms | ratio (cuBLAS / tile) | max rel err |",
             "|---|---|---|---|---|---|---|"]
    best_all: Dict[int, Dict[str, tuple]] = {}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device=DEV).manual_seed(tokens)
        x = torch.randn(tokens, H, device=DEV, generator=g).to(DT)
        dy = torch.randn(tokens, H, device=DEV, generator=g).to(DT)
        w1 = (torch.randn(FFN, H, device=DEV, generator=g) * 0.0134).to(DT)
        w2 = (torch.randn(H, FFN, device=DEV, generator=g) * 0.0134).to(DT)
        a_ref = torch.relu(x.float() @ w1.float().t()).square()
        a = a_ref.to(DT)
        du_ref = (dy.float() @ w2.float()) * (2 * a.float().sqrt())
        cublas = {"fwd": do_bench(lambda: torch.mm(x, w1.t())), "bwd": do_bench(lambda: torch.mm(dy, w2))}
        eager_act = do_bench(lambda: torch.relu(torch.mm(x, w1.t())).square())
        log(f"\n[tiles] tokens {tokens}: cuBLAS x w1^T {cublas['fwd']:.3f} ms (+ eager relu^2: {eager_act:.3f} ms), "
            f"cuBLAS dy w2 {cublas['bwd']:.3f} ms")
        best: Dict[str, tuple] = {}
        for kernel in ("fwd", "bwd"):
            for spec in TILE_CANDIDATES:
                tile = fm.Tile.parse(spec)
                try:
                    if kernel == "fwd":
                        fn = lambda: fm.relu2_fwd(x, w1, tile)  # noqa: E731
                        err = rel(fn().float(), a_ref)
                    else:
                        fn = lambda: fm.relu2_bwd_du(dy, w2, a, tile)  # noqa: E731
                        err = rel(fn().float(), du_ref)
                    ms = do_bench(fn)
                    ok = err < 1e-2
                    log(f"  {kernel} {spec:16s} {ms:.3f} ms  ({cublas[kernel] / ms:.2f}x of cuBLAS plain)  "
                        f"rel err {err:.1e}{'' if ok else '  WRONG'}")
                    lines.append(f"| {tokens} | {kernel} | {spec} | {ms:.3f} | {cublas[kernel]:.3f} | "
                                 f"{cublas[kernel] / ms:.2f} | {err:.1e}{'' if ok else ' WRONG'} |")
                    if ok and (kernel not in best or ms < best[kernel][1]):
                        best[kernel] = (spec, ms)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    log(f"  {kernel} {spec:16s} ERROR {msg}")
                    lines.append(f"| {tokens} | {kernel} | {spec} | error: {msg} | | | |")
        best_all[tokens] = best
        if len(best) == 2:
            log(f"[tiles] tokens {tokens} fastest: NEMO_SSA_MLP_TILES=fwd={best['fwd'][0]},bwd={best['bwd'][0]}")
        del x, dy, w1, w2, a, a_ref, du_ref
        empty_cache()
    md = "\n".join(lines)
    for tokens, best in best_all.items():
        if len(best) == 2:
            md += (f"\n\nFastest at {tokens} tokens: `NEMO_SSA_MLP_TILES=fwd={best['fwd'][0]},bwd={best['bwd'][0]}` "
                   f"({best['fwd'][1]:.3f} / {best['bwd'][1]:.3f} ms)")
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,32768", help="tokens per micro batch (multiples of 1024)")
    ap.add_argument("--tiles", action="store_true", help="sweep the Triton GEMM tiles instead of the variants")
    ap.add_argument("--skip", default="", help="comma-separated substrings of variant names to skip "
                                              "(e.g. max-autotune)")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--smoke-cpu", action="store_true", help="check the script's logic on CPU (tiny shapes, fp16, "
                                                             "Triton interpreter; the numbers mean nothing)")
    args = ap.parse_args(argv)
    if args.smoke_cpu:
        global SMOKE, DEV, DT, H, FFN, SEQ, TILE_CANDIDATES
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke-cpu needs TRITON_INTERPRET=1 (set before the kernels are imported)", file=sys.stderr)
            return 2
        SMOKE, DEV, DT, H, FFN, SEQ = True, "cpu", torch.float16, 32, 64, 16
        TILE_CANDIDATES = ["16x16x16/1/4", "32x32x16/1/4"]
        if args.tokens == ap.get_default("tokens"):
            args.tokens = "32,48"
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("bench_mlp needs CUDA", file=sys.stderr)
        return 2
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels would run in the interpreter", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    head = (f"# Squared-ReLU MLP, {'CPU smoke' if SMOKE else torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d')}\n\n`python {' '.join(sys.argv)}`\n\n")
    if args.tiles:
        md = bench_tiles(args)
    else:
        md = variants_table(bench_variants(args))
    md += f"\n\nTotal wall time {time.perf_counter() - t0:.0f} s."
    print("\n" + md, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
