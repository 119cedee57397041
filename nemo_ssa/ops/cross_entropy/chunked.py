"""Chunked output layer + cross-entropy: no ``[tokens, vocab]`` logits for the whole batch.

The model's last step is ``logits = hidden @ W^T`` (``W`` = the tied embedding, padded
vocabulary included) followed by a per-token ``logsumexp(logits) - logits[label]``.
megatron-core materialises the bf16 logits, upcasts them to fp32 and keeps the fp32
softmax for its backward (3.1 GiB and 10.8 ms fwd+bwd at 8,192 tokens x 50,304 on an
H100). Here the tokens are processed in chunks of ``chunk_size`` rows; per chunk one
function (``torch.compile``'d on CUDA, eager elsewhere) computes

    logits = h_c @ W^T                      (bf16 GEMM, fp32 accumulate, upcast)
    lse    = logsumexp(logits)              (fp32)
    loss_c = lse - logits[label]            (label outside [0, V) picks 0, as megatron)
    G      = softmax(logits) - onehot(label)  (cast to the input dtype)
    dh_c   = G @ W                          (the chunk's hidden-state gradient)
    dW    += G^T @ (r_c * h_c)              (r = the per-token row weight, see below)

so the gradients are computed in the forward pass (liger-kernel's fused linear
cross-entropy does the same) and the backward only scales them: three GEMMs in all, the
minimum, and only one chunk's logits alive at a time.

The gradient contract (the output is a per-token loss ``[N]``, not a scalar):

* ``dhidden = grad_out[:, None] * dh`` is exact for ANY incoming gradient (each token's
  loss depends on its own hidden state only);
* ``dW = sum_n grad_out[n] dloss_n/dW`` cannot be rescaled per token after the fact, so it
  is accumulated with the weights ``row_weight`` (default all ones) and the backward uses
  ``dW = s * dW_r`` with ``s = <grad_out, r> / <r, r>``. This is exact when
  ``grad_out = c * row_weight`` for a scalar ``c`` -- the case for every loss of the form
  ``c * sum(loss * mask)`` (NeMo's masked token loss, megatron's per-token loss, a plain
  mean) when ``row_weight`` is that mask. The backward checks it ON THE DEVICE without a
  host sync (``torch._assert_async``): any other incoming gradient fails loudly (a device
  assert on CUDA, a RuntimeError on CPU), never a silently wrong weight gradient.

Memory: the saved state is ``dh`` (``[N, H]``, input dtype) and ``dW`` (``[V, H]``; fp32 when
there is more than one chunk). Speed/memory vs megatron, liger, cut-cross-entropy and
``torch.compile`` of the plain expression: ``benchmarks/bench_linear_ce.py``,
docs/fused-layers.md.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from nemo_ssa.ops.common import env

#: tokens per chunk: the fastest of the measured sizes at the recipe's 32,768 tokens, for
#: under 2 GiB extra (benchmarks/bench_linear_ce.py; figures in docs/results)
DEFAULT_CHUNK = 8192

#: relative tolerance of the ``grad_out = c * row_weight`` check (fp32 sums over ~1e5 tokens)
CONTRACT_RTOL = 1e-4

_COMPILED: Dict[bool, Callable] = {}

from nemo_ssa.ops.common import env


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_body(h: Tensor, w: Tensor, labels: Tensor, row_weight: Tensor, with_grad: bool
                ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """One chunk: per-token loss ``[C]`` (fp32/fp64) and, with ``with_grad``, ``dh [C, H]`` and
    ``dW_r [V, H]`` in the input dtype."""
    acc = _acc_dtype(h.dtype)
    logits = (h @ w.t()).to(acc)  # [C, V]
    V = logits.shape[-1]
    valid = (labels >= 0) & (labels < V)
    idx = torch.where(valid, labels, torch.zeros_like(labels)).long()
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    loss = lse - torch.where(valid, picked, torch.zeros_like(picked))
    if not with_grad:
        return loss, None, None
    hit = (torch.arange(V, device=h.device)[None, :] == idx[:, None]) & valid[:, None]  # [C, V]
    g = (torch.exp(logits - lse[:, None]) - hit.to(acc)).to(h.dtype)  # [C, V]
    dh = g @ w  # [C, H]
    dw = g.t() @ (h * row_weight.to(h.dtype)[:, None])  # [V, H]
    return loss, dh, dw


def compile_enabled(device: torch.device) -> bool:
    """torch.compile on CUDA (``NEMO_SSA_CE_COMPILE=0`` turns it off); eager on CPU, where the
    compile time would dominate the CPU loop and CI."""
    return device.type == "cuda" and env.ce_compile()


def _body_for(device: torch.device, dtype: torch.dtype) -> Callable:
    if dtype == torch.float64 or not compile_enabled(device):
        return _chunk_body
    fn = _COMPILED.get(True)
    if fn is None:
        # dynamic=None: the recipe's chunk shape compiles static; a differing last chunk
        # triggers one dynamic-N recompile (V and H stay static)
        fn = _COMPILED[True] = torch.compile(_chunk_body, fullgraph=True)
    return fn


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, row_weight: Tensor,
                chunk_size: int, grad_enabled: bool) -> Tensor:
        N = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        # (grad mode is off inside forward: the caller's mode comes in as grad_enabled)
        want_dh = bool(grad_enabled and ctx.needs_input_grad[0])
        want_dw = bool(grad_enabled and ctx.needs_input_grad[1])
        with_grad = want_dh or want_dw
        body = _body_for(hidden.device, hidden.dtype)
        losses, dhs = [], []
        dw = None
        n_chunks = max(1, -(-N // chunk_size))
        for start in range(0, max(N, 1), chunk_size):
            stop = min(N, start + chunk_size)
            loss_c, dh_c, dw_c = body(hidden[start:stop], weight, labels[start:stop],
                                      row_weight[start:stop], with_grad)
            losses.append(loss_c)
            if with_grad:
                dhs.append(dh_c)
                if dw is None:
                    dw = dw_c if n_chunks == 1 else dw_c.to(acc)
                else:
                    dw.add_(dw_c)
        loss = losses[0] if len(losses) == 1 else torch.cat(losses)
        if with_grad:
            dh = dhs[0] if len(dhs) == 1 else torch.cat(dhs)
            ctx.save_for_backward(dh if want_dh else None, dw if want_dw else None, row_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        dh, dw, r = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        acc = _acc_dtype(h_dtype)
        g = grad_out.to(acc)
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = (dh.to(acc) * g[:, None]).to(h_dtype)
        if ctx.needs_input_grad[1]:
            rr = r.to(acc)
            s = (g * rr).sum() / (rr * rr).sum().clamp_min(torch.finfo(acc).tiny)
            dev = (g - s * rr).abs().max()
            bound = CONTRACT_RTOL * s.abs() * rr.abs().max()
            torch._assert_async(
                dev <= bound,
                "linear_cross_entropy: the incoming gradient of the per-token loss is not "
                "c * row_weight (pass the loss mask as row_weight; see "
                "nemo_ssa/ops/cross_entropy/chunked.py)",
            )
            grad_w = (dw.to(acc) * s).to(w_dtype)
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                         row_weight: Optional[Tensor] = None, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """Per-token ``logsumexp(hidden @ weight^T) - (hidden @ weight^T)[label]``, chunked.

    Args:
        hidden: ``[N, H]`` float (bf16/fp16/fp32/fp64) hidden states.
        weight: ``[V, H]`` output weight in ``hidden``'s dtype (padded rows take part, as in
            megatron).
        labels: ``[N]`` integer targets; one outside ``[0, V)`` picks 0 (megatron's
            out-of-range rule; mask such tokens with the loss mask).
        row_weight: ``[N]`` the per-token weights the caller's reduction applies (the loss
            mask); None = all ones. The weight gradient is exact when the loss's incoming
            gradient is a scalar times this (module docstring); checked in the backward.
        chunk_size: tokens per chunk (bounds the live logits to ``chunk_size x V``).

    Returns:
        ``[N]`` loss, fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: shapes, dtypes or chunk_size that do not fit.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if not hidden.dtype.is_floating_point or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share one float dtype; got {hidden.dtype} and {weight.dtype}")
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"expected labels [N={hidden.shape[0]}]; got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    acc = _acc_dtype(hidden.dtype)
    if row_weight is None:
        row_weight = torch.ones(hidden.shape[0], device=hidden.device, dtype=acc)
    elif tuple(row_weight.shape) != (hidden.shape[0],):
        raise ValueError(f"expected row_weight [N={hidden.shape[0]}]; got {tuple(row_weight.shape)}")
    return _LinearCrossEntropy.apply(hidden, weight, labels, row_weight.detach().to(acc), int(chunk_size),
                                     torch.is_grad_enabled())
