"""Checkpoint save/load of the CPU loop: megatron's dist_checkpointing (torch_dist format)
with the scheduler, every rank's RNG states and the parallel layout, loadable at another layout.

A checkpoint is written to ``step_NNNNNNN.partial/`` by every rank and renamed to
``step_NNNNNNN/`` by rank 0 once every rank has finished (a rename within one directory
is atomic on POSIX file systems). A process killed during a save therefore leaves at
most a ``.partial`` directory, which resume ignores (and the next save of that step
replaces): a resume always starts from the newest *complete* checkpoint and loses only
the steps after it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple

from nemo_ssa.train.faults import fault_injection
from nemo_ssa.train.process import ParallelLayout
from nemo_ssa.train.rng import RNGSnapshot, restore_rng, snapshot_rng, tracker_states_as_tensors

_CKPT_PREFIX = "step_"
_PARTIAL = ".partial"


def latest_checkpoint(root: str) -> Optional[str]:
    """Newest complete checkpoint directory under ``root`` (None if there is none)."""
    found = complete_checkpoints(root)
    return found[0] if found else None


def complete_checkpoints(root: str) -> List[str]:
    """Every complete checkpoint directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    steps = [int(d[len(_CKPT_PREFIX):]) for d in os.listdir(root)
             if d.startswith(_CKPT_PREFIX) and d[len(_CKPT_PREFIX):].isdigit()
             and os.path.isfile(os.path.join(root, d, "metadata.json"))]
    return [os.path.join(root, f"{_CKPT_PREFIX}{s:07d}") for s in sorted(steps, reverse=True)]


def resume_checkpoint(root: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """The newest complete checkpoint under ``root`` that looks loadable, and the newer ones
    skipped with why (``nemo_ssa.megatron.checkpoints.checkpoint_problem``): a damaged
    newest checkpoint costs the steps since the one before it, not the run."""
    from nemo_ssa.megatron.checkpoints import checkpoint_problem

    skipped: List[Tuple[str, str]] = []
    for path in complete_checkpoints(root):
        why = checkpoint_problem(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def _rng_to_obj(snap: RNGSnapshot) -> Dict[str, Any]:
    # megatron's RNG tracker (the generator dropout forks to) is part of the state: without
    # it a resumed run with dropout draws other masks from its first step on.
    # The common state must load under torch.load(weights_only=True) (megatron-core 0.19
    # loads it so), which refuses numpy arrays: numpy's key goes in as a list of ints.
    kind, key, *rest = snap.numpy
    return {"python": snap.python, "numpy": (kind, [int(k) for k in key], *rest), "torch_cpu": snap.torch_cpu,
            "megatron_tracker": tracker_states_as_tensors(snap.megatron_tracker)}


def _rng_from_obj(obj: Dict[str, Any]) -> RNGSnapshot:
    import numpy as np

    kind, key, *rest = obj["numpy"]  # a list of ints, or an array in older checkpoints
    return RNGSnapshot(python=obj["python"], numpy=(kind, np.asarray(key, dtype=np.uint32), *rest), torch_cpu=obj["torch_cpu"],
                       torch_cuda=None, megatron_tracker=obj.get("megatron_tracker"))


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
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from nemo_ssa.megatron.compat import default_save_sharded_strategy

    return FullyParallelSaveStrategyWrapper(default_save_sharded_strategy("torch_dist"), None, False)


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
    fault_injection("after_save", step)
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(partial, final)
    dist.barrier()
    return final


def load_checkpoint(path: str, ddp, optimizer, scheduler, layout: Optional[ParallelLayout] = None):
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
