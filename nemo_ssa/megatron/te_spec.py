"""Our core attention in megatron-core's Transformer Engine GPT layer.

:func:`te_layer_spec` takes megatron's ``get_gpt_layer_with_transformer_engine_spec()`` and
puts our core attention -- the attention table's module, under the same SSA policy and
options as :func:`nemo_ssa.megatron.spec.layer_spec` -- into its one
``self_attention.submodules.core_attention`` slot. Nothing else of megatron's layer changes.

What differs from the local spec (``spec.layer_spec``):

- **LayerNorms are TE's, fused into the linears**: the input LayerNorm into ``linear_qkv``
  (``TELayerNormColumnParallelLinear``), the pre-MLP one into the MLP's ``linear_fc1``;
  ``input_layernorm`` / ``pre_mlp_layernorm`` are ``IdentityOp`` and megatron's block adds
  ``TENorm`` as the final norm. TE implements zero-centred gamma
  (``layernorm_zero_centered_gamma``) and sequence parallel itself, so LayerNorm1P is not
  used. Parameter names differ (``self_attention.linear_qkv.layer_norm_weight`` against
  ``input_layernorm.weight``): a checkpoint of one spec does not load into the other. SSA's
  ``n``/``b`` sit where they do in the local spec (``self_attention.core_attention``).
- **The MLP is megatron's TE MLP**: no ``FusedReLU2MLP`` (its slot belongs to TE here).
- **RoPE stays in megatron's SelfAttention**: no ``FusedRopeSelfAttention``, so
  ``fused_rope_layout=true`` is refused and the core attention is built with it off.
- **Context parallel and packed THD are ours, not TE's.** In megatron's TE spec,
  ``TEDotProductAttention`` handles both (TE's CP schedules chosen by ``cp_comm_type``,
  THD through its varlen kernels). With our core attention in the slot they are handled by
  it, with its limits (nemo_ssa/megatron/core_attention.py, parallel.py): context parallel
  for causal / no_mask only, always all-gathering K/V whatever ``cp_comm_type`` says (the
  same result, another communication pattern); packed THD only for attentions with a varlen
  op and never with CP > 1; no ``attention_bias``; self attention only. Each refusal names
  what is supported, at construction where the config tells, else at the first forward.
- **FP8**: TE's linears may run in FP8 under its autocast; the attention itself does not, so
  ``fp8_dot_product_attention`` and ``fp8_multi_head_attention`` are refused.
- **NSA** (``nsa``, ``nsa_ssa``) replaces the whole self attention and reads the layer input
  before the QKV projection, which the fused LayerNorm + QKV linear does not hand it:
  refused (the local spec has it).

Where it can be built: only where megatron-core imported Transformer Engine. Elsewhere
:func:`te_layer_spec` raises ``ImportError`` naming what is missing and the TE-free spec.
This module imports no Transformer Engine itself; megatron's spec module tries at its own
import, and :func:`te_missing` reads the outcome.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Dict, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_ssa.config.attentions import ATTENTIONS
from nemo_ssa.megatron.spec import CORE_ATTENTIONS, check_layer_config, core_attention_spec, resolve_here

__all__ = ["te_missing", "te_layer_spec", "with_our_core_attention"]

#: TransformerConfig fields that ask TE's attention for FP8, which ours does not do
_FP8_ATTENTION_FIELDS = ("fp8_dot_product_attention", "fp8_multi_head_attention")


def te_missing() -> Optional[str]:
    """Why megatron's Transformer Engine layer spec cannot be built here (None where it can).

    Decided from megatron's own flag (``gpt_layer_specs.HAVE_TE``): its TE spec builder
    needs the classes that flag guards, whatever else is installed."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    import megatron.core.models.gpt.gpt_layer_specs as specs

    if not getattr(specs, "HAVE_TE", False):
        return ("transformer_engine is installed but megatron-core could not import it "
                "(megatron.core.models.gpt.gpt_layer_specs.HAVE_TE is False: a TE build for another torch/CUDA?)")
    return None


