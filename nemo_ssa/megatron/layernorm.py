"""LayerNorm1P (zero-centred gamma) without Transformer Engine or Apex.

Nemotron normalises with ``layernorm_zero_centered_gamma=True``: the stored weight w is
initialised to 0 and the layer applies (1 + w). megatron-core only provides this through
TE/Apex; its torch fallback (``WrappedTorchNorm``) refuses the flag. This module keeps
nemotron3_4b's architecture on stock PyTorch. ``persist_layer_norm`` is an Apex kernel
choice with no numerical effect and is ignored here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig


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
