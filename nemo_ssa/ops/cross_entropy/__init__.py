"""Language-model cross-entropy over the vocabulary: a torch reference and the fused path."""

from nemo_ssa.ops.cross_entropy.fused import lm_cross_entropy
from nemo_ssa.ops.cross_entropy.naive import lm_cross_entropy_naive

__all__ = ["lm_cross_entropy", "lm_cross_entropy_naive"]
