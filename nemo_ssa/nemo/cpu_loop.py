"""Train the recipe's model on a CPU-only machine with megatron-core's own components.

NeMo's trainer cannot run without CUDA (its MegatronStrategy creates CUDA streams,
megatron's schedules place tensors on ``cuda``), but megatron-core's GPTModel trains on
CPU. This loop takes the *same* NeMo recipe — model config (our spec inside), data
module, optimizer config and LR schedule — shrinks the dimensions, and runs:

- ``torch.distributed`` over gloo and megatron's parallel state: world size 1, or
  several processes launched by ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_*``) with the
  recipe's tensor / context / sequence parallel sizes and data parallel filling the rest
  (:func:`parallel_layout`);
- the model from ``GPTConfig.configure_model`` wrapped in megatron's DDP (grad reduce over
  the data-and-context-parallel group, overlapped with backward when the recipe asks),
  gradients finished by megatron's ``finalize_model_grads`` (the sequence-parallel
  LayerNorm all-reduce included), micro-batches in ``no_sync`` until the last, like
  megatron's schedule;
- ``get_megatron_optimizer`` with our ``no_weight_decay_cond`` (SSA's n exempt);
- NeMo's own LR scheduler (``recipe.optim.lr_scheduler``) through NeMo's optimizer adapter;
- batches from the recipe's ``PreTrainingDataModule`` in megatron's pretraining sampler
  order for this data-parallel rank, sliced for context parallel by megatron's
  ``get_batch_on_this_cp_rank`` (what NeMo's trainer would feed);
- ``dist_checkpointing`` (torch_dist format) for save/resume, with the RNG states and
  the data position in the checkpoint so a resumed run continues the same curve;
- the same logs as the GPU path: TensorBoard (``reduced_train_loss``, ``lr``,
  ``ssa/n/layer_XX``) and ``metrics.csv``.

It says which path it took, and is sized for minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from nemo_ssa.metrics_log import MetricsWriter
from nemo_ssa.rng import preserved_rng, restore_rng, snapshot_rng, RNGSnapshot

log = logging.getLogger("nemo_ssa.cpu")

#: dimensions the CPU path shrinks the 114M model to (same architecture family)
TINY_ARCH = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
)


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


def shrink_for_cpu(recipe, arch: Optional[Dict[str, Any]] = None, seq_length: Optional[int] = None,
                   micro_batch_size: Optional[int] = None, global_batch_size: Optional[int] = None) -> None:
    """Shrink a recipe in place for the CPU loop (fp32, CPU init, no fused CUDA paths)."""
    cfg = recipe.model.config
    for key, value in (arch or TINY_ARCH).items():
        setattr(cfg, key, value)
    if seq_length is not None:
        cfg.seq_length = seq_length
        recipe.data.seq_length = seq_length
    if micro_batch_size is not None:
        recipe.data.micro_batch_size = micro_batch_size
    if global_batch_size is not None:
        recipe.data.global_batch_size = global_batch_size
    cfg.bf16 = False
    cfg.fp16 = False
    cfg.params_dtype = torch.float32
    cfg.pipeline_dtype = None
    cfg.autocast_dtype = None
    cfg.use_cpu_initialization = True
    cfg.cross_entropy_loss_fusion = False
    cfg.gradient_accumulation_fusion = False
    cfg.masked_softmax_fusion = False
    cfg.bias_activation_fusion = False
    cfg.apply_rope_fusion = False
    recipe.optim.config.bf16 = False
    recipe.optim.config.fp16 = False
    # No validation/test in the CPU loop: tiny corpora would give empty splits, on which
    # megatron's GPTDataset epoch count never terminates.
    if hasattr(recipe.data, "split"):
        recipe.data.split = "100,0,0"
    if hasattr(recipe.data, "num_workers"):
        recipe.data.num_workers = 0
    if hasattr(recipe.data, "pin_memory"):
        recipe.data.pin_memory = False


def use_bf16_on_cpu(recipe) -> None:
    """Switch a shrunk recipe to bf16 mixed precision, as NeMo's ``bf16-mixed`` plugin does
    (bf16 parameters and activations, fp32 master weights in the optimizer). For tests of
    the mixed-precision optimizers and their checkpoints on CPU; the CPU path trains fp32."""
    cfg = recipe.model.config
    cfg.bf16 = True
    cfg.fp16 = False
    cfg.params_dtype = torch.bfloat16
    cfg.pipeline_dtype = torch.bfloat16
    cfg.autocast_dtype = torch.bfloat16
    recipe.optim.config.bf16 = True
    recipe.optim.config.fp16 = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes of a run; data parallel fills the world."""

    tp: int = 1
    cp: int = 1
    sp: bool = False
    pp: int = 1
    world: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    def describe(self) -> str:
        return (f"world {self.world} = DP{self.dp} x TP{self.tp}{'+SP' if self.sp else ''} x CP{self.cp}"
                + (f" x PP{self.pp}" if self.pp > 1 else ""))


