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
