"""Reference LayerNorm with zero-centred gamma (unfused torch): the math the Triton path
must reproduce.

``x [..., N]``, ``weight [N]``, ``bias [N]``::

    mean = x.mean(-1)
    var  = ((x - mean) ** 2).mean(-1)          (biased, as LayerNorm)
    y    = (x - mean) / sqrt(var + eps) * g + bias,   g = 1 + weight (zero-centred) or weight

Computed in the inputs' dtype step by step, so called on fp64 tensors it is the anchor of
the tests. The "eager same-dtype" implementation of the 2x-eager rule is what
``LayerNorm1P`` ran before the fused path: ``F.layer_norm(x, (N,), weight + 1, bias, eps)``
(``layer_norm_1p_eager``), whose ``1 + weight`` is rounded to the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def layer_norm_1p_naive(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5,
                        zero_centred: bool = True) -> Tensor:
    """LayerNorm over the last dim with scale ``1 + weight`` (or ``weight``), in x's dtype."""
    g = weight + 1 if zero_centred else weight
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(-1, keepdim=True)
    return xc / torch.sqrt(var + eps) * g + bias


def layer_norm_1p_eager(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5,
                        zero_centred: bool = True) -> Tensor:
    """torch's fused LayerNorm with the scale formed in the weight's dtype: LayerNorm1P's
    torch path (``model.fused_layernorm=false``)."""
    g = weight + 1 if zero_centred else weight
    return F.layer_norm(x, (x.shape[-1],), g, bias, eps)
