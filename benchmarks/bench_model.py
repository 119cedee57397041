"""The 114M recipe model through megatron-core, bf16, without NeMo's trainer: step time and tokens/s.

    python benchmarks/bench_model.py                                   # fwd+bwd, 3 attentions, mb 8 and the largest that fits
    python benchmarks/bench_model.py --mode step --attentions softmax  # + megatron DDP and optimizer (NeMo's inner step)
    python benchmarks/bench_model.py --profile $OUT/model_prof.txt     # + kernel-time breakdown of one mb-8 step
    python benchmarks/bench_model.py --mode both --by-module $OUT/where.md  # + the step by module and kernel family
    python benchmarks/bench_model.py --mode step --micro-batches 8 --cuda-graph none,local  # megatron's layer graphs

Modes (every attention in one process, same weights and batch):

* ``fwdbwd``: the model as NeMo builds it (``nemotron_114m.model()``, our layer spec),
  parameters in bf16 (as megatron's ``Float16Module`` holds them), the output layer + loss
  NeMo's ``forward_step`` installs (the fused cross-entropy: ``--fused-ce auto``, on with
  CUDA and TP 1; ``false``: megatron's logits + loss), forward + masked mean loss + backward. This is "the model's own fwd+bwd" that the training-step issue
  compares NeMo's step against.
* ``step``: the same inside megatron's ``Float16Module`` + ``DistributedDataParallel``
  (fp32 grad buffer) + ``get_megatron_optimizer`` (the recipe's optimizer config: Adam,
  bf16, clip 1.0), built as the recipe's optimizer module builds it (``--fast-paths true``:
  sync-free clipping, fused AdamW): the training step NeMo runs, minus Lightning and NeMo.

``--cuda-graph local`` builds the layers with megatron-core's own CUDA graphs
(``cuda_graph_impl='local'``: each layer's forward and backward captured after
``cuda_graph_warmup_steps`` and replayed; no Transformer Engine), the remedy megatron offers
for a host-bound step such as micro batch 8's; one micro batch per run (a graph is one shape).

Step time is the median of CUDA-event-timed steps after warm-up; tokens/s = micro batch x
seq / step time. ``--micro-batches 8,max`` probes the largest micro batch that fits
(doubling from 8, then the best below the first OOM among 8/16/24/32/48/64/96/128).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from nemo_ssa.tools.step_profile import family, optimizer_range  # noqa: E402 -- this checkout's package

VOCAB = 50304
PROBE_MBS = (8, 16, 24, 32, 48, 64, 96, 128)


def init_megatron(seed: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def build(attention: str, seq: int, overrides: Optional[Dict] = None, fused_ce: str = "auto",
          fused_ln: str = "false"):
    """(config, model) of the recipe's model with ``attention``, bf16 params on the GPU, with
    the output layer + loss NeMo's ``forward_step`` installs (``fused_ce``, as
    ``model.fused_cross_entropy``). Without it the step measured is not the one NeMo trains:
    megatron's loss upcasts the whole ``[tokens, vocab]`` logits to fp32 (docs/results/
    2026-11-27-step-profile: its casts were read as layout copies). ``fused_ln``: the layer
    norms' path (``model.fused_layernorm``)."""
    import fiddle as fdl

    from recipes import nemotron_114m

    cfg = fdl.build(nemotron_114m.model(attention=attention, seq_length=seq, vocab_size=VOCAB,
                                        fused_layernorm=fused_ln).config)
    cfg.bf16, cfg.fp16 = True, False
    cfg.params_dtype = torch.bfloat16
    cfg.pipeline_dtype = torch.bfloat16
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(1234)
    model = cfg.configure_model(None).cuda()
    from nemo_ssa.megatron.output_layer import install_fused_cross_entropy

    install_fused_cross_entropy(model, fused_ce)
    return cfg, model


