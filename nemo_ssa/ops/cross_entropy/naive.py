"""Reference per-token cross-entropy in Megatron's layout (unfused torch).

``logits [s, b, V]`` (any float dtype), ``labels [b, s]`` int -> ``loss [b, s]`` fp32 (the
dtype of the computation, ``float32`` unless the logits are ``float64``):
``loss = logsumexp(logits) - logits[label]``, exactly what megatron-core's
``vocab_parallel_cross_entropy`` computes on one tensor-parallel rank (no label
smoothing; padded vocabulary entries take part like any other logit). No masking: the
caller applies the loss mask, as NeMo does with Megatron's per-token loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lm_cross_entropy_naive(logits: Tensor, labels: Tensor) -> Tensor:
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    lab = labels.transpose(0, 1)  # [b, s] -> [s, b]
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(-1, lab.unsqueeze(-1).long()).squeeze(-1)
    return (lse - picked).transpose(0, 1).contiguous()


def linear_cross_entropy_naive(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """Reference for the fused output layer + loss: ``hidden [N, H]``, ``weight [V, H]``
    (the output layer's / tied embedding's, padded vocabulary included), ``labels [N]`` ->
    per-token loss ``[N]`` in fp32 (fp64 for fp64 inputs), the whole ``[N, V]`` logits
    materialised.

    As megatron-core's ``vocab_parallel_cross_entropy`` on one rank: ``logsumexp(logits) -
    logits[label]``, where a label outside ``[0, V)`` picks 0 (megatron masks targets that
    fall outside the rank's vocabulary range; NeMo's loss mask removes such tokens later).
    """
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(dt) @ weight.to(dt).t()
    V = logits.shape[-1]
    valid = (labels >= 0) & (labels < V)
    idx = torch.where(valid, labels, torch.zeros_like(labels)).long()
    picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return torch.logsumexp(logits, dim=-1) - torch.where(valid, picked, torch.zeros_like(picked))
