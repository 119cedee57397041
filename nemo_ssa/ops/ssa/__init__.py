"""SSA attention: z = n * sgn(s) * log1p(b|s|), p = softmax(z). Math in README.md."""

from nemo_ssa.ops.ssa.naive import (
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
