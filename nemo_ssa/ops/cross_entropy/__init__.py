"""Language-model cross-entropy over the vocabulary: torch references and the fused paths.

- ``lm_cross_entropy``: the loss alone on megatron's logits (compiled on CUDA);
- ``linear_cross_entropy``: the output layer + loss chunked over tokens, gradients in the
  forward (no ``[tokens, vocab]`` logits for the whole batch); ``chunked.py``.
"""

from nemo_ssa.ops.cross_entropy.chunked import linear_cross_entropy
from nemo_ssa.ops.cross_entropy.fused import lm_cross_entropy
from nemo_ssa.ops.cross_entropy.naive import linear_cross_entropy_naive, lm_cross_entropy_naive

__all__ = ["linear_cross_entropy", "linear_cross_entropy_naive", "lm_cross_entropy", "lm_cross_entropy_naive"]
