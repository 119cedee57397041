"""Process setup of a training run: the gloo process group, megatron's parallel state and
the parallel layout (tensor / context / sequence / pipeline sizes, data parallel filling the world).
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


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


def init_distributed(seed: int, layout: Optional[ParallelLayout] = None) -> bool:
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


def apply_layout_to_config(cfg, layout: ParallelLayout) -> None:
    """Copy the parallel sizes into the model config, as NeMo's strategy does before
    ``configure_model`` (``nemo.lightning._strategy_lib.set_model_parallel_attributes``)."""
    cfg.tensor_model_parallel_size = layout.tp
    cfg.context_parallel_size = layout.cp
    cfg.pipeline_model_parallel_size = layout.pp
    cfg.sequence_parallel = layout.sp
    if hasattr(cfg, "__post_init__"):
        cfg.__post_init__()
