"""A tiny megatron GPT on the CPU for model-level tests of a layer spec: build it, run one
loss and backward, return the loss and every parameter's gradient (tests compare two specs
that must train the same model, e.g. a fused module against megatron's own)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def tiny_gpt(config, spec, vocab_size: int, seq: int):
    """``GPTModel(config, spec)`` with RoPE on half the head dim (the recipe's), built on the CPU."""
    from megatron.core.models.gpt import GPTModel

    from nemo_ssa.megatron.cpu import cpu_device_shims

    with cpu_device_shims():
        return GPTModel(config, transformer_layer_spec=spec, vocab_size=vocab_size, max_sequence_length=seq,
                        position_embedding_type="rope", rotary_percent=0.5)


def loss_and_grads(model, tokens: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Mean LM loss of ``tokens [b, s]`` predicting themselves, and each parameter's gradient."""
    from nemo_ssa.megatron.cpu import cpu_device_shims

    model.zero_grad(set_to_none=True)
    b, s = tokens.shape
    with cpu_device_shims():
        pos = torch.arange(s)[None].expand(b, s)
        loss = model(tokens, pos, attention_mask=None, labels=tokens).mean()
        loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(model, reference, tokens: torch.Tensor, must_touch: str, grad_rtol: float,
                               grad_atol: float = 1e-6) -> None:
    """``model`` and ``reference`` (same weights) give the same loss (1e-6) and the same
    gradient for every parameter (``grad_rtol`` / ``grad_atol``), and some parameter whose
    name contains ``must_touch`` (the module under test) received one."""
    loss_m, grads_m = loss_and_grads(model, tokens)
    loss_r, grads_r = loss_and_grads(reference, tokens)
    torch.testing.assert_close(loss_m, loss_r, rtol=1e-6, atol=1e-6)
    assert set(grads_m) == set(grads_r) and any(must_touch in n for n in grads_m), must_touch
    for name in grads_r:
        torch.testing.assert_close(grads_m[name], grads_r[name], rtol=grad_rtol, atol=grad_atol, msg=name)
