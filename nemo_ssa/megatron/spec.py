"""The GPT layer spec with our core attentions, for NeMo's ``transformer_layer_spec``.

``layer_spec(config, attention=...)`` returns megatron's local (non-TE) GPT layer with
 - the core attention chosen by name (``nemo_ssa.config.attentions.ATTENTIONS``), or, for the NSA
   family (``nsa``, ``nsa_ssa``), ``NSASelfAttention`` as the whole self attention,
 - LayerNorm1P (zero-centred gamma) for the layer norms and the final norm, so the
   model keeps nemotron3_4b's architecture without Transformer Engine; with
   ``fused_layernorm`` (opt-in; auto = on with CUDA) ``FusedLayerNorm1P``, the same module through
   Triton kernels (nemo_ssa/megatron/layernorm.py, nemo_ssa/ops/norm),
 - megatron's MLP (squared ReLU comes from the config's ``activation_func``), or with
   ``fused_mlp`` (auto = on with CUDA) ``FusedReLU2MLP``: the same module with the
   activation fused into its GEMMs (nemo_ssa/megatron/mlp.py, nemo_ssa/ops/mlp).

It returns ``TransformerBlockSubmodules`` rather than a layer ``ModuleSpec`` so the final
layer norm is ours too (megatron would otherwise pick its torch fallback, which refuses
zero-centred gamma). Never combine with ``attention_backend=local``: NeMo then replaces
``core_attention`` with megatron's DotProductAttention.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Dict, Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from nemo_ssa.config.attentions import ATTENTIONS, KERNEL_OPTION_KEYS, SSA_OPTION_KEYS
from nemo_ssa.config.policy import PINNED, resolve_attention
from nemo_ssa.megatron.compat import local_layer_spec, mlp_slot
from nemo_ssa.megatron.layernorm import FusedLayerNorm1P, LayerNorm1P, use_fused_layernorm
from nemo_ssa.megatron.mlp import FusedReLU2MLP, use_fused_mlp
from nemo_ssa.megatron.self_attention import FusedRopeSelfAttention


def _core_attentions():
    classes = {}
    for name, info in ATTENTIONS.items():
        if info.family == "nsa":  # replaces the whole self attention: nsa_self_attention_spec
            continue
        module, cls = info.module_path
        classes[name] = getattr(importlib.import_module(module), cls)
    return classes


#: implementation name -> core attention class (the attention table's ``module``)
CORE_ATTENTIONS = _core_attentions()


def core_attention_spec(attention: str, options: Optional[Dict[str, Any]] = None) -> ModuleSpec:
    """ModuleSpec for an implementation name (already resolved by the policy)."""
    if attention not in CORE_ATTENTIONS:
        raise ValueError(
            f"no core attention module for {attention!r}; available: {sorted(CORE_ATTENTIONS)}"
        )
    options = dict(options or {})
    params: Dict[str, Any] = {}
    if "force_contiguous_qkv" in options:
        params["force_contiguous_qkv"] = options["force_contiguous_qkv"]
    if options.get("fused_rope_layout") is not None:
        params["fused_rope_layout"] = bool(options["fused_rope_layout"])
    kernel = {k: options[k] for k in KERNEL_OPTION_KEYS.get(attention, ())
              if k in options and k != "fused_rope_layout"}
    if kernel:
        params["kernel_options"] = kernel
    if ATTENTIONS[attention].transform == "ssa":
        # unset options take the pinned policy's values (the policy resolves them first;
        # a direct call without options gets the same)
        params.update(
            n_init=options.get("n", PINNED.n),
            b_init=options.get("b", PINNED.b),
            learnable_n=options.get("learnable_n", PINNED.learnable_n),
            learnable_b=options.get("learnable_b", PINNED.learnable_b),
        )
        if options.get("n_min", PINNED.n_min) is not None:  # policy=free only (the pinned n has no floor)
            params["n_min"] = float(options.get("n_min", PINNED.n_min))
    return ModuleSpec(module=CORE_ATTENTIONS[attention], params=params)


def check_layer_config(config) -> None:
    """The config checks every layer spec of ours applies (the local :func:`layer_spec` and
    the Transformer Engine one, nemo_ssa/megatron/te_spec.py), before anything is built."""
    if getattr(config, "normalization", "LayerNorm") != "LayerNorm":
        raise NotImplementedError(
            f"nemo_ssa layer spec: normalization={config.normalization!r} is not supported "
            "(supported: 'LayerNorm', with or without zero-centred gamma)."
        )
    if getattr(config, "qk_layernorm", False):
        raise NotImplementedError("nemo_ssa layer spec: qk_layernorm is not supported yet.")
    if getattr(config, "num_moe_experts", None):
        raise NotImplementedError("nemo_ssa layer spec: MoE is not supported (num_moe_experts).")
    if getattr(config, "multi_latent_attention", False):
        # MLA's core attention slot takes q/k and v of different head dims; ours take one
        raise NotImplementedError("nemo_ssa layer spec: multi_latent_attention is not supported "
                                  "(supported: SelfAttention with one head dim, kv_channels).")


def resolve_here(attention: str, attention_options: Optional[Dict[str, Any]] = None, policy: str = "pinned"):
    """``attention=<name>`` and its options under ``policy``, resolved for this machine (``ssa``
    is the fused kernel with CUDA, the reference without): what every spec builder here uses."""
    import torch

    return resolve_attention(attention, attention_options, policy=policy,
                             device="cuda" if torch.cuda.is_available() else "cpu")


def layer_spec(
    config,
    attention: str = "softmax",
    attention_options: Optional[Dict[str, Any]] = None,
    policy: str = "pinned",
    fused_mlp: Any = "auto",
    vp_stage: Optional[int] = None,
    fused_layernorm: Any = False,
) -> TransformerBlockSubmodules:
    """Build the block spec for ``config`` with the named attention.

    Args:
        config: the megatron/NeMo TransformerConfig (``GPTConfig``) being built.
        attention: ``attention=<name>`` as users write it (``ssa`` is resolved by the policy).
        attention_options: SSA options (n, learnable_n, n_min, b, learnable_b,
            force_contiguous_qkv; for attentions with the SSA transform) and the
            attention's ``KERNEL_OPTION_KEYS`` (e.g. NSA's sizes); the pinned policy resets
            SSA overrides with a warning.
        policy: ``pinned`` or ``free``.
        fused_mlp: the squared-ReLU MLP fused into its GEMMs (``FusedReLU2MLP``): ``auto``
            (on with CUDA when the config is supported: squared ReLU, no bias, not gated,
            tensor parallel 1), ``true`` (ValueError naming the supported set when the
            config is not), ``false`` (megatron's MLP).
        vp_stage: the virtual pipeline stage this block is for (None: no virtual pipeline);
            it decides how many layers are built, as in megatron's own block spec.
        fused_layernorm: the layer norms and the final norm through Triton
            (``FusedLayerNorm1P``): ``auto`` (on with CUDA for a supported hidden size and
            dtype), ``true`` (ValueError naming the supported set otherwise), ``false``
            (torch's LayerNorm; the default until the op's host cost is cut: it slows the
            host-bound micro batch 8 step, docs/fused-layers.md).
    """
    check_layer_config(config)
    # NSA replaces the self-attention internals (gates and compression read the layer
    # input), not only the core attention; nsa_ssa is the same module with the SSA transform
    layer = gpt_layer_spec(attention, attention_options, policy)
    if use_fused_mlp(config, fused_mlp):
        layer.submodules.mlp = mlp_slot(layer.submodules.mlp, FusedReLU2MLP)
    norm = LayerNorm1P
    if use_fused_layernorm(config, fused_layernorm):
        norm = layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = FusedLayerNorm1P
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)


def gpt_layer_spec(attention: str = "ssa", attention_options: Optional[Dict[str, Any]] = None,
                   policy: str = "pinned") -> ModuleSpec:
    """One GPT layer's ``ModuleSpec`` with the named attention, without a config: what plain
    megatron-core's ``GPTModel(config, transformer_layer_spec=...)`` and Megatron-LM's
    ``pretrain_gpt.py --spec`` take (megatron repeats it ``num_layers`` times and adds its own
    final norm). LayerNorm1P follows ``config.layernorm_zero_centered_gamma``; megatron's
    MLP (no fused MLP: that choice needs the config). See :func:`layer_spec` for the block
    spec the NeMo recipe uses, and nemo_ssa/megatron/layer_specs.py for ready-made ones."""
    resolved = resolve_here(attention, attention_options, policy)
    info = ATTENTIONS[resolved.name]
    layer = copy.deepcopy(local_layer_spec(normalization="LayerNorm"))
    layer.submodules.input_layernorm = LayerNorm1P
    layer.submodules.pre_mlp_layernorm = LayerNorm1P
    if info.family == "nsa":
        from nemo_ssa.megatron.nsa_attention import nsa_self_attention_spec

        opts = resolved.options
        nsa = {k: opts[k] for k in KERNEL_OPTION_KEYS[resolved.name] if k in opts}
        ssa = {k: opts[k] for k in SSA_OPTION_KEYS if k in opts} if info.transform == "ssa" else None
        layer.submodules.self_attention = nsa_self_attention_spec(nsa or None, transform=info.transform, ssa=ssa)
    else:
        layer.submodules.self_attention.submodules.core_attention = core_attention_spec(
            resolved.name, resolved.options)
        _use_fused_rope_layout(layer, resolved.name, resolved.options)
    return layer


def _use_fused_rope_layout(layer: ModuleSpec, attention: str, options: Dict[str, Any]) -> None:
    """RoPE + q/k/v layout in one Triton pass (nemo_ssa/ops/rope) for the fused core attentions.

    ``fused_rope_layout`` (attention option of softmax / softmax_triton / ssa_triton; the
    policy refuses it elsewhere): true = on, false = megatron's RoPE + the layout copies,
    null = on (softmax: on where CUDA exists; the CPU loop keeps megatron's RoPE).
    """
    flag = options.get("fused_rope_layout")
    if flag is False or (flag is None and not CORE_ATTENTIONS[attention].default_fused_rope_layout()):
        return
    layer.submodules.self_attention.module = FusedRopeSelfAttention

