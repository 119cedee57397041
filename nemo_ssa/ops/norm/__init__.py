"""LayerNorm with zero-centred gamma: a torch reference and the Triton forward/backward."""

from nemo_ssa.ops.norm.fused import layer_norm_1p
from nemo_ssa.ops.norm.naive import layer_norm_1p_eager, layer_norm_1p_naive

__all__ = ["layer_norm_1p", "layer_norm_1p_eager", "layer_norm_1p_naive"]