def parallel_layout(recipe, world: Optional[int] = None) -> ParallelLayout:
    """The recipe's TP/CP/SP/PP sizes and the world size (torch.distributed's, else
    ``WORLD_SIZE`` as torchrun sets it, else 1); refuses layouts that do not tile the world."""
    strategy = recipe.trainer.strategy
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout(tp=int(strategy.tensor_model_parallel_size or 1),
                            cp=int(strategy.context_parallel_size or 1),
                            sp=bool(strategy.sequence_parallel), pp=int(strategy.pipeline_model_parallel_size or 1),
                            world=int(world))
    if layout.world % (layout.tp * layout.cp * layout.pp):
        raise ValueError(f"world size {layout.world} is not a multiple of tensor_model_parallel_size x "
                         f"context_parallel_size x pipeline_model_parallel_size = {layout.tp * layout.cp * layout.pp}")
    return layout


def _init_distributed(seed: int, layout: Optional[ParallelLayout] = None) -> bool:
    """Gloo world (1 rank, or torchrun's) + megatron parallel state; seeds every RNG.

    True if it created the process group. An existing parallel state with other sizes
    is rebuilt (one process group can train several layouts in turn, as the tests do).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    layout = layout or ParallelLayout()
    created = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo")  # torchrun's env:// rendezvous
        else:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
            dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    if dist.get_world_size() != layout.world:
        raise ValueError(f"the process group has {dist.get_world_size()} rank(s) but the layout wants "
                         f"{layout.world} ({layout.describe()})")
    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() != layout.tp
            or parallel_state.get_context_parallel_world_size() != layout.cp
            or parallel_state.get_pipeline_model_parallel_world_size() != layout.pp):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                                 pipeline_model_parallel_size=layout.pp,
                                                 context_parallel_size=layout.cp)
    # CPU: no CUDA generators to seed; megatron's inference tracker forks nothing, so
    # dropout draws from torch's CPU generator (seeded below, the same on every rank).
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return created


def teardown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _batches(dataset, micro_batch_size: int, global_batch_size: int, consumed_samples: int,
             dp_rank: int = 0, dp_size: int = 1):
    """This data-parallel rank's micro-batches in megatron's pretraining-sampler order."""
    from nemo.lightning.data import MegatronPretrainingSampler

    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
        drop_last=True,
    )
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0,
                                         collate_fn=getattr(dataset, "collate_fn", None))
    return iter(loader)


def _loss_from_output(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp_min(1.0)


def _rng_to_obj(snap: RNGSnapshot) -> Dict[str, Any]:
    # megatron's RNG tracker (the generator dropout forks to) is part of the state: without
    # it a resumed run with dropout draws other masks from its first step on
    return {"python": snap.python, "numpy": snap.numpy, "torch_cpu": snap.torch_cpu,
            "megatron_tracker": snap.megatron_tracker}


def _rng_from_obj(obj: Dict[str, Any]) -> RNGSnapshot:
    return RNGSnapshot(python=obj["python"], numpy=obj["numpy"], torch_cpu=obj["torch_cpu"],
                       torch_cuda=None, megatron_tracker=obj.get("megatron_tracker"))


def warmup_attention(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> int:
    """Run one forward+backward of every distinct core attention (and NSA self-attention)
    on random inputs.

    On GPU this compiles and autotunes fused kernels before step 0. It draws random
    numbers: callers wrap it in :func:`nemo_ssa.rng.preserved_rng`. Gradients it
    produces are discarded. Returns how many core attentions were warmed.
    """
    from nemo_ssa.megatron.introspect import core_attentions

    seen = set()
    tokens = batch["tokens"]
    b, s = tokens.shape
    for _, mod in core_attentions(model):
        if type(mod) in seen:
            continue
        seen.add(type(mod))
        hq, hkv, d = mod.num_heads_per_partition, mod.num_groups_per_partition, mod.head_dim
        dev = tokens.device
        q = torch.randn(s, b, hq, d, device=dev, requires_grad=True)
        k = torch.randn(s, b, hkv, d, device=dev, requires_grad=True)
        v = torch.randn(s, b, hkv, d, device=dev, requires_grad=True)
        out = mod(q, k, v, None)
        out.float().sum().backward()
    # NSA replaces the whole self-attention (its kernels see the layer's projections), so
    # it is warmed through the module itself, on random hidden states. Its parameters are
    # frozen meanwhile: no gradient reaches them, so no DDP grad hook can fire.
    from nemo_ssa.megatron.nsa_attention import NSASelfAttention

    for mod in model.modules():
        if not isinstance(mod, NSASelfAttention) or (type(mod), mod.transform) in seen:
            continue
        seen.add((type(mod), mod.transform))
        params = [p for p in mod.parameters() if p.requires_grad]
        dtype = next((p.dtype for p in mod.parameters() if p.is_floating_point()), torch.float32)
        x = torch.randn(s, b, mod.config.hidden_size, device=tokens.device, dtype=dtype, requires_grad=True)
        for p in params:
            p.requires_grad_(False)
        try:
            out, _ = mod(x, None)
            out.float().sum().backward()
        except Exception as e:  # noqa: BLE001 -- warm-up only saves compile time; step 0 shows real errors
            warnings.warn(f"warm-up of {mod.attention_name} failed ({type(e).__name__}: {e}); "
                          "its kernels compile in step 0 instead")
            seen.discard((type(mod), mod.transform))
        finally:
            for p in params:
                p.requires_grad_(True)
    for p in model.parameters():
        if p.grad is not None:
            p.grad = None
    from nemo_ssa.megatron.compat import forget_ddp_grad_hooks

    forget_ddp_grad_hooks(model)  # n's hook fired above; megatron >= 0.16 would take it as step 1's pattern
    return len(seen)


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
) -> CPUTrainResult:
    """Train ``recipe`` (already shrunk with :func:`shrink_for_cpu`) on CPU.

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

    Returns:
        :class:`CPUTrainResult` (the same on every rank: losses are reduced over the
        data- and context-parallel ranks; ``extra["layout"]`` says how it ran).
    """
    import fiddle as fdl
    import torch.distributed as dist
    from nemo.core.optim.mcore_optim import McoreDistributedOptimizer

    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.megatron.introspect import ssa_values

    from nemo_ssa.megatron import compat
    from nemo_ssa.versions import check_stack

    check_stack()
    compat.apply_megatron_compat()  # numpy 2 + megatron-core 0.15: multi-rank checkpoints
    t_start = time.time()
    seed = int(seed if seed is not None else getattr(recipe.data, "seed", 1234))
    layout = parallel_layout(recipe)
    created = _init_distributed(seed, layout)
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
            from megatron.core.distributed import finalize_model_grads

            cfg = fdl.build(recipe.model.config)
            apply_layout_to_config(cfg, layout)
            from nemo_ssa.config_check import check_parallel

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
            from nemo_ssa.megatron.output_layer import install_fused_cross_entropy

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
                                               ddp_config=_ddp_config(recipe, layout))
            torch_opt = McoreDistributedOptimizer(optimizer)
            sched_module = fdl.build(recipe.optim.lr_scheduler)
            sched_module.max_steps = max_steps
            scheduler = sched_module.scheduler(ddp, torch_opt)["lr_scheduler"]["scheduler"]

            mbs = datamodule.micro_batch_size
            gbs = datamodule.global_batch_size
            if gbs % (mbs * layout.dp):
                raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size x data parallel "
                                 f"size = {mbs} x {layout.dp} ({layout.describe()})")
            num_micro = gbs // (mbs * layout.dp)
            datamodule.build(trainer_max_steps=max_steps, trainer_val_check_interval=max_steps,
                             trainer_limit_val_batches=0, trainer_limit_test_batches=0)
            dataset = datamodule._train_ds
            dp_rank = parallel_state.get_data_parallel_rank()
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            tp_group = parallel_state.get_tensor_model_parallel_group()

            step = 0
            if resume:
                latest = latest_checkpoint(ckpt_root)
                if latest is None:
                    say("resume: no checkpoint found, starting from step 0")
                else:
                    step, note = _load(latest, ddp, optimizer, scheduler, layout)
                    say(f"resume: loaded {latest} (global step {step}{note})")

            def next_batch(it):
                return _cp_slice(next(it))

            # a DataLoader iterator draws its base seed from torch's generator: a fresh run
            # draws it before step 1, where the checkpoint's RNG state already includes that
            # draw -- so a resumed run must not draw again (dropout masks would shift)
            with preserved_rng(step > 0):
                batches = _batches(dataset, mbs, gbs, consumed_samples=step * gbs, dp_rank=dp_rank,
                                   dp_size=layout.dp)
            writer = MetricsWriter(run_dir, append=resume and step > 0) if main else None

            if warmup and step == 0:
                # inside the block: creating a DataLoader iterator draws its base seed
                # from torch's generator, so even the peek at the batch shape counts
                with preserved_rng(warmup_restores_rng):
                    peek = _batches(dataset, mbs, gbs, consumed_samples=0, dp_rank=dp_rank, dp_size=layout.dp)
                    warmed = warmup_attention(ddp, next_batch(peek))
                say(f"warm-up: {warmed} attention type(s), RNG "
                    f"{'restored' if warmup_restores_rng else 'NOT restored (negative control)'}")

            losses: List[float] = []
            n_history: List[List[float]] = []
            last_ckpt = None
            end = max_steps if stop_after is None else min(max_steps, stop_after)
            tokens_per_step = gbs * cfg.seq_length
            while step < end:
                t0 = time.time()
                ddp.train()
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                total = 0.0
                for i in range(num_micro):
                    batch = next_batch(batches)
                    # like megatron's schedule: no grad sync until the last micro-batch
                    with (ddp.no_sync() if i < num_micro - 1 else contextlib.nullcontext()):
                        out = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                                  loss_mask=batch["loss_mask"])
                        loss = _loss_from_output(out, batch["loss_mask"]) / num_micro
                        loss.backward()
                    total += float(loss.detach())
                finalize_model_grads([ddp])
                # through NeMo's adapter, as Lightning does: it calls the same
                # optimizer.step(), and the scheduler (which wrapped the adapter's step to
                # track the call order) then sees that the optimizer stepped first -- calling
                # megatron's optimizer directly made torch warn "Detected call of
                # lr_scheduler.step() before optimizer.step()" on every run.
                _, grad_norm, _ = torch_opt.step()
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                step += 1
                if layout.dp * layout.cp > 1:
                    # each rank's total is the mean over its own tokens: average over dp x cp
                    t = torch.tensor([total], dtype=torch.float64)
                    dist.all_reduce(t, group=dp_cp_group)
                    total = float(t[0]) / (layout.dp * layout.cp)
                dt = time.time() - t0
                if not math.isfinite(total):
                    raise FloatingPointError(f"non-finite loss {total} at global step {step}")
                losses.append(total)
                n_vals = ssa_values(ddp)["n"]
                n_history.append([v for _, v in sorted(n_vals.items())])
                if n_vals and layout.tp > 1:
                    from nemo_ssa.megatron.parallel import assert_identical_over_group

                    assert_identical_over_group(torch.tensor([v for _, v in sorted(n_vals.items())]), tp_group,
                                                f"SSA n after step {step}")
                if writer is not None:
                    writer.write(step=step, loss=total, lr=lr, tokens_per_s=tokens_per_step / dt,
                                 grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                                 ssa_n=n_vals)
                if step % log_every == 0 or step == end:
                    n_txt = (" n=" + ",".join(f"{v:.4f}" for _, v in sorted(n_vals.items()))) if n_vals else ""
                    say(f"step {step:5d}/{max_steps} loss {total:.4f} lr {lr:.3e} "
                        f"{tokens_per_step / dt:,.0f} tok/s{n_txt}")
                if (ckpt_every and step % ckpt_every == 0) or (step == end and save_at_end):
                    last_ckpt = save_checkpoint(ckpt_root, step, ddp, optimizer, scheduler, layout)
                _fault_injection("step_end", step)
            if writer is not None:
                writer.close()
            result = CPUTrainResult(
                run_dir=run_dir, steps=step, losses=losses, ssa_n=ssa_values(ddp)["n"],
                checkpoint=last_ckpt, metrics_csv=os.path.join(run_dir, "metrics.csv"),
                elapsed_s=time.time() - t_start,
                extra={"params": n_params, "tokens_per_step": tokens_per_step,
                       "no_weight_decay": no_decay_parameter_names(ddp, optimizer),
                       "layout": layout.describe(), "rank": rank, "n_history": n_history,
                       "distributed_optimizer": bool(ddp.ddp_config.use_distributed_optimizer)},
            )
            from nemo_ssa.metrics_log import rank_layout, write_rank_file

            write_rank_file(run_dir, rank_layout(), step, ssa_values(ddp))  # every rank: its own n and b
            if main:
                with open(os.path.join(run_dir, "cpu_run.json"), "w") as f:
                    json.dump({k: v for k, v in result.__dict__.items()}, f, indent=2, default=str)
            return result
    finally:
        if created:
            teardown_distributed()


def apply_layout_to_config(cfg, layout: ParallelLayout) -> None:
    """Copy the parallel sizes into the model config, as NeMo's strategy does before
    ``configure_model`` (``nemo.lightning._strategy_lib.set_model_parallel_attributes``)."""
    cfg.tensor_model_parallel_size = layout.tp
    cfg.context_parallel_size = layout.cp
    cfg.pipeline_model_parallel_size = layout.pp
    cfg.sequence_parallel = layout.sp
    if hasattr(cfg, "__post_init__"):
        cfg.__post_init__()


def _cp_slice(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's load-balanced context-parallel slicing (what NeMo's data step does)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
    return get_batch_on_this_cp_rank({k: batch.get(k) for k in keys if batch.get(k) is not None})


def _ddp_config(recipe, layout: ParallelLayout):
    """The recipe's DDP settings, minus what gloo/CPU cannot do (``average_in_collective``:
    gloo has no AVG reduce op; pre-scaling by 1/dp then summing is the same arithmetic)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    src = recipe.trainer.strategy.ddp
    get = (lambda k, d: getattr(src, k, d)) if src is not None and not isinstance(src, str) else (lambda k, d: d)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(get("overlap_grad_reduce", False)) and layout.dp * layout.cp > 1,
        use_distributed_optimizer=bool(recipe.optim.config.use_distributed_optimizer),
        overlap_param_gather=False,
        average_in_collective=False,
    )