def with_our_core_attention(layer: ModuleSpec, attention: str = "softmax",
                            attention_options: Optional[Dict[str, Any]] = None,
                            policy: str = "pinned") -> ModuleSpec:
    """A copy of ``layer`` -- one GPT layer ``ModuleSpec`` whose self attention has a
    ``core_attention`` slot -- with our named core attention in that slot and nothing else
    changed (``layer`` itself is left as it was).

    Args:
        layer: megatron's layer spec (the TE one in :func:`te_layer_spec`).
        attention: ``attention=<name>`` as users write it (``ssa`` is resolved by the policy
            for this machine, as in ``spec.layer_spec``).
        attention_options: the attention's options, as for ``spec.layer_spec``.
        policy: ``pinned`` or ``free``.

    Returns:
        The new layer ``ModuleSpec``.

    Raises:
        ValueError: an unknown attention or option (the message lists the known ones).
        NotImplementedError: an NSA attention, or ``fused_rope_layout=true``.
        TypeError: ``layer`` has no ``self_attention.submodules.core_attention`` slot.
    """
    resolved = resolve_here(attention, attention_options, policy)
    name, options = resolved.name, dict(resolved.options)
    if ATTENTIONS[name].family == "nsa":
        raise NotImplementedError(
            f"attention={name}: NSA replaces the whole self attention and reads the layer input before the "
            "QKV projection, which the TE spec's fused LayerNorm + linear_qkv does not hand it; supported in the "
            f"TE spec: {sorted(CORE_ATTENTIONS)}. NSA runs in the local spec (nemo_ssa.megatron.spec.layer_spec).")
    if options.get("fused_rope_layout"):
        raise NotImplementedError(
            f"attention={name}: fused_rope_layout=true needs FusedRopeSelfAttention, which the TE spec does not "
            "use (megatron's SelfAttention applies RoPE there); set fused_rope_layout=false or null, or use the "
            "local spec (nemo_ssa.megatron.spec.layer_spec).")
    if CORE_ATTENTIONS[name].supports_fused_rope_layout:
        # off, stated: the module's flag then says what runs (megatron's RoPE)
        options["fused_rope_layout"] = False
    attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
    if not hasattr(getattr(attn, "submodules", None), "core_attention"):
        raise TypeError(f"layer spec {layer!r} has no self_attention.submodules.core_attention slot; supported: "
                        "a GPT layer ModuleSpec with SelfAttention (megatron's TE or local layer spec)")
    layer = copy.deepcopy(layer)
    layer.submodules.self_attention.submodules.core_attention = core_attention_spec(name, options)
    return layer


def te_layer_spec(config, attention: str = "softmax", attention_options: Optional[Dict[str, Any]] = None,
                  policy: str = "pinned") -> ModuleSpec:
    """megatron-core's Transformer Engine GPT layer spec with our core attention (module
    docstring: what changes against the local spec, what is refused).

    Returns one layer's ``ModuleSpec``, as megatron's TE builder does: ``GPTModel`` repeats
    it for the layers of its pipeline stage (``vp_stage`` included) and adds ``TENorm`` as
    the final norm.

    Args:
        config: the ``TransformerConfig`` being built (checked as ``spec.layer_spec`` checks
            it, plus the FP8-attention fields).
        attention: ``attention=<name>`` as users write it.
        attention_options: the attention's options, as for ``spec.layer_spec``.
        policy: ``pinned`` or ``free``.

    Raises:
        ImportError: Transformer Engine is not usable here (:func:`te_missing` says why).
        NotImplementedError: a config or attention this spec refuses (the message names
            what is supported).
        ValueError: an unknown attention or option.
    """
    missing = te_missing()
    if missing is not None:
        raise ImportError(
            f"te_layer_spec needs Transformer Engine: {missing}. Install transformer_engine[pytorch] "
            "(a CUDA machine) for the TE layer spec, or use the TE-free local spec: "
            "nemo_ssa.megatron.spec.layer_spec(config, attention) (transformer_impl='local').")
    check_layer_config(config)
    fp8 = [f for f in _FP8_ATTENTION_FIELDS if getattr(config, f, False)]
    if fp8:
        raise NotImplementedError(f"nemo_ssa TE layer spec: {', '.join(f'{f}=True' for f in fp8)} is not supported: "
                                  "our core attention runs in the activations' dtype (supported: FP8 linears only, "
                                  "with these fields False).")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    # megatron's defaults are what check_layer_config allows: a dense MLP, no qk norm, no MLA
    return with_our_core_attention(get_gpt_layer_with_transformer_engine_spec(), attention,
                                   attention_options, policy)
