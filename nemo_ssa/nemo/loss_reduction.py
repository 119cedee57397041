"""NeMo's training-loss reduction without a host read.

NeMo's ``MaskedTokenLossReduction.reduce`` (nemo 2.7) drops the micro batches without valid
tokens with ``if x["loss_sum_and_ub_size"][1] > 0``: a Python ``bool`` of a device tensor per
micro batch, i.e. a drain of the GPU's queue at the end of every step's forward-backward --
with clipping and the gradient check on the device (``nemo_ssa.megatron.sync_free``), the last
read of the step, and the one that keeps the host from running ahead into the next step (a
profile of the recipe's step at micro batch 32: 18 ms a step waited there).

:class:`MaskedTokenLossReductionNoSync` is that class with the filter on the device: each
micro batch's ``[loss_sum, tokens]`` row is replaced by zeros where its token count is not
positive (so a NaN ``loss_sum`` of an empty micro batch is dropped, as NeMo drops it), the rows
summed, reduced over the data-parallel group and divided as NeMo does. Where every micro
batch has tokens (every step of the recipe) the rows summed are NeMo's rows: the same loss bit
for bit; where one is empty, a zero row takes its place (``x + 0 == x``). The legacy ``avg``
path and the validation reduction are NeMo's. :func:`install` puts it on a NeMo model whose
training reduction would be NeMo's own class (``SyncFreeLossReductionCallback`` calls it).
"""

from __future__ import annotations

import torch
from nemo.lightning.megatron_parallel import MaskedTokenLossReduction


class MaskedTokenLossReductionNoSync(MaskedTokenLossReduction):
    """``MaskedTokenLossReduction`` whose ``reduce`` reads nothing to the host."""

    def reduce(self, losses_reduced_per_micro_batch) -> torch.Tensor:
        if not losses_reduced_per_micro_batch or "avg" in losses_reduced_per_micro_batch[0]:
            return super().reduce(losses_reduced_per_micro_batch)
        from megatron.core import parallel_state

        rows = torch.vstack([x["loss_sum_and_ub_size"] for x in losses_reduced_per_micro_batch])
        rows = torch.where(rows[:, 1:2] > 0, rows, torch.zeros_like(rows))
        loss = rows.sum(dim=0) if rows.shape[0] > 1 else rows[0].clone()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return loss[0] / loss[1]


def install(pl_module) -> bool:
    """Give ``pl_module`` the reduction above where its training reduction would be NeMo's
    ``MaskedTokenLossReduction`` (a model with its own reduction keeps it). Returns whether it did."""
    if not hasattr(pl_module, "_training_loss_reduction"):
        return False
    current = pl_module._training_loss_reduction
    if current is None:
        made = pl_module.training_loss_reduction  # what the model would use (NeMo builds it lazily)
        if type(made) is not MaskedTokenLossReduction:
            return isinstance(made, MaskedTokenLossReductionNoSync)
    elif type(current) is not MaskedTokenLossReduction:
        return isinstance(current, MaskedTokenLossReductionNoSync)
    pl_module._training_loss_reduction = MaskedTokenLossReductionNoSync()
    return True
