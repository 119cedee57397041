"""RoPE fused with the attention layout (megatron [s, b, h, d] -> contiguous [b, h, s, d]).

``rope_layout_naive`` (torch reference, megatron's arithmetic) and ``rope_layout_triton``
(one Triton pass per tensor, autograd included). ops/ never imports megatron.
"""

from nemo_ssa.ops.rope.naive import apply_rope_sbhd, rope_layout_naive
from nemo_ssa.ops.rope.triton import rope_layout_triton

__all__ = ["apply_rope_sbhd", "rope_layout_naive", "rope_layout_triton"]