def wrap_for_training(cfg, model, opt_cfg, ddp_config=None):
    """megatron DDP around ``model`` and ``get_megatron_optimizer`` with our weight-decay
    rule, multipliers folded in (call inside :func:`cpu_device_shims` on CPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_ssa.megatron.compat import get_megatron_optimizer_compat
    from nemo_ssa.megatron.introspect import no_weight_decay_cond

    if ddp_config is None:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False,
                                                   overlap_grad_reduce=False)
    if bool(opt_cfg.use_distributed_optimizer) != bool(ddp_config.use_distributed_optimizer):
        raise ValueError("use_distributed_optimizer must be the same in the optimizer and DDP configs")
    ddp = DistributedDataParallel(cfg, ddp_config, model)
    optimizer = get_megatron_optimizer_compat(opt_cfg, [ddp], no_weight_decay_cond=no_weight_decay_cond)
    from nemo_ssa.megatron.optimizer_fixes import patch_megatron_optimizer

    patch_megatron_optimizer(optimizer)
    _apply_param_group_multipliers(optimizer)
    return ddp, optimizer


def _apply_param_group_multipliers(optimizer) -> None:
    """Fold megatron's ``wd_mult``/``lr_mult`` into each group's weight decay and lr.

    megatron marks groups (wd_mult=0 for biases, norms and SSA's n) and leaves applying
    the multipliers to its own scheduler; NeMo uses a torch scheduler instead and applies
    them once after building the optimizer (``nemo.lightning._strategy_lib.
    setup_megatron_optimizer``). The CPU loop uses NeMo's scheduler too, so it does the
    same, with NeMo's key names, so a group is never multiplied twice.
    """
    for pg in optimizer.param_groups:
        if "pre_lr_mult" in pg or "pre_mult_wd" in pg:
            continue
        pg["pre_mult_lr"], pg["pre_mult_wd"] = pg["lr"], pg["weight_decay"]
        pg["lr"] = pg["lr"] * pg.get("lr_mult", 1.0)
        pg["weight_decay"] = pg["weight_decay"] * pg.get("wd_mult", 1.0)
        if "lr_mult" in pg:
            pg["pre_lr_mult"] = pg.pop("lr_mult")
        if "wd_mult" in pg:
            pg["pre_wd_mult"] = pg.pop("wd_mult")


def no_decay_parameter_names(ddp, optimizer) -> List[str]:
    """Names of the parameters whose optimizer group has weight_decay == 0."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = []
    for pg in optimizer.param_groups:
        if pg["weight_decay"] == 0:
            out.extend(names.get(id(p), "?") for p in pg["params"])
    return sorted(out)


# ------------------------------------------------------------------------- checkpoints
#
# A checkpoint is written to ``step_NNNNNNN.partial/`` by every rank and renamed to
# ``step_NNNNNNN/`` by rank 0 once every rank has finished (a rename within one directory
# is atomic on POSIX file systems). A process killed during a save therefore leaves at
# most a ``.partial`` directory, which resume ignores (and the next save of that step
# replaces): a resume always starts from the newest *complete* checkpoint and loses only
# the steps after it.

_CKPT_PREFIX = "step_"
_PARTIAL = ".partial"


def latest_checkpoint(root: str) -> Optional[str]:
    """Newest complete checkpoint directory under ``root`` (None if there is none)."""
    if not os.path.isdir(root):
        return None
    steps = []
    for d in os.listdir(root):
        if d.startswith(_CKPT_PREFIX) and d[len(_CKPT_PREFIX):].isdigit() \
                and os.path.isfile(os.path.join(root, d, "metadata.json")):
            steps.append(int(d[len(_CKPT_PREFIX):]))
    return os.path.join(root, f"{_CKPT_PREFIX}{max(steps):07d}") if steps else None


def _optimizer_metadata() -> Dict[str, Any]:
    # The distributed optimizer's fully reshardable format: a checkpoint written at one
    # (DP, TP, CP) layout loads at another. The default (dp_reshardable) reshards DP only.
    return {"distrib_optim_sharding_type": "fully_reshardable"}


def _state_template(ddp, optimizer, is_loading: bool) -> Dict[str, Any]:
    model_sd = ddp.module.sharded_state_dict()
    kw = {"is_loading": True} if is_loading else {}
    try:
        opt_sd = optimizer.sharded_state_dict(model_sd, metadata=_optimizer_metadata(), **kw)
    except TypeError:  # an optimizer without the metadata argument
        opt_sd = optimizer.sharded_state_dict(model_sd, **kw)
    return {"model": model_sd, "optimizer": opt_sd}


def _save_strategy():
    """What NeMo's ``MegatronCheckpointIO`` saves with by default (``ckpt_parallel_save=True``):
    torch_dist wrapped in megatron's fully parallel save, which spreads the writing of
    replicated shards over every rank (the multi-rank path numpy 2 broke in megatron 0.15)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist", 1), None, False)


def _load_strategy(path: str):
    """NeMo's default load (``ckpt_parallel_load=True``): each data(-and-context)-parallel
    rank reads part of the checkpoint and the ranks exchange the rest."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def save_checkpoint(root: str, step: int, ddp, optimizer, scheduler, layout: Optional[ParallelLayout] = None) -> str:
    """Collective: every rank calls it. Returns the final (complete) directory."""
    import shutil

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    layout = layout or ParallelLayout(world=dist.get_world_size())
    final = os.path.join(root, f"{_CKPT_PREFIX}{step:07d}")
    partial = final + _PARTIAL
    if dist.get_rank() == 0:
        for stale in (partial, final):  # a killed earlier attempt, or a re-run of this step
            if os.path.isdir(stale):
                shutil.rmtree(stale)
        os.makedirs(partial)
    dist.barrier()
    rngs: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, _rng_to_obj(snapshot_rng()))
    state = _state_template(ddp, optimizer, is_loading=False)
    state.update({
        "step": step,
        "scheduler": scheduler.state_dict(),
        "rng": rngs[0],  # every rank's, below; rank 0's is what another layout restores
        "rng_per_rank": rngs,
        "layout": dataclasses.asdict(layout),
    })
    dist_checkpointing.save(state, partial, _save_strategy())
    _fault_injection("after_save", step)
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(partial, final)
    dist.barrier()
    return final


