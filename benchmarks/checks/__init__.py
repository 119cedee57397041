"""Correctness checks run on a GPU (outputs and gradients against references), apart from the
speed scripts one level up. Run as modules from the repository root:
``python -m benchmarks.checks.model_grad_parity``, ``python -m benchmarks.checks.tiny_shapes``."""
