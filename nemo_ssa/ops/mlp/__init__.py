"""Squared-ReLU MLP (no bias, no gate): a torch reference and the epilogue-fused path."""

from nemo_ssa.ops.mlp.fused import mlp_relu2
from nemo_ssa.ops.mlp.naive import mlp_relu2_naive, mlp_relu2_naive_backward

__all__ = ["mlp_relu2", "mlp_relu2_naive", "mlp_relu2_naive_backward"]
