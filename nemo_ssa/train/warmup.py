"""Warm the attentions up before step 0 (compile and autotune fused kernels on GPU)."""

from __future__ import annotations

import warnings
from typing import Dict

import torch


def warmup_attention(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> int:
    """Run one forward+backward of every distinct core attention (and NSA self-attention)
    on random inputs.

    On GPU this compiles and autotunes fused kernels before step 0. It draws random
    numbers: callers wrap it in :func:`nemo_ssa.train.rng.preserved_rng`. Gradients it
    produces are discarded. Returns how many core attentions were warmed.
    """
    from nemo_ssa.megatron.introspect import core_attentions

    seen = set()
    tokens = batch["tokens"]
    b, s = tokens.shape
    for _, mod in core_attentions(model):
        if type(mod) in seen:
            continue
        seen.add(type(mod))
        hq, hkv, d = mod.num_heads_per_partition, mod.num_groups_per_partition, mod.head_dim
        dev = tokens.device
        q = torch.randn(s, b, hq, d, device=dev, requires_grad=True)
        k = torch.randn(s, b, hkv, d, device=dev, requires_grad=True)
        v = torch.randn(s, b, hkv, d, device=dev, requires_grad=True)
        out = mod(q, k, v, None)
        out.float().sum().backward()
    # NSA replaces the whole self-attention (its kernels see the layer's projections), so
    # it is warmed through the module itself, on random hidden states. Its parameters are
    # frozen meanwhile: no gradient reaches them, so no DDP grad hook can fire.
    from nemo_ssa.megatron.nsa_attention import NSASelfAttention

    for mod in model.modules():
        if not isinstance(mod, NSASelfAttention) or (type(mod), mod.transform) in seen:
            continue
        seen.add((type(mod), mod.transform))
        params = [p for p in mod.parameters() if p.requires_grad]
        dtype = next((p.dtype for p in mod.parameters() if p.is_floating_point()), torch.float32)
        x = torch.randn(s, b, mod.config.hidden_size, device=tokens.device, dtype=dtype, requires_grad=True)
        for p in params:
            p.requires_grad_(False)
        try:
            out, _ = mod(x, None)
            out.float().sum().backward()
        except Exception as e:  # noqa: BLE001 -- warm-up only saves compile time; step 0 shows real errors
            warnings.warn(f"warm-up of {mod.attention_name} failed ({type(e).__name__}: {e}); "
                          "its kernels compile in step 0 instead")
            seen.discard((type(mod), mod.transform))
        finally:
            for p in params:
                p.requires_grad_(True)
    for p in model.parameters():
        if p.grad is not None:
            p.grad = None
    from nemo_ssa.megatron.compat import forget_ddp_grad_hooks

    forget_ddp_grad_hooks(model)  # n's hook fired above; megatron >= 0.16 would take it as step 1's pattern
    return len(seen)
