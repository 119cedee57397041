"""RoPE fused with the attention layout (megatron [s, b, h, d] -> contiguous [b, h, s, d]).

``rope_layout_naive`` (torch reference, megatron's arithmetic) and ``rope_layout_triton``
(one Triton pass for q, k, v, autograd included); their ``_qkv`` forms take the QKV
projection's output [s, b, ng, (p + 2) * d] itself, and the Triton one returns its gradient
as one buffer in that layout (no split, copy or concatenation). ops/ never imports megatron.
"""

from nemo_ssa.ops.rope.naive import apply_rope_sbhd, rope_layout_naive, rope_layout_qkv_naive
from nemo_ssa.ops.rope.triton import rope_layout_qkv_triton, rope_layout_triton

__all__ = ["apply_rope_sbhd", "rope_layout_naive", "rope_layout_qkv_naive", "rope_layout_qkv_triton",
           "rope_layout_triton"]
