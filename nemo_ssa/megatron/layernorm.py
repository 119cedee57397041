"""LayerNorm1P (zero-centred gamma) without Transformer Engine or Apex.

Nemotron normalises with ``layernorm_zero_centered_gamma=True``: the stored weight w is
initialised to 0 and the layer applies (1 + w). megatron-core only provides this through
TE/Apex; its torch fallback (``WrappedTorchNorm``) refuses the flag. This module keeps
nemotron3_4b's architecture on stock PyTorch. ``persist_layer_norm`` is an Apex kernel
choice with no numerical effect and is ignored here.

``FusedLayerNorm1P`` is the same module (same parameters, checkpoints and sharded state)
whose forward runs ``nemo_ssa.ops.norm.layer_norm_1p``: two Triton kernels, the scale
``1 + w`` formed in fp32 and the weight/bias gradients reduced without torch's column
kernel. Chosen when the model is built by ``model.fused_layernorm`` (``use_fused_layernorm``):
``auto`` = on with CUDA for a supported hidden size and dtype, ``true`` = on or a ValueError
naming what is supported, ``false`` = this module's ``F.layer_norm`` (the default: the op's
backward costs ~0.3 ms of host time a call, which the host-bound micro batch 8 step pays).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_ssa.megatron.fused_choice import choose, parse_flag
from nemo_ssa.ops.norm import layer_norm_1p
from nemo_ssa.ops.norm.fused import MAX_N, unsupported_reason as _kernel_unsupported

SUPPORTED = f"hidden size 1..{MAX_N}, params in bf16, fp16 or fp32, normalization='LayerNorm'"


class LayerNorm1P(torch.nn.Module):
    """LayerNorm whose scale is ``1 + weight`` when the config asks for zero-centred gamma.

    Signature matches megatron's norm modules: ``(config, hidden_size, eps, ...)``.
    With ``layernorm_zero_centered_gamma=False`` it is a plain LayerNorm.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool | None = None,
        normalization: str = "LayerNorm",
    ):
        super().__init__()
        if config.normalization != "LayerNorm":
            raise NotImplementedError(
                f"LayerNorm1P: normalization={config.normalization!r} is not supported "
                "(supported: 'LayerNorm')."
            )
        self.zero_centered_gamma = (
            config.layernorm_zero_centered_gamma if zero_centered_gamma is None else zero_centered_gamma
        )
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(self.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(self.hidden_size, dtype=config.params_dtype))
        for p in (self.weight, self.bias):
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class FusedLayerNorm1P(LayerNorm1P):
    """LayerNorm1P through the Triton kernels of ``nemo_ssa.ops.norm`` (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_1p(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


def parse_fused_layernorm(value: Any) -> Optional[bool]:
    """``auto``/None -> None, ``true``/``false`` (bool or string) -> bool; else ValueError."""
    return parse_flag(value, "fused_layernorm")


def unsupported_reason(config) -> Optional[str]:
    """Why ``config``'s layer norms cannot take the fused path, or None when they can."""
    if getattr(config, "normalization", "LayerNorm") != "LayerNorm":
        return f"normalization={config.normalization!r}"
    dtype = getattr(config, "params_dtype", torch.float32)
    return _kernel_unsupported(int(config.hidden_size), dtype)


def use_fused_layernorm(config, fused_layernorm: Any = False) -> bool:
    """Whether the layer spec takes ``FusedLayerNorm1P`` (called when the model is built;
    ``fused_choice.choose``'s rule).

    Raises:
        ValueError: an unknown value, or ``true`` with a config it does not support (the
            message names the supported set).
    """
    return choose("fused_layernorm", fused_layernorm, lambda: unsupported_reason(config), SUPPORTED,
                  "torch's LayerNorm")
