"""Shrink a NeMo pretrain recipe for the CPU loop: tiny dimensions, fp32, CPU init, no fused
CUDA paths (and the bf16 variant the mixed-precision tests use)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

#: dimensions the CPU path shrinks the 114M model to (same architecture family)
TINY_ARCH = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
)


#: train / validation / test percentages when the CPU loop evaluates a held-out loss
HELDOUT_SPLIT = "90,10,0"


def shrink_for_cpu(recipe, arch: Optional[Dict[str, Any]] = None, seq_length: Optional[int] = None,
                   micro_batch_size: Optional[int] = None, global_batch_size: Optional[int] = None,
                   heldout: bool = False) -> None:
    """Shrink a recipe in place for the CPU loop (fp32, CPU init, no fused CUDA paths).

    ``heldout``: keep a validation split (``HELDOUT_SPLIT``) for the loop's held-out loss;
    off, every document trains (tiny corpora would give an empty validation split)."""
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
    # No validation/test split unless asked for: tiny corpora would give empty splits, on
    # which megatron's GPTDataset epoch count never terminates.
    if hasattr(recipe.data, "split"):
        recipe.data.split = HELDOUT_SPLIT if heldout else "100,0,0"
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
