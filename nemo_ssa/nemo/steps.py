"""Data and forward steps for NeMo's GPT model when the core attention applies causality.

NeMo's ``gpt_forward_step`` asserts an attention mask whenever Transformer Engine is
absent, and its ``MockDataModule`` never builds one. Our core attentions apply the
causal mask inside the op, so no mask tensor is needed (building one would cost
b·s² bytes per step for nothing). These mirror NeMo's steps otherwise.
"""

from __future__ import annotations

from typing import Dict

import torch


def _to_device(t: torch.Tensor) -> torch.Tensor:
    if torch.cuda.is_available():
        return t.cuda(non_blocking=True)
    return t


def data_step(dataloader_iter, use_mtp: bool = False) -> Dict[str, torch.Tensor]:
    """Next batch with tokens, labels, loss_mask, position_ids on the device.

    Unlike NeMo's ``gpt_data_step`` the attention mask is optional (kept when present).
    Packed (THD) batches are rejected: our core attentions do not support them yet. Under
    context parallel the batch is sliced for this rank like NeMo's (megatron's
    ``get_batch_on_this_cp_rank``).
    """
    from megatron.core import parallel_state

    batch = next(dataloader_iter)
    if isinstance(batch, tuple) and len(batch) == 3:
        batch = batch[0]
    if "cu_seqlens" in batch:
        raise NotImplementedError(
            "nemo_ssa core attentions do not support packed (THD) sequences yet; "
            "disable sequence packing in the data module."
        )
    keys = set()
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        keys.add("attention_mask")
    if parallel_state.is_pipeline_first_stage() or use_mtp:
        keys.update(("tokens", "position_ids"))
    if parallel_state.is_pipeline_last_stage():
        keys.update(("labels", "loss_mask"))
    out = {k: (_to_device(v) if k in keys else None) for k, v in batch.items() if k in keys}
    # context parallel: this rank's two load-balanced chunks of every sequence, as NeMo's
    # gpt_data_step does (the core attention gathers K/V and expects exactly these chunks;
    # without the slice every CP rank trained on whole sequences under chunk positions)
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(out)


def forward_step(model, batch, fused_cross_entropy="auto") -> torch.Tensor:
    """Forward without requiring an attention mask (our attention is causal by type).

    ``fused_cross_entropy`` (``auto`` = on with CUDA, ``true``, ``false``; the recipe binds
    it from ``model.fused_cross_entropy``): on the first call the fused output layer + LM
    cross-entropy replaces megatron's (``nemo_ssa.megatron.output_layer``; TP = 1 only); every
    call hands it the batch's loss mask, the row weight of its in-forward weight gradient."""
    from nemo_ssa.megatron.output_layer import ensure_installed, set_loss_mask

    ensure_installed(model, fused_cross_entropy)
    set_loss_mask(model, batch.get("loss_mask"))
    args = {
        "input_ids": batch["tokens"],
        "position_ids": batch["position_ids"],
        "labels": batch["labels"],
    }
    if batch.get("attention_mask") is not None:
        args["attention_mask"] = batch["attention_mask"]
    return model(**args)
