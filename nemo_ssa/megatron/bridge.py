"""Our attentions in Megatron-Bridge's GPT model provider.

Megatron-Bridge builds a GPT model from a ``GPTModelProvider``: a ``TransformerConfig``
dataclass with fields of its own. Its ``transformer_layer_spec`` field takes a
``ModuleSpec`` or a callable; ``provide()`` calls the callable as
``spec(provider, vp_stage=vp_stage)`` where its signature has ``vp_stage`` (else
``spec(provider)``) and hands the result to megatron's ``GPTModel``::

    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from nemo_ssa.megatron.bridge import layer_spec_for_bridge

    provider = GPTModelProvider(..., transformer_impl="local",
                                transformer_layer_spec=layer_spec_for_bridge("ssa_triton"))

:func:`layer_spec_for_bridge` returns a ``functools.partial`` of the module-level
:func:`bridge_layer_spec` with keyword arguments only, so a provider holding it pickles and
Bridge's YAML config dump (which has a representer for partials) can write it by name. Which spec it builds follows the provider's own
``transformer_impl`` (megatron's field, also ``--transformer-impl`` in Megatron-LM):

- ``local``: :func:`nemo_ssa.megatron.spec.layer_spec` -- the block spec the NeMo recipe
  uses (LayerNorm1P, the fused MLP where it applies), with ``vp_stage`` deciding how many
  layers this virtual pipeline stage builds;
- ``transformer_engine`` (megatron's default): :func:`nemo_ssa.megatron.te_spec.te_layer_spec`,
  one layer's spec; ``GPTModel`` counts the stage's layers itself from ``vp_stage``.

Refused, because Bridge would otherwise build something else than asked: the provider's
``attention_backend=local`` (Bridge then puts megatron's DotProductAttention into the
``core_attention`` slot of a layer ``ModuleSpec``, replacing ours) and ``mtp_num_layers``
(Bridge builds multi-token-prediction layers from this spec with TE assumed; not tried with
our attention).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

from nemo_ssa.megatron.mlp import parse_fused_mlp
from nemo_ssa.megatron.spec import layer_spec
from nemo_ssa.megatron.te_spec import te_layer_spec

__all__ = ["TRANSFORMER_IMPLS", "bridge_layer_spec", "layer_spec_for_bridge"]

#: the provider's ``transformer_impl`` values we build a spec for
TRANSFORMER_IMPLS = ("local", "transformer_engine")


def _check_provider(provider, attention: str) -> None:
    """Refuse provider settings under which Bridge would not build our attention."""
    from megatron.core.transformer.enums import AttnBackend

    if getattr(provider, "attention_backend", None) == AttnBackend.local:
        raise ValueError(
            f"attention={attention}: the provider has attention_backend=local, under which Megatron-Bridge replaces "
            "the spec's core attention with megatron's DotProductAttention; supported: any other attention_backend "
            "(AttnBackend.auto, the default; the others choose only inside TE's attention, which is not used).")
    if getattr(provider, "mtp_num_layers", None):
        raise NotImplementedError(
            f"attention={attention}: mtp_num_layers={provider.mtp_num_layers} is not supported (supported: None or 0); "
            "Bridge builds multi-token-prediction layers from this spec assuming Transformer Engine.")


def bridge_layer_spec(provider, vp_stage: Optional[int] = None, *, attention: str = "ssa",
                      attention_options: Optional[Dict[str, Any]] = None, policy: str = "pinned",
                      fused_mlp: Any = "auto"):
    """The layer spec for a Megatron-Bridge ``GPTModelProvider`` (Bridge calls this; build
    it with :func:`layer_spec_for_bridge`).

    Args:
        provider: the provider (a ``TransformerConfig``); its ``transformer_impl`` picks the
            spec (module docstring).
        vp_stage: the virtual pipeline stage being built (None without virtual pipeline).
        attention: ``attention=<name>`` as users write it (``ssa`` is resolved by the policy).
        attention_options: the attention's options, as for ``spec.layer_spec``.
        policy: ``pinned`` or ``free``.
        fused_mlp: as for ``spec.layer_spec`` (``transformer_impl=local`` only; the TE spec's
            MLP is TE's, so ``true`` is refused there).

    Returns:
        ``TransformerBlockSubmodules`` (local) or one layer's ``ModuleSpec`` (TE); megatron's
        ``GPTModel`` takes either.

    Raises:
        ValueError: an unknown ``transformer_impl``, attention or option, or
            ``attention_backend=local``.
        NotImplementedError: a provider setting or attention the spec refuses.
        ImportError: ``transformer_impl=transformer_engine`` without Transformer Engine.
    """
    impl = getattr(provider, "transformer_impl", "transformer_engine")
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"attention={attention}: the provider's transformer_impl={impl!r} is not supported "
                         f"(supported: {', '.join(TRANSFORMER_IMPLS)}).")
    _check_provider(provider, attention)
    if impl == "local":
        return layer_spec(provider, attention, attention_options, policy, fused_mlp=fused_mlp, vp_stage=vp_stage)
    if parse_fused_mlp(fused_mlp):
        raise NotImplementedError(f"attention={attention}: fused_mlp=true with transformer_impl=transformer_engine "
                                  "(the TE spec's MLP is TE's); supported there: fused_mlp=auto or false.")
    return te_layer_spec(provider, attention, attention_options, policy)


def layer_spec_for_bridge(attention: str = "ssa", attention_options: Optional[Dict[str, Any]] = None,
                          policy: str = "pinned", fused_mlp: Any = "auto") -> functools.partial:
    """A value for ``GPTModelProvider.transformer_layer_spec``: ``(provider, vp_stage=None)
    -> spec``, a ``functools.partial`` of :func:`bridge_layer_spec` with these keywords.

    Nothing is resolved here: Bridge calls it when it builds the model, on the machine that
    trains, so ``ssa`` resolves for that machine and a bad name fails there, before any
    module is built. Arguments as for :func:`bridge_layer_spec`.
    """
    return functools.partial(bridge_layer_spec, attention=attention,
                             attention_options=None if attention_options is None else dict(attention_options),
                             policy=policy, fused_mlp=fused_mlp)
