"""The fused output layer + LM cross-entropy (``nemo_ssa.ops.cross_entropy``) in megatron-core's GPT model.

megatron's ``GPTModel._postprocess`` computes the logits with its output layer (the tied
embedding) and then ``self.compute_language_model_loss(labels, logits)``: bf16 logits of
``[tokens, vocab]``, upcast to fp32, with the fp32 softmax kept for the backward. The plugin
replaces, per model instance with one tensor-parallel rank (the vocabulary is not split):

* ``_postprocess`` when labels are given (training and validation loss): the chunked
  ``linear_cross_entropy`` on the final hidden states and the output weight (the embedding
  when tied, so its gradient flows into the embedding), the gradients computed in the
  forward per chunk of tokens; no whole-batch logits. The loss mask (``loss_mask`` of
  megatron's forward, or the one ``forward_step`` hands over, :func:`set_loss_mask`) is the
  row weight of the weight gradient; the per-token ``[b, s]`` fp32 loss contract is
  unchanged, NeMo applies the mask and reduction afterwards as before;
* ``compute_language_model_loss``: the compiled loss on megatron's logits
  (``lm_cross_entropy``), for the cases that keep megatron's ``_postprocess``.

megatron's ``_postprocess`` stays for everything else: no labels (inference / logits),
inference contexts, multi-token prediction, the config logger, an output layer with its
own forward pre-hooks (untied weight under overlapped parameter gathering; the profiler
ranges of ``tools.step_profile.module_ranges`` excepted: the fused loss opens them itself).

Chosen by config: ``model.fused_cross_entropy`` -- ``auto`` (on with CUDA and TP 1),
``true`` (on; tensor parallel > 1 is refused), ``false`` (megatron's path); bound by the
recipe into ``nemo_ssa.nemo.steps.forward_step``. docs/fused-layers.md. A/B switch for
timing: ``NEMO_SSA_CE_PATH=loss`` keeps megatron's output layer and fuses the loss alone.
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, List, Optional

import torch

log = logging.getLogger(__name__)

SUPPORTED = "auto, true, false"


def chunk_size() -> int:
    """Tokens per chunk of the fused path (``NEMO_SSA_CE_CHUNK``, default the op's)."""
    from nemo_ssa.ops.common import env
    from nemo_ssa.ops.cross_entropy.chunked import DEFAULT_CHUNK

    return env.ce_chunk() or DEFAULT_CHUNK


def _fused_loss(self, labels, logits):
    from nemo_ssa.ops.cross_entropy import lm_cross_entropy

    return lm_cross_entropy(logits, labels)


def _stock_reason(self, labels, kwargs) -> Optional[str]:
    """Why this call keeps megatron's ``_postprocess`` (None: the fused path runs)."""
    from megatron.core.config_logger import has_config_logger_enabled

    from nemo_ssa.ops.common import env

    if labels is None:
        return "no labels"
    if env.ce_path() == "loss":
        return "NEMO_SSA_CE_PATH=loss (megatron's output layer, the compiled loss alone)"
    if not self.post_process:
        return "not the last pipeline stage"
    if self.mtp_process or kwargs.get("mtp_in_postprocess"):
        return "multi-token prediction"
    if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
        return "inference context"
    if has_config_logger_enabled(self.config):
        return "config logger (wants the logits)"
    if getattr(self.output_layer, "sequence_parallel", False):
        return "sequence parallel output layer"
    if any(not _profile_range(h) for h in self.output_layer._forward_pre_hooks.values()):
        return "output layer forward pre-hooks"
    return None


def _profile_range(hook) -> Optional[str]:
    """The profiler range a ``step_profile.module_ranges`` hook opens (None: another hook).
    Such hooks only name the module's time in a profile: they must not switch the loss to
    megatron's path, or the profile would measure another step than the one trained."""
    return getattr(hook, "profile_range", None)


def _fused_postprocess(self, hidden_states=None, input_ids=None, position_ids=None, labels=None,
                       *args: Any, **kwargs: Any):
    pending = self.__dict__.pop("_nemo_ssa_loss_mask", None)
    if args or _stock_reason(self, labels, kwargs) is not None:
        return type(self)._postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs)
    from nemo_ssa.ops.cross_entropy import linear_cross_entropy

    if self.share_embeddings_and_output_weights:
        weight = self.shared_embedding_or_output_weight()
    else:
        weight = self.output_layer.weight
    s, b, h = hidden_states.shape
    mask = kwargs.get("loss_mask")
    if mask is None:
        mask = pending
    row_weight = None
    if mask is not None:
        if tuple(mask.shape) != (b, s):
            raise ValueError(f"fused cross-entropy: loss_mask {tuple(mask.shape)} does not match labels "
                             f"{tuple(labels.shape)}")
        row_weight = mask.transpose(0, 1).reshape(-1)
    x = hidden_states.reshape(s * b, h)
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    ranges = [r for h in self.output_layer._forward_pre_hooks.values() if (r := _profile_range(h))]
    with torch.autograd.profiler.record_function(ranges[0]) if ranges else contextlib.nullcontext():
        loss = linear_cross_entropy(x, weight, labels.transpose(0, 1).reshape(-1), row_weight=row_weight,
                                    chunk_size=chunk_size())
    # [s*b] -> [b, s], contiguous as megatron returns it (NeMo's masked_token_loss .view()s it)
    return loss.view(s, b).transpose(0, 1).contiguous()