def _load(path: str, ddp, optimizer, scheduler, layout: Optional[ParallelLayout] = None):
    """Load a checkpoint written at any layout; returns (step, note for the log)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from nemo_ssa.megatron.checkpoints import describe_optimizer, uses_distributed_optimizer

    saved_dist = uses_distributed_optimizer(path)
    ours = bool(ddp.ddp_config.use_distributed_optimizer)
    if saved_dist is not None and saved_dist != ours:
        raise ValueError(f"{path} was written by {describe_optimizer(saved_dist)} and this run uses "
                         f"{describe_optimizer(ours)}; megatron reshards across TP/CP/DP but not between optimizer "
                         f"types: set train.distributed_optimizer={str(saved_dist).lower()} (or auto) to resume it")
    template = _state_template(ddp, optimizer, is_loading=True)
    state = dist_checkpointing.load(template, path, _load_strategy(path))
    ddp.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    saved_layout = state.get("layout")
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_rank = state.get("rng_per_rank")
    note = ""
    if layout is not None and saved_layout is not None and saved_layout != dataclasses.asdict(layout):
        s = ParallelLayout(**saved_layout)
        note = f"; saved at {s.describe()}, resharded to {layout.describe()}"
    if per_rank is not None and not note and rank < len(per_rank):
        restore_rng(_rng_from_obj(per_rank[rank]))
    else:
        restore_rng(_rng_from_obj(state["rng"]))
    return int(state["step"]), note


def _fault_injection(point: str, step: int) -> None:
    """Test hook: ``NEMO_SSA_FAULT=<point>:<step>:<seconds>`` sleeps there (a test then kills
    the process mid-save, or a rank after a step: points ``after_save``, ``step_end``).
    Never set in normal runs."""
    spec = os.environ.get("NEMO_SSA_FAULT")
    if not spec:
        return
    want, want_step, seconds = spec.split(":")
    if want == point and int(want_step) == step:
        print(f"[cpu] fault injection: sleeping {seconds}s at {point} of step {step}", flush=True)
        time.sleep(float(seconds))
