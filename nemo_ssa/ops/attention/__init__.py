"""Dense attention with a score transform chosen at compile time: softmax, or SSA
(z = n * sgn(s) * log1p(b|s|), p = softmax(z); math in README.md). ``naive`` is the torch
reference of both transforms, ``flash`` the fused Triton kernel of both, ``flex`` SSA
through FlexAttention. (The SDPA baseline is ``ops.softmax``; ELSA and NSA have their own
schedules in ``ops.elsa`` / ``ops.nsa``.)"""

from nemo_ssa.ops.attention.naive import (
    attention_naive,
    softmax_attention_naive,
    ssa_attention_naive,
    ssa_transform,
    visibility_mask,
)

__all__ = [
    "attention_naive",
    "softmax_attention_naive",
    "ssa_attention_naive",
    "ssa_transform",
    "visibility_mask",
]
