"""In-context linear regression (Garg et al., 2022), the task the SSA paper's distribution-shift
claim is about: a prompt is ``x_1, f(x_1), ..., x_k, f(x_k)`` with ``f(x) = w . x`` and a
fresh ``w`` per prompt; the model predicts each ``f(x_i)`` from the examples before it.

Tokens are vectors of ``d + 1`` numbers (read in by a linear layer): an input token is
``(x, 0)``, a label token ``(0, ..., 0, y)``. Shifts for the evaluation: ``x`` and/or ``w``
drawn at a larger scale, or from another distribution (uniform, Laplace, Student-t with 3
degrees of freedom, each scaled to unit variance). Least squares on the examples so far is
the floor any learner is compared with: with noiseless prompts it is exact from ``i >= d``
examples on (the minimum-norm solution before that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Prompts", "sample", "to_tokens", "least_squares_error", "DISTRIBUTIONS"]

DISTRIBUTIONS = ("normal", "uniform", "laplace", "student_t3")


def _draw(shape, dist: str, scale: float, g: torch.Generator) -> torch.Tensor:
    """Unit-variance draws of ``dist`` times ``scale``."""
    if dist == "normal":
        z = torch.randn(shape, generator=g)
    elif dist == "uniform":
        z = (torch.rand(shape, generator=g) * 2 - 1) * math.sqrt(3.0)
    elif dist == "laplace":
        u = torch.rand(shape, generator=g).clamp(1e-7, 1 - 1e-7) - 0.5
        z = -torch.sign(u) * torch.log1p(-2 * u.abs()) / math.sqrt(2.0)
    elif dist == "student_t3":
        n = torch.randn(shape, generator=g)
        chi2 = torch.randn((3,) + tuple(shape), generator=g).pow(2).sum(0)
        z = n / torch.sqrt(chi2 / 3) / math.sqrt(3.0)  # t_3 has variance 3
    else:
        raise ValueError(f"distribution {dist!r}: one of {DISTRIBUTIONS}")
    return z * scale


@dataclass
class Prompts:
    xs: torch.Tensor   # [B, k, d]
    ys: torch.Tensor   # [B, k]
    ws: torch.Tensor   # [B, d]


def sample(batch: int, k: int, d: int, *, x_scale: float = 1.0, w_scale: float = 1.0, x_dist: str = "normal",
           w_dist: str = "normal", noise: float = 0.0, seed: int = 0) -> Prompts:
    """``batch`` prompts of ``k`` examples in ``d`` dimensions (float32, CPU), reproducible by seed."""
    if batch < 1 or k < 1 or d < 1:
        raise ValueError(f"batch, k and d must be >= 1 (got {batch}, {k}, {d})")
    g = torch.Generator().manual_seed(int(seed))
    xs = _draw((batch, k, d), x_dist, x_scale, g)
    ws = _draw((batch, d), w_dist, w_scale, g)
    ys = torch.einsum("bkd,bd->bk", xs, ws)
    if noise:
        ys = ys + noise * torch.randn(ys.shape, generator=g)
    return Prompts(xs, ys, ws)


def to_tokens(p: Prompts) -> torch.Tensor:
    """``[B, 2k, d + 1]``: ``(x_i, 0)`` then ``(0, y_i)`` for each example."""
    b, k, d = p.xs.shape
    tok = torch.zeros(b, 2 * k, d + 1, dtype=p.xs.dtype)
    tok[:, 0::2, :d] = p.xs
    tok[:, 1::2, d] = p.ys
    return tok


def least_squares_error(p: Prompts, ridge: Optional[float] = None) -> torch.Tensor:
    """Squared error per position ``[k]`` (mean over prompts) of predicting ``y_i`` from the
    ``i`` examples before it by (minimum-norm) least squares; position 0 predicts 0."""
    b, k, d = p.xs.shape
    err = torch.zeros(k, dtype=torch.float64)
    xs, ys = p.xs.double(), p.ys.double()
    err[0] = ys[:, 0].pow(2).mean()
    for i in range(1, k):
        a, y = xs[:, :i], ys[:, :i]
        if ridge:
            eye = torch.eye(d, dtype=torch.float64)
            w = torch.linalg.solve(a.transpose(1, 2) @ a + ridge * eye, (a.transpose(1, 2) @ y.unsqueeze(-1)))
        else:
            w = torch.linalg.pinv(a) @ y.unsqueeze(-1)
        pred = (xs[:, i:i + 1] @ w).squeeze(-1).squeeze(-1)
        err[i] = (pred - ys[:, i]).pow(2).mean()
    return err
