"""Attention ops: torch + triton only (never imports megatron or nemo).

Look implementations up by name with ``get_attention_fn(variant, impl)``.
"""

from nemo_ssa.ops.registry import available, get_attention_fn

__all__ = ["available", "get_attention_fn"]
