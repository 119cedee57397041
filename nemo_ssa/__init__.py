"""nemo_ssa: alternative core attentions (SSA and baselines) for NeMo / megatron-core GPT models."""

__version__ = "0.1.0"