def use_cuda_graphs(on: bool, seed: int = 1234) -> None:
    """megatron-core's local CUDA graphs need a cudagraphable RNG tracker when the layers
    are built (CudaGraphManager asserts it) and fresh global graph state per model (the
    record of the previous model's graphs): reset both for the next model."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    delete_cuda_graphs()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=on, force_reset_rng=True)


def _after_fwd_bwd(model) -> None:
    """What megatron's schedule does after a fwd+bwd with local CUDA graphs: capture the
    graphs the layers recorded (once, after their warm-up steps; a no-op afterwards)."""
    if getattr(model.config, "cuda_graph_impl", "none") == "local":
        from megatron.core.transformer.cuda_graphs import create_cudagraphs

        create_cudagraphs()


def batch(mb: int, seq: int, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, 50257, (mb, seq + 1), generator=g).cuda()
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(mb, seq)
    mask = torch.ones(mb, seq, device="cuda")
    return tokens[:, :-1].contiguous(), pos, tokens[:, 1:].contiguous(), mask


def loss_fn(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token.float() * mask).sum() / mask.sum()


def time_steps(step, warmup: int, iters: int) -> List[float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return times


def make_fwdbwd(model, data):
    tokens, pos, labels, mask = data

    def step(probe: bool = False):
        # loss_mask: the fused loss weights its in-forward weight gradient by it (NeMo hands it
        # over through forward_step); megatron's path ignores it
        out = model(tokens, pos, None, labels=labels, loss_mask=mask)
        loss = loss_fn(out, mask)
        loss.backward()
        _after_fwd_bwd(model)
        # probe: the row's fingerprint (loss, gradient norm) -- rows of one attention share
        # weights (build seeds them) and the batch, so a variant (CUDA graphs, layer norm)
        # that changes the numerics shows here, next to its speed
        fp = (loss.item(), math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in model.parameters()
                                         if p.grad is not None))) if probe else None
        for p in model.parameters():
            p.grad = None
        return fp
    return step


def wrap_for_step(cfg, model, fast_paths: bool = True, sync_free: bool = True) -> None:
    """megatron Float16Module + DDP + optimizer around ``model`` (NeMo's step without
    Lightning); stored on ``model._bench_step_state``. The DDP config is the recipe's
    (gradients reduced in fp32, megatron's gradient NaN check on, as NeMo's recipe sets it).

    ``fast_paths``: build the optimizer as the recipe's optimizer module does
    (``nemo_ssa.nemo.optim``: the sync-free multi-tensor norm/scale installed in megatron and
    the fused AdamW kernel), so the step timed is the one NeMo trains; without them megatron's
    no-apex gradient clipping reads every parameter's norm to the host. ``sync_free`` (with
    ``fast_paths``, as the module does): clipping and the NaN check on the device
    (``nemo_ssa.megatron.sync_free``)."""
    import fiddle as fdl
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from recipes import nemotron_114m

    recipe = nemotron_114m.pretrain_recipe(dir="/tmp/bench_model", attention="softmax")
    opt_cfg = fdl.build(recipe.optim.config)
    opt_cfg.bf16 = True
    wrapped = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                    overlap_grad_reduce=False,
                                                                    use_distributed_optimizer=False,
                                                                    check_for_nan_in_grad=True), wrapped)
    model._bench_step_state = (ddp, make_optimizer(opt_cfg, ddp, fast_paths, sync_free))


def make_optimizer(opt_cfg, ddp, fast_paths: bool = True, sync_free: bool = True):
    """``get_megatron_optimizer`` for ``ddp`` as the recipe's optimizer module calls it
    (``nemo_ssa.nemo.optim``): with ``fast_paths`` the sync-free multi-tensor norm/scale are
    installed in megatron (process-wide, as in a NeMo run) and AdamW builds its fused kernel;
    with ``sync_free`` too, ``nemo_ssa.megatron.sync_free`` is installed and activated."""
    from megatron.core.optimizer import get_megatron_optimizer

    from nemo_ssa.megatron import fast_paths as fp
    from nemo_ssa.megatron import sync_free as sf
    from nemo_ssa.megatron.introspect import no_weight_decay_cond

    if fast_paths:
        fp.install()
        if sync_free:
            sf.install()
    with fp.fused_adamw(fast_paths):
        opt = get_megatron_optimizer(opt_cfg, [ddp], no_weight_decay_cond=no_weight_decay_cond)
    if fast_paths and sync_free:
        why = sf.activate(opt)
        if why:
            print(f"[bench_model] sync-free step off: {why}", flush=True)
    return opt


def make_step(model, data):
    """One training step of the wrapped model on ``data``."""
    ddp, opt = model._bench_step_state
    tokens, pos, labels, mask = data

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = ddp(tokens, pos, None, labels=labels, loss_mask=mask)
        loss_fn(out, mask).backward()
        ddp.finish_grad_sync()
        _after_fwd_bwd(model)
        with optimizer_range():  # step_profile reads this range as the optimizer row
            opt.step()
    return step


def format_rows(rows: List[Dict], variants: List[Tuple[str, str]], baseline: str) -> str:
    """The markdown table of ``main``'s rows, then one parity line per variant row.

    ``x <baseline>``: tokens/s over the baseline attention's (the first of ``--attentions``)
    at the same mode, micro batch and variant; ``x <first variant>``: over the same
    attention's row with the first (layer norm, graphs) variant. Parity (fwd+bwd rows): the
    loss and gradient norm of a variant row against the first variant's row of the same
    attention and micro batch (same weights, same batch): a variant that changes the
    numerics beyond the last bits shows here."""
    key = lambda r: (r["mode"], r["mb"], r["fused_ln"], r["cuda_graph"])  # noqa: E731
    base = {key(r): r["tokens_s"] for r in rows if r["attention"] == baseline}
    first = {(r["attention"], r["mode"], r["mb"]): r for r in reversed(rows)
             if (r["fused_ln"], r["cuda_graph"]) == variants[0]}
    v0 = f"layer norm {variants[0][0]}, graphs {variants[0][1]}"
    lines = [f"| attention | mode | layer norm | cuda graphs | micro batch | ms/step | tokens/s | x {baseline} | "
             f"x {v0} | MFU | peak GiB | loss | grad norm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    parity = []
    for r in rows:
        ratio = r["tokens_s"] / base.get(key(r), math.nan)
        ref = first.get((r["attention"], r["mode"], r["mb"]))
        vs_first = r["tokens_s"] / ref["tokens_s"] if ref else math.nan
        loss, gn = r.get("loss"), r.get("grad_norm")
        lines.append(f"| {r['attention']} | {r['mode']} | {r['fused_ln']} | {r['cuda_graph']} | {r['mb']} | "
                     f"{r['ms']:.2f} | "
                     f"{r['tokens_s']:,.0f} | {ratio:.2f} | {vs_first:.2f} | {100 * r['mfu']:.1f} % | "
                     f"{r['peak_gib']:.1f} | {'-' if loss is None else f'{loss:.6f}'} | "
                     f"{'-' if gn is None else f'{gn:.6g}'} |")
        if ref is not None and ref is not r and loss is not None and ref.get("loss") is not None:
            parity.append(f"- parity {r['attention']} mb {r['mb']} layer norm {r['fused_ln']}, graphs "
                          f"{r['cuda_graph']} vs {v0}: loss {loss - ref['loss']:+.2e}, grad norm "
                          f"{(gn - ref['grad_norm']) / ref['grad_norm']:+.2e} relative")
    return "\n".join(lines + ([""] + parity if parity else []))


def flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs per token (fwd+bwd = 3x fwd; causal attention counts half the scores).

    6 * (non-embedding matmul params + output layer) + 6 * layers * seq * hidden (attention
    scores and PV, causal halves 12 -> 6). Non-embedding params per layer:
    qkv h*(h + 2*kv) + proj h*h + MLP 2*h*ffn (squared ReLU: no gate).
    """
    h, L, ffn = cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size
    kv = cfg.kv_channels * cfg.num_query_groups
    per_layer = h * (h + 2 * kv) + h * h + 2 * h * ffn
    return 6.0 * (L * per_layer + h * VOCAB) + 6.0 * L * seq * h


