"""The fused squared-ReLU MLP (``nemo_ssa.ops.mlp``) as megatron-core's MLP module.

``FusedReLU2MLP`` is megatron's ``MLP`` (same parameters ``linear_fc1.weight [ffn, h]``,
``linear_fc2.weight [h, ffn]``, same checkpoints and sharded state dict) whose forward
runs ``mlp_relu2(x, w1, w2)`` -- the up-projection with relu^2 in its epilogue and the
down-projection's input gradient with the activation gradient in its epilogue -- and
returns ``(output, None)`` as megatron's MLP does without bias. Only the recipe's case is
fused: squared ReLU, no bias, not gated, dense, tensor parallel 1 (so no sequence
parallel: the weights are whole and no all-reduce/all-gather is skipped). Gradients land
in ``weight.grad`` through autograd, as with megatron's linear layers without
gradient-accumulation fusion; megatron's DDP hooks add them to ``main_grad``.

Chosen by config, ``model.fused_mlp`` (``layer_spec(..., fused_mlp=)``): ``auto`` = on
with CUDA when the config is supported (else megatron's MLP, logged), ``true`` = on or a
ValueError naming what is supported (e.g. tensor parallel > 1) when the model is built,
``false`` = megatron's MLP. On CPU the op runs the torch reference (same math as
megatron's MLP), so ``true`` also works in the CPU loop.

Note: megatron's TransformerLayer logs "Unknown MLP type ... Using default kwargs" for any
MLP subclass (it compares the class with ``==``); the only kwarg it would have passed is
the TP group, which ``MLP`` then takes from the parallel state -- the same group at TP 1.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.mlp import MLP

from nemo_ssa.megatron.compat import accepted_kwargs
from nemo_ssa.megatron.fused_choice import choose, parse_flag
from nemo_ssa.ops.mlp import mlp_relu2

SUPPORTED = ("squared ReLU, add_bias_linear=False, gated_linear_unit=False, a dense MLP (no MoE expert), "
             "tensor_parallel=1 without sequence parallel, no fp8, hidden and ffn sizes multiples of 16")


def parse_fused_mlp(value: Any) -> Optional[bool]:
    """``auto``/None -> None, ``true``/``false`` (bool or string) -> bool; else ValueError."""
    return parse_flag(value, "fused_mlp")


def _is_squared_relu(fn) -> bool:
    probe = torch.tensor([-3.0, -0.5, -1e-3, 0.0, 1e-3, 0.25, 2.0, 7.0], dtype=torch.float64)
    try:
        out = fn(probe)
    except Exception:  # noqa: BLE001 - an activation that cannot take the probe is not ours
        return False
    return isinstance(out, torch.Tensor) and out.shape == probe.shape and bool(
        torch.allclose(out.double(), probe.clamp(min=0) ** 2, rtol=1e-12, atol=0))


def unsupported_reason(config, is_expert: bool = False) -> Optional[str]:
    """Why ``config`` cannot take the fused MLP, or None when it can."""
    if getattr(config, "gated_linear_unit", False):
        return "gated_linear_unit=True (gated MLPs are not fused)"
    if getattr(config, "add_bias_linear", False):
        return "add_bias_linear=True (the fused MLP has no bias)"
    if getattr(config, "use_te_activation_func", False):
        return "use_te_activation_func=True"
    if not _is_squared_relu(getattr(config, "activation_func", None)):
        return f"activation_func={getattr(config.activation_func, '__name__', config.activation_func)!r} is not squared ReLU"
    if is_expert or getattr(config, "num_moe_experts", None):
        return "MoE experts are not fused"
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if tp > 1:
        return f"tensor_parallel={tp} (the fused MLP needs tensor_parallel=1)"
    if getattr(config, "sequence_parallel", False):
        return "sequence_parallel=True"
    if getattr(config, "fp8", None):
        return f"fp8={config.fp8!r}"
    for key in ("hidden_size", "ffn_hidden_size"):
        v = getattr(config, key, None)
        if v is not None and int(v) % 16:
            return f"{key}={v} is not a multiple of 16"
    return None


def use_fused_mlp(config, fused_mlp: Any = "auto") -> bool:
    """Whether the layer spec takes ``FusedReLU2MLP`` (called when the model is built;
    ``fused_choice.choose``'s rule).

    Raises:
        ValueError: an unknown ``fused_mlp`` value, or ``true`` with a config it does not
            support (the message names the supported set).
    """
    return choose("fused_mlp", fused_mlp, lambda: unsupported_reason(config), SUPPORTED, "megatron's MLP")


class FusedReLU2MLP(MLP):
    """megatron's MLP with the squared-ReLU activation fused into its GEMMs (module docstring)."""

    def __init__(self, config, submodules, is_expert: bool = False, input_size: Optional[int] = None,
                 ffn_hidden_size: Optional[int] = None, tp_group=None, name: Optional[str] = None,
                 pg_collection=None, is_mtp_layer: bool = False):
        # What TransformerLayer may hand an MLP it builds from a ModuleSpec: ``tp_group``
        # (megatron's own MLP class), ``pg_collection`` and ``is_mtp_layer`` (MoE layers, and
        # every ModuleSpec MLP from 0.18 on), ``name`` (0.18+). The tensor-parallel group is
        # the collection's ``tp``; an MTP layer's dense MLP is the same module (megatron's
        # ``MLP.as_mlp_submodule`` drops the flag too).
        del is_mtp_layer
        if tp_group is None and pg_collection is not None:
            tp_group = getattr(pg_collection, "tp", None)
        reason = unsupported_reason(config, is_expert=is_expert)
        if reason is not None:
            raise ValueError(f"FusedReLU2MLP: {reason}; supported: {SUPPORTED} (use megatron's MLP, "
                             "fused_mlp=false)")
        super().__init__(config, submodules, is_expert=is_expert, input_size=input_size,
                         ffn_hidden_size=ffn_hidden_size, tp_group=tp_group,
                         **accepted_kwargs(MLP, name=name))
        if tp_group is not None and tp_group.size() > 1:
            raise ValueError(f"FusedReLU2MLP: a tensor-parallel group of size {tp_group.size()}; supported: "
                             f"{SUPPORTED}")
        if self.input_size % 16:
            raise ValueError(f"FusedReLU2MLP: input_size={self.input_size} is not a multiple of 16; "
                             f"supported: {SUPPORTED}")

    @classmethod
    def as_mlp_submodule(cls, submodules, config, pg_collection, is_mtp_layer: bool, is_expert: bool = False,
                         input_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None,
                         name: Optional[str] = None) -> "FusedReLU2MLP":
        """The MLP slot's builder in megatron-core 0.18+ (``MLP.as_mlp_submodule``'s contract:
        the layer spec holds ``partial(FusedReLU2MLP.as_mlp_submodule, submodules=...)`` and
        TransformerLayer calls it). Defined here so it is the same on every version."""
        return cls(config=config, submodules=submodules, is_expert=is_expert, input_size=input_size,
                   ffn_hidden_size=ffn_hidden_size, pg_collection=pg_collection,
                   is_mtp_layer=is_mtp_layer, name=name)

    def forward(self, hidden_states, per_token_scale=None, padding_mask=None):
        # padding_mask (megatron-core 0.16+): which tokens are padding, for MoE routing and
        # its load-balancing statistics. A dense MLP maps every token on its own, so padded
        # tokens change no other token's output: there is nothing to mask (megatron's MLP
        # ignores it too).
        del padding_mask
        if per_token_scale is not None:  # MoE routing weights: never set for a dense MLP
            return super().forward(hidden_states, per_token_scale)
        # [s, b, h] -> [s, b, h]; the two Triton kernels on CUDA bf16/fp16, torch elsewhere
        out = mlp_relu2(hidden_states, self.linear_fc1.weight, self.linear_fc2.weight)
        return out, None