def _gpt_models(model: torch.nn.Module) -> List[torch.nn.Module]:
    from megatron.core.models.gpt import GPTModel

    return [m for m in model.modules() if isinstance(m, GPTModel)]


def _wanted(value) -> Optional[bool]:
    """True / False, or None for ``auto``."""
    if value in ("auto", None):
        return None
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "auto"):
            raise ValueError(f"fused_cross_entropy={value!r}; supported: {SUPPORTED}")
        return None if value.lower() == "auto" else value.lower() == "true"
    return bool(value)


def check_fused_cross_entropy(value, tensor_parallel: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse ``fused_cross_entropy=true`` where it is not supported (called when the recipe is
    built): one line naming what is supported."""
    if _wanted(value) and (int(tensor_parallel) > 1 or sequence_parallel):
        raise ValueError(
            f"fused_cross_entropy=true needs tensor_parallel=1 (got {int(tensor_parallel)}"
            f"{', sequence_parallel' if sequence_parallel else ''}): the fused loss does not split the "
            f"vocabulary; set model.fused_cross_entropy=auto or false (megatron's vocab-parallel loss)")


def install_fused_cross_entropy(model: torch.nn.Module, fused_cross_entropy="auto") -> int:
    """Install the fused output layer + loss on every megatron GPTModel inside ``model`` with one
    TP rank when ``fused_cross_entropy`` asks for it; returns how many were installed.

    Raises:
        ValueError: an unknown value, or ``true`` on a model with tensor parallel > 1.
    """
    wanted = _wanted(fused_cross_entropy)
    if wanted is None:
        wanted = torch.cuda.is_available()
    if not wanted:
        return 0
    done = 0
    for m in _gpt_models(model):
        tp = int(getattr(m.config, "tensor_model_parallel_size", 1) or 1)
        if tp > 1 or getattr(m.config, "sequence_parallel", False):
            if _wanted(fused_cross_entropy):
                check_fused_cross_entropy(True, tp, bool(getattr(m.config, "sequence_parallel", False)))
            log.info("fused cross-entropy off: tensor parallel > 1 keeps megatron's vocab-parallel loss")
            continue
        m.compute_language_model_loss = types.MethodType(_fused_loss, m)
        m._postprocess = types.MethodType(_fused_postprocess, m)
        done += 1
    if done:
        log.info("fused output layer + cross-entropy on %d GPT model(s), chunk %d tokens", done, chunk_size())
    return done


def set_loss_mask(model: torch.nn.Module, loss_mask: Optional[torch.Tensor]) -> None:
    """Hand the micro-batch's loss mask to the fused path of the GPT models under ``model``
    (NeMo's GPT forward does not pass ``loss_mask`` on); consumed by the next forward."""
    for m in getattr(model, "_nemo_ssa_ce_models", ()):
        m.__dict__["_nemo_ssa_loss_mask"] = loss_mask


def ensure_installed(model: torch.nn.Module, fused_cross_entropy="auto") -> None:
    """Once per model object (cheap to call every step)."""
    if getattr(model, "_nemo_ssa_ce_checked", False):
        return
    install_fused_cross_entropy(model, fused_cross_entropy)
    try:
        model._nemo_ssa_ce_models = tuple(m for m in _gpt_models(model) if "_postprocess" in vars(m))
        model._nemo_ssa_ce_checked = True
    except Exception:  # noqa: BLE001 - a module that refuses attributes just re-checks
        pass
