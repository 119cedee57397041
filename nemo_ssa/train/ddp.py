"""megatron's DDP and optimizer around a model, with the project's weight-decay rule and
the learning-rate / weight-decay multipliers folded in as NeMo does."""

from __future__ import annotations

from typing import List

from nemo_ssa.train.process import ParallelLayout


def ddp_config_for(recipe, layout: ParallelLayout):
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
