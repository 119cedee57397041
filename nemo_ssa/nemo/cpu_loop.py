"""Train the recipe's model on a CPU-only machine with megatron-core's own components.

NeMo's trainer cannot run without CUDA (its MegatronStrategy creates CUDA streams,
megatron's schedules place tensors on ``cuda``), but megatron-core's GPTModel trains on
CPU. This loop takes the *same* NeMo recipe — model config (our spec inside), data
module, optimizer config and LR schedule — shrinks the dimensions, and runs:

- ``torch.distributed`` over gloo, world size 1, megatron's parallel state;
- the model from ``GPTConfig.configure_model`` wrapped in megatron's DDP;
- ``get_megatron_optimizer`` with our ``no_weight_decay_cond`` (SSA's n exempt);
- NeMo's own LR scheduler (``recipe.optim.lr_scheduler``) through NeMo's optimizer adapter;
- batches from the recipe's ``PreTrainingDataModule`` in megatron's pretraining sampler
  order (what NeMo's trainer would feed);
- ``dist_checkpointing`` (torch_dist format) for save/resume, with the RNG states and
  the data position in the checkpoint so a resumed run continues the same curve;
- the same logs as the GPU path: TensorBoard (``reduced_train_loss``, ``lr``,
  ``ssa/n/layer_XX``) and ``metrics.csv``.

It says which path it took, and is sized for minutes on 2 cores.
"""

from __future__ import annotations

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
    recipe.optim.config.use_distributed_optimizer = False
    # No validation/test in the CPU loop: tiny corpora would give empty splits, on which
    # megatron's GPTDataset epoch count never terminates.
    if hasattr(recipe.data, "split"):
        recipe.data.split = "100,0,0"
    if hasattr(recipe.data, "num_workers"):
        recipe.data.num_workers = 0
    if hasattr(recipe.data, "pin_memory"):
        recipe.data.pin_memory = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(seed: int) -> bool:
    """Gloo world of 1 + megatron parallel state; seeds every RNG. True if it created them."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    created = False
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    # CPU: no CUDA generators to seed; megatron's inference tracker forks nothing, so
    # dropout draws from torch's CPU generator (seeded below).
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


def _batches(dataset, micro_batch_size: int, global_batch_size: int, consumed_samples: int):
    """Micro-batches in megatron's pretraining-sampler order (data parallel size 1)."""
    from nemo.lightning.data import MegatronPretrainingSampler

    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        data_parallel_rank=0,
        data_parallel_size=1,
        drop_last=True,
    )
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0,
                                         collate_fn=getattr(dataset, "collate_fn", None))
    return iter(loader)


