"""Megatron-aware code: core attentions, layer norms and the layer spec."""
