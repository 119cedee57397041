"""Train the recipe's model on a CPU-only machine with megatron-core's own components.

NeMo's trainer cannot run without CUDA (its MegatronStrategy creates CUDA streams,
megatron's schedules place tensors on ``cuda``), but megatron-core's GPTModel trains on
CPU. This loop takes the *same* NeMo recipe — model config (our spec inside), data
module, optimizer config and LR schedule — shrinks the dimensions
(:mod:`nemo_ssa.train.cpu_recipe`), and runs:

- ``torch.distributed`` over gloo and megatron's parallel state: world size 1, or
  several processes launched by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_*``) with the
  recipe's tensor / context / sequence parallel sizes and data parallel filling the rest
  (:mod:`nemo_ssa.train.process`);
- the model from ``GPTConfig.configure_model`` wrapped in megatron's DDP (grad reduce over
  the data-and-context-parallel group, overlapped with backward when the recipe asks),
  gradients finished by megatron's ``finalize_model_grads`` (the sequence-parallel
  LayerNorm all-reduce included), micro-batches in ``no_sync`` until the last, like
  megatron's schedule;
- ``get_megatron_optimizer`` with our ``no_weight_decay_cond`` (SSA's n exempt;
  :mod:`nemo_ssa.train.ddp`);
- NeMo's own LR scheduler (``recipe.optim.lr_scheduler``) through NeMo's optimizer adapter;
- batches from the recipe's ``PreTrainingDataModule`` in megatron's pretraining sampler
  order for this data-parallel rank, sliced for context parallel by megatron's
  ``get_batch_on_this_cp_rank`` (what NeMo's trainer would feed);
- ``dist_checkpointing`` (torch_dist format) for save/resume, with the RNG states and
  the data position in the checkpoint so a resumed run continues the same curve
  (:mod:`nemo_ssa.train.checkpoint_io`);
- the same logs as the GPU path: TensorBoard (``reduced_train_loss``, ``lr``,
  ``ssa/n/layer_XX``) and ``metrics.csv``.

It says which path it took, and is sized for minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from nemo_ssa.megatron import sync_free
from nemo_ssa.tools.metrics_log import MetricsWriter, append_heldout
from nemo_ssa.train.checkpoint_io import load_checkpoint, resume_checkpoint, save_checkpoint
from nemo_ssa.train.ddp import ddp_config_for, no_decay_parameter_names, wrap_for_training
from nemo_ssa.train.faults import fault_injection
from nemo_ssa.train.process import (ParallelLayout, apply_layout_to_config, init_distributed, parallel_layout,
                                    teardown_distributed)
from nemo_ssa.train.rng import preserved_rng
from nemo_ssa.train.warmup import warmup_attention


@dataclass
class CPUTrainResult:
    run_dir: str
    steps: int
    losses: List[float]
    ssa_n: Dict[int, float]
    checkpoint: Optional[str]
    metrics_csv: str
    elapsed_s: float
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class _Training:
    """What one run trains with, built from the recipe."""

    cfg: Any
    ddp: Any
    optimizer: Any  # megatron's
    torch_opt: Any  # NeMo's adapter around it, what the scheduler wraps
    scheduler: Any
    dataset: Any
    heldout_dataset: Any  # the validation split, or None when no held-out loss is asked for
    n_params: int
    micro_batch_size: int
    global_batch_size: int
    num_micro: int  # micro-batches per optimizer step on this rank


def train_on_cpu(
    recipe,
    run_dir: str,
    *,
    max_steps: int,
    log_every: int = 1,
    ckpt_every: Optional[int] = None,
    resume: bool = False,
    warmup: bool = True,
    warmup_restores_rng: bool = True,
    seed: Optional[int] = None,
    stop_after: Optional[int] = None,
    save_at_end: bool = True,
    quiet: bool = False,
    heldout_every: Optional[int] = None,
    heldout_batches: int = 1,
) -> CPUTrainResult:
    """Train ``recipe`` (already shrunk with :func:`~nemo_ssa.train.cpu_recipe.shrink_for_cpu`) on CPU.

    Runs in a world of one process, or in every process of a ``torchrun`` launch (each
    rank calls this with the same arguments); the recipe's strategy gives the tensor /
    context / sequence parallel sizes, data parallel takes the rest of the world.

    Args:
        recipe: a ``run.Partial`` from ``recipes.nemotron_114m.pretrain_recipe``.
        run_dir: where logs and checkpoints go (written by global rank 0; checkpoints
            by every rank, megatron's dist_checkpointing).
        max_steps: optimizer steps of the full schedule (LR schedule length).
        log_every: print every N steps (CSV/TensorBoard get every step).
        ckpt_every: save a checkpoint every N steps (and at the end) when set.
        resume: continue from the newest complete checkpoint in ``run_dir/checkpoints``
            (saved at any parallel layout).
        warmup: warm the core attentions up before step 0.
        warmup_restores_rng: restore every RNG after warm-up (False only for the
            negative-control test).
        seed: overrides the data module's seed for initialisation.
        stop_after: stop after this global step (simulates an interruption); the
            schedule still spans ``max_steps``.
        save_at_end: checkpoint at the last step run (False with ``stop_after`` simulates a
            crash: the resume restarts from the previous periodic checkpoint).
        quiet: print less.
        heldout_every: every N steps (and at the last), the loss on ``heldout_batches``
            global batches of the validation split -> ``heldout.csv``, as NeMo's validation
            writes it on GPUs; needs a recipe shrunk with ``shrink_for_cpu(..., heldout=True)``.
        heldout_batches: global batches per held-out evaluation (the same ones each time).

    Returns:
        :class:`CPUTrainResult` (the same on every rank: losses are reduced over the
        data- and context-parallel ranks; ``extra["layout"]`` says how it ran).
    """
    import torch.distributed as dist

    from nemo_ssa.megatron import compat
    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.megatron.introspect import ssa_values
    from nemo_ssa.nemo.trainer_parts import pretraining_batches
    from nemo_ssa.versions import check_stack

    check_stack()
    compat.apply_megatron_compat()  # numpy 2 + megatron-core 0.15: multi-rank checkpoints
    t_start = time.time()
    seed = int(seed if seed is not None else getattr(recipe.data, "seed", 1234))
    layout = parallel_layout(recipe)
    created = init_distributed(seed, layout)
    rank = dist.get_rank()
    main = rank == 0
    say = (lambda *a: None) if (quiet or not main) else (lambda *a: print("[cpu]", *a, flush=True))
    if main:
        os.makedirs(run_dir, exist_ok=True)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    say(f"path: megatron-core CPU loop (no CUDA here: NeMo's trainer needs a GPU); run dir {run_dir}")
    if layout.world > 1:
        say(f"parallel: {layout.describe()} (gloo)")

    try:
        with cpu_device_shims():
            from megatron.core import parallel_state

            tr = _build_training(recipe, layout, max_steps, say, heldout_every, heldout_batches)
            dp_rank = parallel_state.get_data_parallel_rank()

            step = 0
            if resume:
                # rank 0 decides, every rank loads the same one (a collective load)
                choice = [resume_checkpoint(ckpt_root) if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(choice, src=0)
                latest, skipped = choice[0]
                for path, why in skipped:
                    say(f"resume: skipped {path}: {why}")
                if latest is None:
                    say("resume: no loadable checkpoint found, starting from step 0")
                else:
                    step, note = load_checkpoint(latest, tr.ddp, tr.optimizer, tr.scheduler, layout)
                    say(f"resume: loaded {latest} (global step {step}{note}"
                        f"{f'; {len(skipped)} newer one(s) skipped' if skipped else ''})")

            # a DataLoader iterator draws its base seed from torch's generator: a fresh run
            # draws it before step 1, where the checkpoint's RNG state already includes that
            # draw -- so a resumed run must not draw again (dropout masks would shift)
            with preserved_rng(step > 0):
                batches = pretraining_batches(tr.dataset, tr.micro_batch_size, tr.global_batch_size,
                                              consumed_samples=step * tr.global_batch_size, dp_rank=dp_rank,
                                              dp_size=layout.dp)
            writer = MetricsWriter(run_dir, append=resume and step > 0) if main else None

            if warmup and step == 0:
                # inside the block: creating a DataLoader iterator draws its base seed
                # from torch's generator, so even the peek at the batch shape counts
                with preserved_rng(warmup_restores_rng):
                    peek = pretraining_batches(tr.dataset, tr.micro_batch_size, tr.global_batch_size,
                                               consumed_samples=0, dp_rank=dp_rank, dp_size=layout.dp)
                    warmed = warmup_attention(tr.ddp, _cp_slice(next(peek)))
                say(f"warm-up: {warmed} attention type(s), RNG "
                    f"{'restored' if warmup_restores_rng else 'NOT restored (negative control)'}")

            losses: List[float] = []
            n_history: List[List[float]] = []
            last_ckpt = None
            end = max_steps if stop_after is None else min(max_steps, stop_after)
            tokens_per_step = tr.global_batch_size * tr.cfg.seq_length
            while step < end:
                t0 = time.time()
                total, lr, grad_norm = _train_step(tr, batches, layout)
                step += 1
                dt = time.time() - t0
                if not math.isfinite(total):
                    raise FloatingPointError(f"non-finite loss {total} at global step {step}")
                losses.append(total)
                n_vals = ssa_values(tr.ddp)["n"]
                n_history.append([v for _, v in sorted(n_vals.items())])
                _check_ssa_n_identical_over_tp(n_vals, layout, step)
                if writer is not None:
                    writer.write(step=step, loss=total, lr=lr, tokens_per_s=tokens_per_step / dt,
                                 grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                                 ssa_n=n_vals)
                if step % log_every == 0 or step == end:
                    _say_step(say, step, max_steps, total, lr, tokens_per_step / dt, n_vals)
                if heldout_every and (step % heldout_every == 0 or step == end):
                    val = _heldout_loss(tr, layout, dp_rank, heldout_batches)
                    if main:
                        append_heldout(run_dir, step, val)
                    say(f"held-out loss at step {step}: {val:.4f}")
                if (ckpt_every and step % ckpt_every == 0) or (step == end and save_at_end):
                    sync_free.GUARD.check(wait=True)  # no checkpoint of a step whose gradient check failed
                    last_ckpt = save_checkpoint(ckpt_root, step, tr.ddp, tr.optimizer, tr.scheduler, layout)
                fault_injection("step_end", step)
            if writer is not None:
                writer.close()
            result = CPUTrainResult(
                run_dir=run_dir, steps=step, losses=losses, ssa_n=ssa_values(tr.ddp)["n"],
                checkpoint=last_ckpt, metrics_csv=os.path.join(run_dir, "metrics.csv"),
                elapsed_s=time.time() - t_start,
                extra={"params": tr.n_params, "tokens_per_step": tokens_per_step,
                       "no_weight_decay": no_decay_parameter_names(tr.ddp, tr.optimizer),
                       "layout": layout.describe(), "rank": rank, "n_history": n_history,
                       "distributed_optimizer": bool(tr.ddp.ddp_config.use_distributed_optimizer)},
            )
            _write_run_files(result, tr.ddp, main)
            return result
    finally:
        if created:
            teardown_distributed()


def _build_training(recipe, layout: ParallelLayout, max_steps: int, say: Callable[..., None],
                    heldout_every: Optional[int] = None, heldout_batches: int = 1) -> _Training:
    """Model, DDP, optimizer, LR scheduler and train dataset from the recipe, in the order
    NeMo builds them (model initialisation draws from the RNGs seeded just before).
    Call inside :func:`~nemo_ssa.megatron.cpu.cpu_device_shims`."""
    import fiddle as fdl

    from nemo_ssa.config.check import check_parallel
    from nemo_ssa.megatron.output_layer import install_fused_cross_entropy
    from nemo_ssa.nemo.trainer_parts import lightning_optimizer

    cfg = fdl.build(recipe.model.config)
    apply_layout_to_config(cfg, layout)
    check_parallel(attention=str(getattr(recipe.model.config.transformer_layer_spec, "attention", "softmax")),
                   world=layout.world, tensor_parallel=layout.tp, context_parallel=layout.cp,
                   sequence_parallel=layout.sp, pipeline_parallel=layout.pp, seq_length=cfg.seq_length,
                   micro_batch_size=recipe.data.micro_batch_size,
                   global_batch_size=recipe.data.global_batch_size,
                   arch={"num_attention_heads": cfg.num_attention_heads,
                         "num_query_groups": cfg.num_query_groups})
    datamodule = fdl.build(recipe.data)
    tokenizer = getattr(datamodule, "tokenizer", None)
    model = cfg.configure_model(tokenizer)
    # model.fused_cross_entropy (bound into the recipe's forward step): auto is off on
    # the CPU; true runs the chunked output layer + loss eagerly
    install_fused_cross_entropy(model, getattr(cfg.forward_step_fn, "keywords", {}).get(
        "fused_cross_entropy", "auto"))
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.bf16 or cfg.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)  # what NeMo's mixed-precision plugin does
    say(f"model: {cfg.num_layers}L h{cfg.hidden_size} heads {cfg.num_attention_heads}/"
        f"{cfg.num_query_groups} ffn {cfg.ffn_hidden_size} seq {cfg.seq_length}: {n_params:,} params"
        + (" on this rank" if layout.tp > 1 else ""))
    ddp, optimizer = wrap_for_training(cfg, model, fdl.build(recipe.optim.config),
                                       ddp_config=ddp_config_for(recipe, layout))
    torch_opt = lightning_optimizer(optimizer)
    sched_module = fdl.build(recipe.optim.lr_scheduler)
    sched_module.max_steps = max_steps
    scheduler = sched_module.scheduler(ddp, torch_opt)["lr_scheduler"]["scheduler"]

    mbs = datamodule.micro_batch_size
    gbs = datamodule.global_batch_size
    if gbs % (mbs * layout.dp):
        raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size x data parallel "
                         f"size = {mbs} x {layout.dp} ({layout.describe()})")
    if heldout_every and str(getattr(recipe.data, "split", "")).split(",")[1:2] in (["0"], []):
        raise ValueError(f"heldout_every={heldout_every}: the recipe has no validation split "
                         f"(split={getattr(recipe.data, 'split', None)!r}); shrink it with "
                         "shrink_for_cpu(..., heldout=True)")
    datamodule.build(trainer_max_steps=max_steps, trainer_val_check_interval=heldout_every or max_steps,
                     trainer_limit_val_batches=heldout_batches if heldout_every else 0,
                     trainer_limit_test_batches=0)
    return _Training(cfg=cfg, ddp=ddp, optimizer=optimizer, torch_opt=torch_opt, scheduler=scheduler,
                     dataset=datamodule._train_ds,
                     heldout_dataset=datamodule._validation_ds if heldout_every else None, n_params=n_params, micro_batch_size=mbs,
                     global_batch_size=gbs, num_micro=gbs // (mbs * layout.dp))


def _train_step(tr: _Training, batches, layout: ParallelLayout):
    """One optimizer step over ``tr.num_micro`` micro-batches; returns (loss averaged over
    the data- and context-parallel ranks, the lr it stepped with, the grad norm)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    ddp, num_micro = tr.ddp, tr.num_micro
    ddp.train()
    ddp.zero_grad_buffer()
    tr.optimizer.zero_grad()
    total = 0.0
    for i in range(num_micro):
        batch = _cp_slice(next(batches))
        # like megatron's schedule: no grad sync until the last micro-batch
        with (ddp.no_sync() if i < num_micro - 1 else contextlib.nullcontext()):
            out = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                      loss_mask=batch["loss_mask"])
            loss = _loss_from_output(out, batch["loss_mask"]) / num_micro
            loss.backward()
        total += float(loss.detach())
    finalize_model_grads([ddp])
    # through NeMo's adapter, as Lightning does: it calls the same optimizer.step(), and
    # the scheduler (which wrapped the adapter's step to track the call order) then sees
    # that the optimizer stepped first -- calling megatron's optimizer directly makes
    # torch warn "Detected call of lr_scheduler.step() before optimizer.step()".
    _, grad_norm, _ = tr.torch_opt.step()
    lr = tr.optimizer.param_groups[0]["lr"]
    tr.scheduler.step()
    if layout.dp * layout.cp > 1:
        # each rank's total is the mean over its own tokens: average over dp x cp
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        total = float(t[0]) / (layout.dp * layout.cp)
    return total, lr, grad_norm


