"""Train and evaluate in-context linear regression through the plugin's own layer spec.

    python -m nemo_ssa.study.icl_train --attentions softmax,ssa --seeds 3 --out runs/icl   # GPU: minutes
    python -m nemo_ssa.study.icl_train --cpu-smoke --out /tmp/icl                         # CPU: seconds
    python -m nemo_ssa.study.icl_train --attentions ssa --first-seed 4 --seeds 1 --out runs/icl &   # one run per process
    python -m nemo_ssa.study.icl_train --attentions ssa --steps 50000 --cuda-graphs --budget-s 450 --out runs/icl   # long

The model is megatron-core's ``TransformerBlock`` built from
``nemo_ssa.megatron.spec.layer_spec(config, attention)`` — the same core attentions and
kernels as the GPT recipe (any ``attention=`` name) — with RoPE, a linear read-in of the
``d + 1``-number tokens (:mod:`nemo_ssa.study.icl`) and a linear read-out that predicts
``y_i`` at the position of ``x_i`` (causal: it has seen the ``i`` earlier examples). Loss:
mean squared error over positions, as in Garg et al. Every attention trains on the same
prompts in the same order for a seed.

Evaluation: squared error per number of in-context examples, divided by ``d`` (so
predicting 0 scores ~1 in distribution), on held-out prompts in distribution and under
shift — ``x`` and/or ``w`` at scale 2/4/8, and ``x`` from uniform, Laplace and Student-t —
beside least squares on the same prompts (the floor). Results: ``icl.json`` (every curve
per seed) and ``icl.md`` (mean and spread over seeds at a few example counts); each run is
also saved as it finishes (``runs/<attention>-s<seed>.json``) and reused by a later call
with the same configuration, so an interrupted call loses at most the run in progress and
several processes (one per attention) can share one ``--out``. A run longer than a time-limited
call checkpoints (``--budget-s``: past it, each unfinished run is saved under ``<out>/ckpt`` and
the command exits 3; ``--checkpoint-every N``) and the same command resumes it, bit for bit on
CPU (the prompts of a step depend only on the seed and the step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

from nemo_ssa.study import icl

#: the evaluation conditions: name -> keyword arguments of icl.sample
SHIFTS = {
    "in-distribution": {},
    "x x2": {"x_scale": 2.0}, "x x4": {"x_scale": 4.0}, "x x8": {"x_scale": 8.0},
    "w x2": {"w_scale": 2.0}, "w x4": {"w_scale": 4.0},
    "x,w x2": {"x_scale": 2.0, "w_scale": 2.0},
    "x uniform": {"x_dist": "uniform"}, "x laplace": {"x_dist": "laplace"}, "x student-t3": {"x_dist": "student_t3"},
}


@dataclass
class ICLConfig:
    """The task (``d`` dimensions, ``k`` examples a prompt), the model (a small GPT block with
    GQA, as the recipe's), and the schedule (Adam, fresh prompts every step)."""

    d: int = 8                # input dimension
    k: int = 24               # examples per prompt (2k tokens)
    layers: int = 6
    hidden: int = 128
    heads: int = 4
    groups: int = 2           # K/V groups: two query heads share one (the recipe: three)
    steps: int = 3000
    batch: int = 64           # prompts per step
    lr: float = 3e-4
    eval_prompts: int = 512   # held-out prompts per evaluation condition
    #: the whole training step as one CUDA graph (``--cuda-graphs``, CUDA only): part of the
    #: run's identity, so a run never resumes on the other path
    cuda_graphs: bool = False


CPU_SMOKE = ICLConfig(d=3, k=8, layers=2, hidden=32, heads=4, groups=2, steps=40, batch=16, lr=3e-3, eval_prompts=64)


class ICLModel(torch.nn.Module):
    """read-in -> TransformerBlock(our layer spec) -> read-out."""

    def __init__(self, cfg: ICLConfig, attention: str):
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_block import TransformerBlock

        from nemo_ssa.megatron.spec import layer_spec

        cuda = torch.cuda.is_available()
        self.config = TransformerConfig(
            num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
            num_query_groups=cfg.groups, ffn_hidden_size=4 * cfg.hidden, use_cpu_initialization=True,
            add_bias_linear=False, apply_rope_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
            bf16=cuda, params_dtype=torch.bfloat16 if cuda else torch.float32)
        self.read_in = torch.nn.Linear(cfg.d + 1, cfg.hidden)
        self.block = TransformerBlock(self.config, layer_spec(self.config, attention, fused_mlp=False))
        self.read_out = torch.nn.Linear(cfg.hidden, 1)
        self.rope = RotaryEmbedding(kv_channels=cfg.hidden // cfg.heads, rotary_percent=1.0)
        self.dtype = self.config.params_dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, 2k, d+1] -> predictions [B, k] (read at the x positions)."""
        h = self.read_in(tokens).transpose(0, 1).contiguous().to(self.dtype)  # [s, b, h]
        h = self.block(h, attention_mask=None, rotary_pos_emb=self.rope(h.shape[0]))
        return self.read_out(h.float()).squeeze(-1).transpose(0, 1)[:, 0::2]


def ckpt_path(out: str, attention: str, seed: int) -> str:
    return os.path.join(out, "ckpt", f"{attention}-s{seed}.pt")


def _save_ckpt(path: str, cfg: ICLConfig, step: int, model, opt, losses: List[float], seconds: float) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"config": asdict(cfg), "step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                "losses": losses, "seconds": seconds}, path + ".tmp")
    os.replace(path + ".tmp", path)


#: eager steps before the step is captured (each a real training step): the first builds Adam's
#: state and the attention kernels' compiled launches, which must exist before a capture
GRAPH_WARMUP = 3


def _train_step(model, opt, tokens: torch.Tensor, ys: torch.Tensor, cfg: ICLConfig) -> torch.Tensor:
    """One step: forward, mean squared error / d, backward, clipping at 1, AdamW. Returns the
    loss on the device (reading it here would make the host wait for the GPU every step)."""
    loss = (model(tokens) - ys).pow(2).mean() / cfg.d
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


class _GraphedStep:
    """:func:`_train_step` as one CUDA graph (the prompts' shape never changes): ``GRAPH_WARMUP``
    eager steps, then the step is captured into static input buffers and replayed from then on
    (the capture itself runs nothing: its step is the first replay). The host's work per step
    is one prompt draw, two copies and a replay instead of ~hundreds of launches: the step of
    this small model is otherwise host-bound. AdamW runs ``capturable`` (its step count on the
    device): the same update rule."""

    def __init__(self, model, opt, cfg: ICLConfig, dev: torch.device, stream):
        self.model, self.opt, self.cfg, self.stream = model, opt, cfg, stream
        self.tokens = torch.zeros(cfg.batch, 2 * cfg.k, cfg.d + 1, device=dev)
        self.ys = torch.zeros(cfg.batch, cfg.k, device=dev)
        self.graph, self.loss, self.warm, self.failed = None, None, 0, None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, tokens: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens, non_blocking=True)
        self.ys.copy_(ys, non_blocking=True)
        if self.graph is None and (self.warm < GRAPH_WARMUP or self.failed):
            self.warm += 1
            return _train_step(self.model, self.opt, self.tokens, self.ys, self.cfg)
        if self.graph is None:
            self.opt.zero_grad(set_to_none=True)  # .grad then lives in the graph's pool: each replay writes it
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=self.stream):
                    loss = _train_step(self.model, self.opt, self.tokens, self.ys, self.cfg)
            except Exception as e:  # a capture runs nothing: the weights are untouched, the step runs eagerly
                self.failed = f"{type(e).__name__}: {e}"
                print(f"[icl] CUDA graph capture failed ({self.failed}); the run continues without graphs", flush=True)
                return _train_step(self.model, self.opt, self.tokens, self.ys, self.cfg)
            self.graph, self.loss = graph, loss
        self.graph.replay()
        return self.loss


def train_one(cfg: ICLConfig, attention: str, seed: int, log_every: int = 0, *, ckpt: Optional[str] = None,
              checkpoint_every: int = 0, deadline: Optional[float] = None,
              stop_at: Optional[int] = None) -> Optional[Dict]:
    """Train one run and evaluate it; with ``ckpt``, resume from that checkpoint when it holds this
    configuration, save one every ``checkpoint_every`` steps, and -- past ``deadline``
    (``time.time()``) or at step ``stop_at`` -- save and return None (a later call goes on from
    there). The prompts of a
    step depend only on the seed and the step, so a resumed run sees what it would have seen:
    bit for bit on CPU. On CUDA the run works on its own stream and the losses stay on the
    device until a log line, a checkpoint or the end; ``cfg.cuda_graphs`` replays the step as
    one graph (:class:`_GraphedStep`)."""
    from nemo_ssa.megatron.single import init_single_process

    cuda = torch.cuda.is_available()
    if cfg.cuda_graphs and not cuda:
        raise ValueError("--cuda-graphs needs a CUDA device (run without it on a CPU)")
    init_single_process(seed)
    dev = torch.device("cuda" if cuda else "cpu")
    from nemo_ssa.megatron.cpu import cpu_device_shims

    shims = contextlib.nullcontext() if cuda else cpu_device_shims()
    stream = torch.cuda.Stream() if cuda else None  # a graph is captured on a side stream, warm-up included
    with shims, (torch.cuda.stream(stream) if cuda else contextlib.nullcontext()):
        model = ICLModel(cfg, attention).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0,
                                **({"capturable": True} if cfg.cuda_graphs else {}))
        losses, t0, first, before = [], time.time(), 0, 0.0
        if ckpt and os.path.isfile(ckpt):
            state = torch.load(ckpt, map_location=dev, weights_only=True)
            if state.get("config") == asdict(cfg):
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                losses, first, before = list(state["losses"]), int(state["step"]), float(state["seconds"])
                print(f"[icl] {attention} seed {seed}: resumed at step {first}/{cfg.steps} from {ckpt}", flush=True)
            else:
                print(f"[icl] {attention} seed {seed}: {ckpt} is another configuration's checkpoint; starting afresh",
                      flush=True)
        # every step's loss, float32 as computed; read back (.tolist()) only where it is needed
        history = torch.zeros(cfg.steps, device=dev)
        if losses:
            history[:len(losses)] = torch.tensor(losses)
        graphed = _GraphedStep(model, opt, cfg, dev, stream) if cfg.cuda_graphs else None
        for step in range(first, cfg.steps):
            if ckpt and (deadline is not None and time.time() > deadline or stop_at is not None and step >= stop_at):
                _save_ckpt(ckpt, cfg, step, model, opt, history[:step].tolist(), before + time.time() - t0)
                print(f"[icl] {attention} seed {seed}: stopped at step {step}/{cfg.steps} (budget); "
                      f"checkpoint {ckpt}", flush=True)
                return None
            p = icl.sample(cfg.batch, cfg.k, cfg.d, seed=seed * 1_000_003 + step)  # same prompts for every attention
            tokens, ys = icl.to_tokens(p), p.ys
            if cuda:  # copied without blocking (a copy from pageable memory waits for the GPU)
                tokens, ys = tokens.pin_memory(), ys.pin_memory()
            if graphed is not None:
                loss = graphed(tokens, ys)
            else:
                loss = _train_step(model, opt, tokens.to(dev, non_blocking=True), ys.to(dev, non_blocking=True), cfg)
            history[step].copy_(loss)
            if log_every and (step + 1) % log_every == 0:
                print(f"[icl] {attention} seed {seed} step {step + 1}/{cfg.steps} loss {float(history[step]):.4f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
            if ckpt and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < cfg.steps:
                _save_ckpt(ckpt, cfg, step + 1, model, opt, history[:step + 1].tolist(), before + time.time() - t0)
        losses = history.tolist()
        curves = {}
        model.eval()
        with torch.no_grad():
            for name, kw in SHIFTS.items():
                p = icl.sample(cfg.eval_prompts, cfg.k, cfg.d, seed=10_000_019 + seed, **kw)
                err = (model(icl.to_tokens(p).to(dev)).float().cpu() - p.ys).pow(2).mean(0) / cfg.d
                curves[name] = {"model": err.tolist(), "least_squares": (icl.least_squares_error(p) / cfg.d).tolist()}
    out = {"attention": attention, "seed": seed, "train_loss": losses, "eval": curves,
           "seconds": before + time.time() - t0}
    if graphed is not None:  # whether the steps of this call replayed a graph, and why not
        out["cuda_graph"] = {"captured": graphed.captured, "failed": graphed.failed}
    return out


def run_path(out: str, attention: str, seed: int) -> str:
    return os.path.join(out, "runs", f"{attention}-s{seed}.json")


def save_run(out: str, cfg: ICLConfig, result: Dict) -> None:
    """One finished run, written as it finishes (a later call reuses it)."""
    path = run_path(out, result["attention"], result["seed"])
    with open(path + ".tmp", "w") as f:
        json.dump({"config": asdict(cfg), "result": result}, f)
    os.replace(path + ".tmp", path)


def load_run(out: str, cfg: ICLConfig, attention: str, seed: int) -> Optional[Dict]:
    """A finished run with this exact configuration, else None (a changed task retrains)."""
    path = run_path(out, attention, seed)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    return saved["result"] if saved.get("config") == asdict(cfg) else None


def table(results: List[Dict], cfg: ICLConfig, at: Optional[List[int]] = None) -> str:
    """Mean (± sd over seeds) error per shift at a few example counts, least squares beside."""
    at = at or sorted({1, cfg.d // 2, cfg.d, cfg.k - 1} - {0})
    names = sorted({r["attention"] for r in results})
    head = "| condition | examples | " + " | ".join(names) + " | least squares |"
    lines = [head, "|" + "---|" * (3 + len(names))]

    def fmt(vals):
        return f"{statistics.fmean(vals):.3f}" + (f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")

    for shift in SHIFTS:
        for i in at:
            cells = [fmt([r["eval"][shift]["model"][i] for r in results if r["attention"] == n]) for n in names]
            by_seed = {r["seed"]: r["eval"][shift]["least_squares"][i] for r in results}  # same prompts per seed
            ls = fmt(list(by_seed.values()))
            lines.append(f"| {shift} | {i} | " + " | ".join(cells) + f" | {ls} |")
    return "\n".join(lines)


def verdict_table(results: List[Dict], cfg: ICLConfig, names: List[str], at: Optional[List[int]] = None) -> str:
    """Every attention against the first, per condition at a few example counts: the
    seed-paired difference of error / d, its 95 % interval and the seed spread, with the
    study's rule (``nemo_ssa.study.verdict``: detected when the interval excludes 0 and the
    difference exceeds the spread). Lower is better."""
    from nemo_ssa.study.verdict import compare_pair

    at = at or sorted({cfg.d, cfg.k - 1})
    base = names[0]
    lines = []
    for other in names[1:]:
        lines += [f"| condition | examples | {other} - {base} | 95 % CI | seed spread | verdict |",
                  "|---|---|---|---|---|---|"]
        for shift in SHIFTS:
            runs = {n: {r["seed"]: (list(range(cfg.k)), r["eval"][shift]["model"]) for r in results
                        if r["attention"] == n} for n in (other, base)}
            for v in compare_pair(runs[other], runs[base], [(i, i) for i in at], names=(other, base)):
                ci = f"[{v.ci[0]:+.3f}, {v.ci[1]:+.3f}]" if v.ci else "-"
                spread = f"{v.seed_spread:.3f}" if v.seed_spread is not None else "-"
                lines.append(f"| {shift} | {v.bucket[0]} | {v.diff:+.3f} | {ci} | {spread} | {v.verdict} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attentions", default="softmax,ssa")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1,
                    help="seeds first..first+seeds-1 (one process per seed range can share an --out)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny configuration (seconds on CPU)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop training after this many seconds with a checkpoint under <out>/ckpt (exit 3); the "
                         "same command resumes")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps")
    ap.add_argument("--stop-after-steps", type=int, default=None,
                    help="stop each run at this step with a checkpoint (exit 3), as --budget-s does")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay each training step as one CUDA graph (CUDA only; part of the run's configuration)")
    args = ap.parse_args(argv)
    cfg = CPU_SMOKE if args.cpu_smoke else ICLConfig()
    if args.steps:
        cfg = ICLConfig(**{**asdict(cfg), "steps": args.steps})
    if args.cuda_graphs:
        if not torch.cuda.is_available():
            ap.error("--cuda-graphs needs a CUDA device (run without it on a CPU)")
        cfg = ICLConfig(**{**asdict(cfg), "cuda_graphs": True})
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    results, t0, trained = [], time.time(), 0
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(a, s) for s in seeds for a in args.attentions.split(",")]
    deadline = t0 + args.budget_s if args.budget_s is not None else None
    unfinished = []
    for i, (attention, seed) in enumerate(jobs):
        r = load_run(args.out, cfg, attention, seed)
        if r is None:
            r = train_one(cfg, attention, seed, log_every=max(cfg.steps // 5, 1),
                          ckpt=ckpt_path(args.out, attention, seed), checkpoint_every=args.checkpoint_every,
                          deadline=deadline, stop_at=args.stop_after_steps)
            if r is None:
                unfinished.append(f"{attention}-s{seed}")
                continue
            save_run(args.out, cfg, r)
            if os.path.isfile(ckpt_path(args.out, attention, seed)):
                os.remove(ckpt_path(args.out, attention, seed))
            trained += 1
        else:
            print(f"[icl] {attention} seed {seed}: reused {run_path(args.out, attention, seed)}", flush=True)
        results.append(r)
        done = time.time() - t0
        left = done / max(trained, 1) * (len(jobs) - i - 1) if trained else 0.0
        print(f"[icl] {i + 1}/{len(jobs)} runs done, {done:.0f} s; about {left:.0f} s left", flush=True)
    if unfinished:
        print(f"[icl] unfinished (budget): {', '.join(unfinished)}; the same command resumes them", flush=True)
        return 3
    with open(os.path.join(args.out, "icl.json"), "w") as f:
        json.dump({"config": asdict(cfg), "results": results}, f)
    text = table(results, cfg)
    names = list(dict.fromkeys(args.attentions.split(",")))
    if len(names) > 1:
        text += "\n\n## Seed-paired verdicts (error / d; lower is better)\n\n" + verdict_table(results, cfg, names)
    with open(os.path.join(args.out, "icl.md"), "w") as f:
        f.write(f"# In-context linear regression, d={cfg.d}, k={cfg.k}\n\nerror / d (mean ± sd over seeds)\n\n"
                f"{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
