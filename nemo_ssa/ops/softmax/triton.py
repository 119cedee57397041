"""Fused softmax attention: the flash kernel of ``ops.attention`` with ``TRANSFORM=softmax``.

The same schedule, masking, GQA, strides, varlen and dropout as
``nemo_ssa.ops.attention.flash`` (one kernel, the transform is a compile-time choice), so it is
the like-for-like baseline for timing SSA. Re-exported here so softmax implementations
live under ``ops.softmax``.
"""

from nemo_ssa.ops.attention.flash import softmax_attention_triton, softmax_attention_triton_varlen

__all__ = ["softmax_attention_triton", "softmax_attention_triton_varlen"]
