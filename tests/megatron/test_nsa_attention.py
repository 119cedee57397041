"""NSA as megatron-core's self-attention submodule (CPU, torch stages of the op).

Ground truths: ``nsa_attention_naive`` (tested against brute-force formulations in
tests/ops/test_nsa.py) fed with projections recomputed here from the module's weights;
megatron's own ``SelfAttention.forward`` signature; megatron's ``TransformerLayer`` and
``GPTModel`` built from the spec functions, forward and backward.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from nemo_ssa.megatron.cpu import cpu_device_shims
from nemo_ssa.megatron.nsa_attention import (
    NSASelfAttention,
    nsa_layer_spec_submodules,
    nsa_self_attention_spec,
)
from nemo_ssa.ops.nsa import NSAConfig, nsa_attention_naive

TINY = dict(block_len=4, stride=2, select_block=8, top_n=4, window=8)
S, B, HIDDEN, HEADS, GROUPS = 40, 2, 96, 6, 2  # head dim 16, GQA 3


def make_config(**overrides):
    kw = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
              use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build(config=None, **nsa):
    opts = dict(TINY)
    opts.update(nsa)
    spec = nsa_self_attention_spec(opts, impl="torch")
    return NSASelfAttention(config or make_config(), spec.submodules, layer_number=1, **spec.params)


def randomize_phi(mod, seed=0):
    """Zero-initialised w2/b2 make φ start as mean pooling; give them values so every
    compression parameter sees a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for phi in (mod.phi_k, mod.phi_v):
            for p in phi.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def hidden(seed=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, HIDDEN, generator=g).requires_grad_(requires_grad)


# ---------------------------------------------------------------------------- contract
def test_forward_signature_matches_megatron_self_attention():
    ours = list(inspect.signature(NSASelfAttention.forward).parameters)
    ref = list(inspect.signature(SelfAttention.forward).parameters)
    assert ours == ref
    init = list(inspect.signature(NSASelfAttention.__init__).parameters)
    assert init[:7] == ["self", "config", "submodules", "layer_number", "attn_mask_type", "cp_comm_type",
                        "pg_collection"]


@pytest.mark.parametrize("separate_kv", [True, False], ids=["separate_kv", "shared_kv"])
def test_matches_op_reference(megatron_cpu, separate_kv):
    mod = build(separate_kv=separate_kv).eval()
    randomize_phi(mod)
    x = hidden()
    out, bias = mod(x, None)
    assert out.shape == (S, B, HIDDEN)

    # recompute by hand from the module's weights
    w = mod.linear_qkv.weight
    mixed = x @ w.T
    if mod.linear_qkv.bias is not None:
        mixed = mixed + mod.linear_qkv.bias
    parts = torch.split(mixed, mod.split_sizes, dim=-1)
    q = parts[0].reshape(S, B, HEADS, -1).permute(1, 2, 0, 3)
    kv = [p.reshape(S, B, GROUPS, -1).permute(1, 2, 0, 3) for p in parts[1:]]
    gates = (x @ mod.linear_gate.weight.T + mod.linear_gate.bias).reshape(S, B, HEADS, 3).permute(1, 2, 0, 3)
    extra = dict(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5]) if separate_kv else {}
    o = nsa_attention_naive(q, kv[0], kv[1], gates, NSAConfig(**TINY, separate_kv=separate_kv), **extra,
                            phi_k=mod.phi_k.params(), phi_v=mod.phi_v.params())
    ref = o.permute(2, 0, 1, 3).reshape(S, B, -1) @ mod.linear_proj.weight.T
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(bias, mod.linear_proj.bias)  # returned, not added (skip_bias_add)


def test_backward_reaches_every_parameter(megatron_cpu):
    mod = build().train()
    randomize_phi(mod)
    x = hidden(requires_grad=True)
    out, bias = mod(x, None)
    (out + bias).square().mean().backward()  # the layer's bias-dropout-add adds the bias
    assert x.grad is not None and torch.isfinite(x.grad).all()
    names = {n for n, _ in mod.named_parameters()}
    assert {"phi_k.pe", "phi_k.w1", "phi_v.w2", "linear_gate.weight", "linear_gate.bias"} <= names
    for name, p in mod.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if name != "phi_k.b2":  # a uniform shift of all compressed keys: softmax-invariant, grad 0
            assert p.grad.abs().max() > 0, name