def kernel_breakdown(step, path: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    cats: Dict[str, float] = {}
    total = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        if t <= 0 or ev.key.startswith(("aten::", "cuda", "autograd", "Optimizer", "ProfilerStep", "torch")):
            continue
        cat = family(ev.key)  # the step profiler's rules: one classifier for every table
        cats[cat] = cats.get(cat, 0.0) + t
        total += t
    lines = [f"GPU kernel time per step by category (3 steps profiled; us per step), total {total / 3:.0f} us"]
    for cat, t in sorted(cats.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:18s} {t / 3:10.0f} us  {100 * t / max(total, 1):5.1f} %")
    text = "\n".join(lines)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    with open(path, "a") as f:
        f.write(text + "\n\n" + table + "\n\n" + cpu_table + "\n\n")
    return text


def where_the_step_goes(model, step, path: str, label: str, steps: int = 3) -> str:
    """The step by module (forward and backward) and by kernel family, GPU time of ``steps``
    profiled steps after two warm-up steps (nemo_ssa.tools.step_profile), appended to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    from nemo_ssa.tools import step_profile as sp

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with sp.module_ranges(model):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    events = prof.events()
    text = (f"## {label}\n\n" + sp.table(sp.by_module(events, device=True), "module", steps) + "\n\n"
            + sp.table(sp.by_family(events, device=True), "kernel family", steps) + "\n\n"
            + "What the rows without a module hold:\n\n"
            + sp.top_ops_table(sp.top_ops(events, device=True), steps) + "\n\n"
            + "The largest kernels:\n\n" + sp.top_kernels_table(sp.top_kernels(events), steps) + "\n\n")
    with open(path, "a") as f:
        f.write(text)
    return text


def gpu_gaps(step, path: str, label: str, min_gap_us: float = 20.0) -> str:
    """Where the GPU idles inside a step: profile 2 steps, walk the kernels of the trace in
    time order and report busy time, idle time and the largest gaps between consecutive
    kernels (with the kernels on either side). Idle time inside a step that is not host
    bound overall means the host fell behind there."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        trace = f.name
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    os.unlink(trace)
    return _gap_report(events, path, label, min_gap_us)


def _gap_report(events, path: str, label: str, min_gap_us: float) -> str:
    ks = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?")) for e in events
                if e.get("cat") == "kernel" and e.get("ph") == "X")
    if not ks:
        return f"{label}: no kernel events"
    busy = sum(b - a for a, b, _ in ks)
    span = ks[-1][1] - ks[0][0]
    gaps = []
    end, prev = ks[0][1], ks[0][2]
    for a, b, name in ks[1:]:
        if a - end >= min_gap_us:
            gaps.append((a - end, prev, name))
        if b > end:
            end, prev = b, name
    idle = sum(g for g, _, _ in gaps)
    gaps.sort(reverse=True)
    lines = [f"{label}: 2 steps, kernel span {span / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms, "
             f"{len(gaps)} gaps >= {min_gap_us:.0f} us totalling {idle / 1e3:.1f} ms"]
    by_next: Dict[str, List[float]] = {}
    for g, _, nxt in gaps:
        by_next.setdefault(nxt[:70], []).append(g)
    lines.append("  idle before (next kernel): count, total us")
    for nxt, gs in sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(f"    {nxt:70s} {len(gs):4d} {sum(gs):10.0f}")
    lines.append("  largest gaps: us, previous kernel -> next kernel")
    for g, a, b in gaps[:10]:
        lines.append(f"    {g:8.0f}  {a[:60]} -> {b[:60]}")
    text = "\n".join(lines)
    with open(path, "a") as f:
        f.write(text + "\n\n")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attentions", default="softmax,softmax_triton,ssa_triton")
    ap.add_argument("--mode", default="fwdbwd", choices=("fwdbwd", "step", "both"))
    ap.add_argument("--micro-batches", default="8,max", help="comma list; 'max' probes the largest that fits")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: by device)")
    ap.add_argument("--profile", default=None, help="append a kernel breakdown of one micro batch to this file")
    ap.add_argument("--profile-mb", type=int, default=8, help="micro batch of the --profile / --gaps runs")
    ap.add_argument("--gaps", default=None, help="append where the GPU idles inside a step (trace of 2 steps at "
                                                 "--profile-mb) to this file")
    ap.add_argument("--by-module", default=None, help="append the step by module and by kernel family "
                                                      "(GPU time, --profile-mb) to this markdown file")
    ap.add_argument("--fused-ce", default="auto", choices=("auto", "true", "false"),
                    help="the fused output layer + loss NeMo's forward_step installs (model.fused_cross_entropy); "
                         "false: megatron's logits + loss")
    ap.add_argument("--fused-layernorm", default="false",
                    help="comma list of model.fused_layernorm values, each a row set (e.g. auto,false: the "
                         "Triton layer norms against torch's in one process)")
    ap.add_argument("--cuda-graph", default="none",
                    help="comma list of none / local, each a row set: local = megatron-core's own layerwise "
                         "CUDA graphs (config.cuda_graph_impl='local', no Transformer Engine; cudagraphable RNG "
                         "tracker; create_cudagraphs() after each fwd+bwd, as megatron's schedule calls it)")
    ap.add_argument("--fast-paths", default="true", choices=("true", "false"),
                    help="step mode: the recipe optimizer module's sync-free clipping and fused AdamW "
                         "(nemo_ssa.nemo.optim, what NeMo trains with); false: megatron's no-apex fallbacks "
                         "(one process per value: installing them rebinds megatron's module globals)")
    ap.add_argument("--out", default=None, help="markdown table path")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cgs = [v.strip() for v in args.cuda_graph.split(",") if v.strip()]
    if set(cgs) - {"none", "local"}:
        ap.error(f"--cuda-graph: {args.cuda_graph!r}; supported: none, local")
    if "local" in cgs and ("max" in args.micro_batches.split(",") or len(args.micro_batches.split(",")) > 1
                           or args.gaps or args.by_module or args.profile):
        ap.error("--cuda-graph local: one micro batch and no --gaps / --by-module / --profile (the graphs are "
                 "captured for one input shape per model)")
    if not torch.cuda.is_available():
        print("bench_model.py needs CUDA", file=sys.stderr)
        return 2
    init_megatron(1234)
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or (989.0 if "H100" in name else 989.0 if "H200" in name else float("nan"))
    modes = ("fwdbwd", "step") if args.mode == "both" else (args.mode,)
    rows = []
    print(f"# {name} | torch {torch.__version__} | seq {args.seq} | peak {peak} TFLOP/s | fused_ce {args.fused_ce}"
          f" | fast_paths {args.fast_paths}",
          flush=True)
    mbs = [int(m) for m in args.micro_batches.split(",") if m != "max"]
    probe = "max" in args.micro_batches.split(",")
    lns = [v.strip() for v in args.fused_layernorm.split(",") if v.strip()]
    variants = [(ln, cg) for ln in lns for cg in cgs]
    for attention, mode, (ln, cg) in ((a, m, v) for a in args.attentions.split(",") for m in modes for v in variants):
        use_cuda_graphs(cg == "local")
        cfg, model = build(attention, args.seq, fused_ce=args.fused_ce, fused_ln=ln,
                           overrides={"cuda_graph_impl": "local"} if cg == "local" else None)
        warmup = args.warmup + (cfg.cuda_graph_warmup_steps + 1 if cg == "local" else 0)
        fpt = flops_per_token(cfg, args.seq)
        if mode == "step":
            wrap_for_step(cfg, model, fast_paths=args.fast_paths == "true")
        make = make_fwdbwd if mode == "fwdbwd" else make_step
        cands = list(mbs) + ([c for c in PROBE_MBS if c > max(mbs or [0])] if probe else [])
        for mb in cands:
            data = batch(mb, args.seq)
            try:
                step = make(model, data)
                torch.cuda.reset_peak_memory_stats()
                times = time_steps(step, warmup, args.iters)
            except torch.cuda.OutOfMemoryError:
                step = data = None
                for p in model.parameters():
                    p.grad = None
                torch.cuda.empty_cache()
                print(f"  {attention:15s} {mode:6s} mb {mb:4d}: OOM", flush=True)
                break
            ms = statistics.median(times)
            fp = step(probe=True) if mode == "fwdbwd" else None
            tps = mb * args.seq / (ms / 1e3)
            mem = torch.cuda.max_memory_allocated() / 2 ** 30
            r = dict(attention=attention, mode=mode, mb=mb, ms=ms, tokens_s=tps, fused_ce=args.fused_ce, fused_ln=ln,
                     cuda_graph=cg,
                     fast_paths=args.fast_paths if mode == "step" else None,
                     mfu=fpt * tps / (peak * 1e12), peak_gib=mem, flops_per_token=fpt,
                     loss=fp[0] if fp else None, grad_norm=fp[1] if fp else None)
            rows.append(r)
            print(f"  {attention:15s} {mode:6s} ln {ln:5s} graphs {cg:5s} mb {mb:4d}: {ms:8.2f} ms  "
                  f"{tps:10,.0f} tok/s  MFU {100 * r['mfu']:5.1f} %  peak {mem:6.1f} GiB", flush=True)
            del data, step
            torch.cuda.empty_cache()
        label = (f"{attention} {mode}" + (f" layernorm {ln}" if len(lns) > 1 else "")
                 + (f" cuda graphs {cg}" if len(cgs) > 1 else ""))
        if args.gaps:
            step = make(model, batch(args.profile_mb, args.seq))
            print(gpu_gaps(step, args.gaps, f"{label} mb {args.profile_mb}"), flush=True)
            del step
        if args.by_module:
            step = make(model, batch(args.profile_mb, args.seq))
            print(where_the_step_goes(model, step, args.by_module,
                                      f"{label} mb {args.profile_mb} ({name})"), flush=True)
            del step
        if args.profile:
            step = make(model, batch(args.profile_mb, args.seq))
            with open(args.profile, "a") as f:
                f.write(f"## {label} mb {args.profile_mb} ({name})\n")
            print(f"[{attention} {mode}] " + kernel_breakdown(step, args.profile), flush=True)
            del step
        del model
        torch.cuda.empty_cache()
    md = format_rows(rows, variants, args.attentions.split(",")[0])
    print("\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Model fwd+bwd, {name}, {time.strftime('%Y-%m-%d')}\n\n`{' '.join(sys.argv)}`\n\n{md}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
