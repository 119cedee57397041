"""The fused LM cross-entropy (``nemo_ssa.ops.cross_entropy``) in megatron-core's GPT model.

megatron's ``GPTModel._postprocess`` computes the logits with its output layer (the tied
embedding) and then ``self.compute_language_model_loss(labels, logits)``. The plugin
replaces only that second call, per model instance, when the model has one
tensor-parallel rank (the vocabulary is not split, so the loss needs no all-reduce over
vocabulary shards); with tensor parallel > 1 megatron's vocab-parallel loss stays.
Inference (no labels) never reaches the loss. The per-token ``[b, s]`` loss contract is
unchanged, so NeMo's loss mask and reduction apply as before.

Chosen by config: ``model.fused_cross_entropy`` (``auto`` = on with CUDA, ``true``,
``false``), bound by the recipe into ``nemo_ssa.nemo.steps.forward_step``.
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)


def _fused_loss(self, labels, logits):
    from nemo_ssa.ops.cross_entropy import lm_cross_entropy

    return lm_cross_entropy(logits, labels)


def _gpt_models(model: torch.nn.Module):
    from megatron.core.models.gpt import GPTModel

    return [m for m in model.modules() if isinstance(m, GPTModel)]


def _wanted(value) -> bool:
    if value in ("auto", None):
        return torch.cuda.is_available()
    if isinstance(value, str):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"fused_cross_entropy={value!r}; supported: auto, true, false")
        return value.lower() == "true"
    return bool(value)


def install_fused_cross_entropy(model: torch.nn.Module, fused_cross_entropy="auto") -> int:
    """Install the fused loss on every megatron GPTModel inside ``model`` with one TP rank
    when ``fused_cross_entropy`` asks for it; returns how many were installed."""
    if not _wanted(fused_cross_entropy):
        return 0
    done = 0
    for m in _gpt_models(model):
        if int(getattr(m.config, "tensor_model_parallel_size", 1) or 1) > 1:
            log.info("fused cross-entropy off: tensor parallel > 1 keeps megatron's vocab-parallel loss")
            continue
        m.compute_language_model_loss = types.MethodType(_fused_loss, m)
        done += 1
    return done


def ensure_installed(model: torch.nn.Module, fused_cross_entropy="auto") -> None:
    """Once per model object (cheap to call every step)."""
    if getattr(model, "_nemo_ssa_ce_checked", False):
        return
    install_fused_cross_entropy(model, fused_cross_entropy)
    try:
        model._nemo_ssa_ce_checked = True
    except Exception:  # noqa: BLE001 - a module that refuses attributes just re-checks
        pass
