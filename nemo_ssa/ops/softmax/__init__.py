"""Softmax attention: the SDPA baseline (the torch reference lives in ``ops.attention.naive``)."""

from nemo_ssa.ops.softmax.sdpa import softmax_attention_sdpa

__all__ = ["softmax_attention_sdpa"]