def test_parameter_sets_follow_options(megatron_cpu):
    sep = build()
    shared = build(separate_kv=False)
    mean = build(compress="mean")
    kv = GROUPS * (HIDDEN // HEADS)
    assert sep.linear_qkv.weight.shape[0] == HIDDEN + 6 * kv
    assert shared.linear_qkv.weight.shape[0] == HIDDEN + 2 * kv
    assert mean.phi_k is None and not any(n.startswith("phi_") for n, _ in mean.named_parameters())
    assert sep.phi_k.w1.shape == (TINY["block_len"] * 16, 4 * 16)  # compress_hidden default 4*D
    # zero-initialised last layer: φ starts as mean pooling
    assert sep.phi_k.w2.abs().max() == 0 and sep.phi_k.b2.abs().max() == 0


# ----------------------------------------------------------------------- in a model
def tiny_layer_spec():
    return ModuleSpec(module=TransformerLayer, submodules=nsa_layer_spec_submodules(TINY, impl="torch"))


def test_transformer_layer_forward_backward(megatron_cpu):
    cfg = make_config()
    layer = TransformerLayer(cfg, tiny_layer_spec().submodules, layer_number=1)
    assert type(layer.self_attention) is NSASelfAttention
    x = hidden(requires_grad=True)
    out = layer(x, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == (S, B, HIDDEN) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0


def test_gpt_model_forward_backward_with_rope(megatron_cpu):
    cfg = make_config(num_layers=2)
    with cpu_device_shims():
        model = GPTModel(cfg, transformer_layer_spec=tiny_layer_spec(), vocab_size=64,
                         max_sequence_length=S, position_embedding_type="rope")
        tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(S)[None].expand(B, S)
        loss = model(tokens, pos, attention_mask=None, labels=tokens)  # [B, S] per-token loss
        assert loss.shape == (B, S) and torch.isfinite(loss).all()
        loss.mean().backward()
    for i, layer in enumerate(model.decoder.layers):
        att = layer.self_attention
        assert type(att) is NSASelfAttention
        assert att.linear_qkv.weight.grad is not None and att.linear_qkv.weight.grad.abs().max() > 0, i
        assert att.linear_gate.weight.grad.abs().max() > 0, i


# ------------------------------------------------------------------- refused options
def test_bad_nsa_options_fail_when_the_spec_is_built():
    with pytest.raises(ValueError, match="compress must be one of"):
        nsa_self_attention_spec(dict(TINY, compress="max"))
    with pytest.raises(ValueError, match="unknown NSA options"):
        nsa_self_attention_spec(dict(TINY, blocklen=3))
    with pytest.raises(ValueError, match="top_n must be >= 3"):
        nsa_self_attention_spec(dict(TINY, top_n=2))
    with pytest.raises(ValueError, match="transform must be one of"):
        nsa_self_attention_spec(TINY, transform="relu")


def test_unsupported_configs_refused_at_construction(megatron_cpu):
    with pytest.raises(NotImplementedError, match="attention_dropout"):
        build(make_config(attention_dropout=0.1))
    with pytest.raises(NotImplementedError, match="context_parallel_size"):
        build(make_config(context_parallel_size=2))
    tp2 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 2), cp=None)
    spec = nsa_self_attention_spec(TINY)
    with pytest.raises(NotImplementedError, match="tensor_model_parallel_size"):
        NSASelfAttention(make_config(), spec.submodules, 1, pg_collection=tp2, nsa=TINY)
    with pytest.raises(NotImplementedError, match="attn_mask_type"):
        NSASelfAttention(make_config(), spec.submodules, 1, attn_mask_type=AttnMaskType.no_mask, nsa=TINY)


def test_unsupported_inputs_refused_at_forward(megatron_cpu):
    mod = build().eval()
    x = hidden()
    with pytest.raises(NotImplementedError, match="packed"):
        mod(x, None, packed_seq_params=object())
    with pytest.raises(NotImplementedError, match="inference"):
        mod(x, None, inference_context=object())
    with pytest.raises(NotImplementedError, match="attention_bias"):
        mod(x, None, attention_bias=torch.zeros(1))


def test_nsa_ssa_transform_trains_n(megatron_cpu):
    """``transform="ssa"`` (nsa_ssa): the SSA transform in every branch, n learnable."""
    spec = nsa_self_attention_spec(TINY, impl="torch", transform="ssa")
    mod = NSASelfAttention(make_config(), spec.submodules, layer_number=1, **spec.params)
    assert mod.n.shape == (1,) and "b" in dict(mod.named_buffers())
    out, bias = mod(hidden(), None)
    (out + bias).square().mean().backward()
    assert mod.n.grad is not None and mod.n.grad.abs().item() > 0
    softmax_out, _ = build().eval()(hidden(), None)
    assert out.shape == softmax_out.shape
