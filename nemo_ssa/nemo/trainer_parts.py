"""The pieces of NeMo's trainer that the CPU loop (:mod:`nemo_ssa.train.loop`) reuses, kept
here because only ``nemo_ssa/nemo`` imports nemo: the pretraining sampler's batch order and
the optimizer adapter Lightning steps through."""

from __future__ import annotations

import torch
from nemo.core.optim.mcore_optim import McoreDistributedOptimizer


def pretraining_batches(dataset, micro_batch_size: int, global_batch_size: int, consumed_samples: int,
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


def lightning_optimizer(optimizer):
    """NeMo's torch-optimizer adapter around a megatron optimizer (what its LR scheduler wraps)."""
    return McoreDistributedOptimizer(optimizer)