def _loss_from_output(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp_min(1.0)


def _rng_to_obj(snap: RNGSnapshot) -> Dict[str, Any]:
    return {"python": snap.python, "numpy": snap.numpy, "torch_cpu": snap.torch_cpu}


def _rng_from_obj(obj: Dict[str, Any]) -> RNGSnapshot:
    return RNGSnapshot(python=obj["python"], numpy=obj["numpy"], torch_cpu=obj["torch_cpu"],
                       torch_cuda=None, megatron_tracker=None)


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

    Args:
        recipe: a ``run.Partial`` from ``recipes.nemotron_114m.pretrain_recipe``.
        run_dir: where logs and checkpoints go.
        max_steps: optimizer steps of the full schedule (LR schedule length).
        log_every: print every N steps (CSV/TensorBoard get every step).
        ckpt_every: save a checkpoint every N steps (and at the end) when set.
        resume: continue from the newest checkpoint in ``run_dir/checkpoints``.
        warmup: warm the core attentions up before step 0.
        warmup_restores_rng: restore every RNG after warm-up (False only for the
            negative-control test).
        seed: overrides the data module's seed for initialisation.
        stop_after: stop after this global step (simulates an interruption); the
            schedule still spans ``max_steps``.
        save_at_end: checkpoint at the last step run (False with ``stop_after`` simulates a
            crash: the resume restarts from the previous periodic checkpoint).
        quiet: print less.
    """
    import fiddle as fdl
    from nemo.core.optim.mcore_optim import McoreDistributedOptimizer

    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.megatron.introspect import ssa_values

    t_start = time.time()
    seed = int(seed if seed is not None else getattr(recipe.data, "seed", 1234))
    os.makedirs(run_dir, exist_ok=True)
    ckpt_root = os.path.join(run_dir, "checkpoints")
    say = (lambda *a: None) if quiet else (lambda *a: print("[cpu]", *a, flush=True))
    say(f"path: megatron-core CPU loop (no CUDA here: NeMo's trainer needs a GPU); run dir {run_dir}")

    created = _init_distributed(seed)
    try:
        with cpu_device_shims():
            cfg = fdl.build(recipe.model.config)
            datamodule = fdl.build(recipe.data)
            tokenizer = getattr(datamodule, "tokenizer", None)
            model = cfg.configure_model(tokenizer)
            n_params = sum(p.numel() for p in model.parameters())
            say(f"model: {cfg.num_layers}L h{cfg.hidden_size} heads {cfg.num_attention_heads}/"
                f"{cfg.num_query_groups} ffn {cfg.ffn_hidden_size} seq {cfg.seq_length}: {n_params:,} params")
            ddp, optimizer = wrap_for_training(cfg, model, fdl.build(recipe.optim.config))
            torch_opt = McoreDistributedOptimizer(optimizer)
            sched_module = fdl.build(recipe.optim.lr_scheduler)
            sched_module.max_steps = max_steps
            scheduler = sched_module.scheduler(ddp, torch_opt)["lr_scheduler"]["scheduler"]

            mbs = datamodule.micro_batch_size
            gbs = datamodule.global_batch_size
            if gbs % mbs:
                raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size={mbs}")
            num_micro = gbs // mbs
            datamodule.build(trainer_max_steps=max_steps, trainer_val_check_interval=max_steps,
                             trainer_limit_val_batches=0, trainer_limit_test_batches=0)
            dataset = datamodule._train_ds

            step = 0
            if resume:
                latest = _latest_checkpoint(ckpt_root)
                if latest is None:
                    say("resume: no checkpoint found, starting from step 0")
                else:
                    step = _load(latest, ddp, optimizer, scheduler)
                    say(f"resume: loaded {latest} (global step {step})")

            batches = _batches(dataset, mbs, gbs, consumed_samples=step * gbs)
            writer = MetricsWriter(run_dir, append=resume and step > 0)

            if warmup and step == 0:
                # inside the block: creating a DataLoader iterator draws its base seed
                # from torch's generator, so even the peek at the batch shape counts
                with preserved_rng(warmup_restores_rng):
                    peek = _batches(dataset, mbs, gbs, consumed_samples=0)
                    warmed = warmup_attention(ddp, next(peek))
                say(f"warm-up: {warmed} attention type(s), RNG "
                    f"{'restored' if warmup_restores_rng else 'NOT restored (negative control)'}")

            losses: List[float] = []
            last_ckpt = None
            end = max_steps if stop_after is None else min(max_steps, stop_after)
            tokens_per_step = gbs * cfg.seq_length
            while step < end:
                t0 = time.time()
                ddp.train()
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                total = 0.0
                for _ in range(num_micro):
                    batch = next(batches)
                    out = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                    loss = _loss_from_output(out, batch["loss_mask"]) / num_micro
                    loss.backward()
                    total += float(loss.detach())
                ddp.finish_grad_sync()
                ok, grad_norm, _ = optimizer.step()
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                step += 1
                dt = time.time() - t0
                if not math.isfinite(total):
                    raise FloatingPointError(f"non-finite loss {total} at global step {step}")
                losses.append(total)
                n_vals = ssa_values(ddp)["n"]
                writer.write(step=step, loss=total, lr=lr, tokens_per_s=tokens_per_step / dt,
                             grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                             ssa_n=n_vals)
                if step % log_every == 0 or step == end:
                    n_txt = (" n=" + ",".join(f"{v:.4f}" for _, v in sorted(n_vals.items()))) if n_vals else ""
                    say(f"step {step:5d}/{max_steps} loss {total:.4f} lr {lr:.3e} "
                        f"{tokens_per_step / dt:,.0f} tok/s{n_txt}")
                if (ckpt_every and step % ckpt_every == 0) or (step == end and save_at_end):
                    last_ckpt = _save(ckpt_root, step, ddp, optimizer, scheduler)
            writer.close()
            result = CPUTrainResult(
                run_dir=run_dir, steps=step, losses=losses, ssa_n=ssa_values(ddp)["n"],
                checkpoint=last_ckpt, metrics_csv=writer.csv_path, elapsed_s=time.time() - t_start,
                extra={"params": n_params, "tokens_per_step": tokens_per_step,
                       "no_weight_decay": no_decay_parameter_names(ddp, optimizer)},
            )
            with open(os.path.join(run_dir, "cpu_run.json"), "w") as f:
                json.dump({k: v for k, v in result.__dict__.items()}, f, indent=2, default=str)
            return result
    finally:
        if created:
            teardown_distributed()


def wrap_for_training(cfg, model, opt_cfg):
    """megatron DDP around ``model`` and ``get_megatron_optimizer`` with our weight-decay
    rule, multipliers folded in (call inside :func:`cpu_device_shims` on CPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from nemo_ssa.megatron.introspect import no_weight_decay_cond

    ddp = DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False,
                                      overlap_grad_reduce=False),
        model,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], no_weight_decay_cond=no_weight_decay_cond)
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


def _latest_checkpoint(root: str) -> Optional[str]:
    if not os.path.isdir(root):
        return None
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_"))
    return os.path.join(root, f"step_{steps[-1]:07d}") if steps else None


def _save(root: str, step: int, ddp, optimizer, scheduler) -> str:
    from megatron.core import dist_checkpointing

    path = os.path.join(root, f"step_{step:07d}")
    os.makedirs(path, exist_ok=True)
    model_sd = ddp.module.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd),
        "step": step,
        "scheduler": scheduler.state_dict(),
        "rng": _rng_to_obj(snapshot_rng()),
    }
    dist_checkpointing.save(state, path)
    return path


def _load(path: str, ddp, optimizer, scheduler) -> int:
    from megatron.core import dist_checkpointing

    model_sd = ddp.module.sharded_state_dict()
    template = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    state = dist_checkpointing.load(template, path)
    ddp.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(_rng_from_obj(state["rng"]))
    return int(state["step"])