def _heldout_loss(tr: _Training, layout: ParallelLayout, dp_rank: int, batches: int) -> float:
    """Mean loss over the first ``batches`` global batches of the validation split, in eval
    mode without gradients, averaged over the data- and context-parallel ranks. The RNG
    state is restored after it, so evaluating does not change the training run."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_ssa.nemo.trainer_parts import pretraining_batches

    ddp = tr.ddp
    total, count = 0.0, 0
    with preserved_rng(True), torch.no_grad():
        ddp.eval()
        try:
            it = pretraining_batches(tr.heldout_dataset, tr.micro_batch_size, tr.global_batch_size,
                                     consumed_samples=0, dp_rank=dp_rank, dp_size=layout.dp)
            for _ in range(batches * tr.num_micro):
                batch = _cp_slice(next(it))
                out = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                          loss_mask=batch["loss_mask"])
                total += float(_loss_from_output(out, batch["loss_mask"]))
                count += 1
        finally:
            ddp.train()
    mean = total / max(count, 1)
    if layout.dp * layout.cp > 1:
        t = torch.tensor([mean], dtype=torch.float64)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        mean = float(t[0]) / (layout.dp * layout.cp)
    return mean


def _loss_from_output(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp_min(1.0)


def _cp_slice(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's load-balanced context-parallel slicing (what NeMo's data step does)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
    return get_batch_on_this_cp_rank({k: batch.get(k) for k in keys if batch.get(k) is not None})


def _check_ssa_n_identical_over_tp(n_vals: Dict[int, float], layout: ParallelLayout, step: int) -> None:
    """Tensor-parallel ranks hold a copy of each SSA n: they must agree after every step."""
    if not n_vals or layout.tp <= 1:
        return
    from megatron.core import parallel_state

    from nemo_ssa.megatron.parallel import assert_identical_over_group

    assert_identical_over_group(torch.tensor([v for _, v in sorted(n_vals.items())]),
                                parallel_state.get_tensor_model_parallel_group(), f"SSA n after step {step}")


def _say_step(say: Callable[..., None], step: int, max_steps: int, loss: float, lr: float, tokens_per_s: float,
              n_vals: Dict[int, float]) -> None:
    n_txt = (" n=" + ",".join(f"{v:.4f}" for _, v in sorted(n_vals.items()))) if n_vals else ""
    say(f"step {step:5d}/{max_steps} loss {loss:.4f} lr {lr:.3e} {tokens_per_s:,.0f} tok/s{n_txt}")


def _write_run_files(result: CPUTrainResult, ddp, main: bool) -> None:
    """Every rank: its own SSA n and b; rank 0: ``cpu_run.json`` with the result."""
    from nemo_ssa.megatron.introspect import ssa_values
    from nemo_ssa.tools.metrics_log import rank_layout, write_rank_file

    write_rank_file(result.run_dir, rank_layout(), result.steps, ssa_values(ddp))
    if main:
        with open(os.path.join(result.run_dir, "cpu_run.json"), "w") as f:
            json.dump({k: v for k, v in result.__dict__.items()}, f, indent=2, default=str)
