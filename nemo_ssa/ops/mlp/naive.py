"""Reference squared-ReLU MLP (unfused torch): the math the fused path must reproduce.

``x [..., K]``, ``w1 [N, K]`` (megatron's ``linear_fc1.weight``), ``w2 [H, N]``
(``linear_fc2.weight``) -> ``y [..., H]``::

    u = x @ w1^T        [..., N]
    a = relu(u) ** 2    [..., N]
    y = a @ w2^T        [..., H]

No bias and no gate: the recipe's case (nemotron3_4b sets ``add_bias_linear=False``,
``gated_linear_unit=False``, ``activation_func=squared_relu``). Computed in the inputs'
dtype, so called on fp64 tensors it is the anchor of the tests and called on bf16 tensors
it is the "eager same-dtype" implementation of the 2x-eager rule (the same chain of
roundings megatron's MLP makes: u rounded, relu, square rounded, GEMM).

``mlp_relu2_naive_backward`` is the backward written out (README.md derives it); autograd
of ``mlp_relu2_naive`` gives the same, which tests/ops/mlp/test_mlp.py checks.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def mlp_relu2_naive(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """``relu(x w1^T)^2 w2^T`` in the inputs' dtype (autograd-differentiable)."""
    u = torch.matmul(x, w1.t())
    a = torch.relu(u).square()
    return torch.matmul(a, w2.t())


def mlp_relu2_naive_backward(x: Tensor, w1: Tensor, w2: Tensor, dy: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dx, dw1, dw2)`` for upstream gradient ``dy [..., H]``, recomputing ``u``.

    dA = dy w2;  dU = dA * 2 relu(u);  dw2 = dy^T a;  dw1 = dU^T x;  dx = dU w1.
    """
    k, h = x.shape[-1], dy.shape[-1]
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, h)
    u = x2 @ w1.t()
    r = torch.relu(u)
    a = r.square()
    du = (dy2 @ w2) * (2 * r)
    return (du @ w1).reshape(x.shape), du.t() @ x2, dy2.t() @ a
