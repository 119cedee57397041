"""NSA as megatron-core's self-attention submodule (CPU, torch stages of the op).

``attention=nsa`` and ``attention=nsa_ssa`` (the same module with ``transform="ssa"``)
share every case that applies to both. Ground truths: ``nsa_attention_naive`` (tested
against brute-force formulations in tests/ops/nsa/test_nsa.py) fed with projections
recomputed here from the module's weights; megatron's own ``SelfAttention.forward``
signature; megatron's ``TransformerLayer`` and ``GPTModel`` built from the spec
functions, forward and backward; the SSA core attentions' n / b conventions.
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

from nemo_ssa.megatron.core_attention import SSAReferenceCoreAttention
from nemo_ssa.megatron.cpu import cpu_device_shims
from nemo_ssa.megatron.introspect import no_weight_decay_cond, ssa_values
from nemo_ssa.megatron.nsa_attention import (
    NSASelfAttention,
    nsa_layer_spec_submodules,
    nsa_self_attention_spec,
)
from nemo_ssa.ops.nsa import NSAConfig, nsa_attention_naive

TINY = dict(block_len=4, stride=2, select_block=8, top_n=4, window=8)
S, B, HIDDEN, HEADS, GROUPS = 40, 2, 96, 6, 2  # head dim 16, GQA 3
TRANSFORMS = ["softmax", "ssa"]
TRANSFORM_IDS = ["nsa", "nsa_ssa"]
N_TEST = 1.3  # a non-default n, so a forward that ignored n would fail the reference


def make_config(**overrides):
    kw = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
              use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build(config=None, transform="softmax", ssa=None, **nsa):
    opts = dict(TINY)
    opts.update(nsa)
    spec = nsa_self_attention_spec(opts, impl="torch", transform=transform, ssa=ssa)
    return NSASelfAttention(config or make_config(), spec.submodules, layer_number=1, **spec.params)


def ssa_kwargs(mod):
    """The op's SSA arguments for a module (nothing for plain NSA)."""
    return dict(transform="ssa", n=mod.n, b=mod.b) if mod.transform == "ssa" else {}


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


@pytest.mark.parametrize("transform", TRANSFORMS, ids=TRANSFORM_IDS)
@pytest.mark.parametrize("separate_kv", [True, False], ids=["separate_kv", "shared_kv"])
def test_matches_op_reference(megatron_cpu, separate_kv, transform):
    mod = build(separate_kv=separate_kv, transform=transform).eval()
    randomize_phi(mod)
    if transform == "ssa":
        with torch.no_grad():
            mod.n.fill_(N_TEST)
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
                            phi_k=mod.phi_k.params(), phi_v=mod.phi_v.params(), **ssa_kwargs(mod))
    ref = o.permute(2, 0, 1, 3).reshape(S, B, -1) @ mod.linear_proj.weight.T
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(bias, mod.linear_proj.bias)  # returned, not added (skip_bias_add)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=TRANSFORM_IDS)
def test_backward_reaches_every_parameter(megatron_cpu, transform):
    mod = build(transform=transform).train()
    randomize_phi(mod)
    x = hidden(requires_grad=True)
    out, bias = mod(x, None)
    (out + bias).square().mean().backward()  # the layer's bias-dropout-add adds the bias
    assert x.grad is not None and torch.isfinite(x.grad).all()
    names = {n for n, _ in mod.named_parameters()}
    assert {"phi_k.pe", "phi_k.w1", "phi_v.w2", "linear_gate.weight", "linear_gate.bias"} <= names
    assert ("n" in names) == (transform == "ssa")
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



# ------------------------------------------------------------- nsa_ssa: n and b
def ssa_reference_core(config=None, **kw):
    return SSAReferenceCoreAttention(config or make_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self", **kw)


def test_nsa_ssa_scalars_follow_the_ssa_core_attentions(megatron_cpu):
    """Same names, shapes, dtypes, persistence and Megatron attributes as ssa_reference's
    n / b, also after Megatron's bf16 cast (both stay exact fp32)."""
    mod, core = build(transform="ssa"), ssa_reference_core()
    assert mod.transform == "ssa" and build().n is None and build().b is None
    for ours, theirs in ((mod, core), (mod.bfloat16(), core.bfloat16())):
        for name in ("n", "b"):
            a, b_ = getattr(ours, name), getattr(theirs, name)
            assert type(a) is type(b_), name  # n: Parameter, b: buffer
            assert (a.shape, a.dtype) == (b_.shape, b_.dtype) and torch.equal(a, b_), name
    assert mod.n.dtype == torch.float32 and mod.linear_qkv.weight.dtype == torch.bfloat16
    assert mod.b.dtype == torch.float32 and mod.b.item() == torch.tensor(0.8).item()  # exact, not 0.80078125
    assert [k for k in mod.state_dict() if k in ("n", "b")] == ["n", "b"]  # b persistent
    assert mod.n.sequence_parallel is False and mod.n.tensor_model_parallel is False
    assert no_weight_decay_cond("decoder.layers.0.self_attention.n", mod.n)


def test_nsa_ssa_learnable_options(megatron_cpu):
    fixed_n = build(transform="ssa", ssa=dict(learnable_n=False, n=2.0))
    assert "n" not in dict(fixed_n.named_parameters()) and fixed_n.n.item() == 2.0
    assert "n" in fixed_n.state_dict()
    learn_b = build(transform="ssa", ssa=dict(learnable_b=True, b=0.5))
    assert isinstance(learn_b.b, torch.nn.Parameter) and learn_b.b.item() == 0.5
    out, bias = learn_b(hidden(), None)
    (out + bias).square().mean().backward()
    for p in (learn_b.n, learn_b.b):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().item() > 0


def test_nsa_ssa_n_min_projects_n_at_the_forward(megatron_cpu):
    """policy=free's ``n_min`` reaches NSA's SSA scalars through the spec, as the core
    attentions': n below the floor is projected back when the layer next runs."""
    mod = build(transform="ssa", ssa=dict(n=1.2, n_min=1.0))
    mod.n.data.fill_(0.7)  # as an optimizer step could leave it
    mod(hidden(), None)
    assert mod.n.item() == 1.0
    plain = build(transform="ssa")
    plain.n.data.fill_(0.7)
    plain(hidden(), None)
    assert plain.n.item() == pytest.approx(0.7)


def test_nsa_ssa_refuses_unsupported_combos(megatron_cpu):
    with pytest.raises(ValueError, match="b must be > 0"):
        nsa_self_attention_spec(TINY, transform="ssa", ssa=dict(b=0.0))
    with pytest.raises(ValueError, match="b must be > 0"):
        NSASelfAttention(make_config(), None, 1, nsa=TINY, transform="ssa", b_init=-1.0)
    with pytest.raises(ValueError, match=r"attention=nsa: SSA options \['n'\] need transform='ssa'"):
        nsa_self_attention_spec(TINY, ssa=dict(n=1.5))
    with pytest.raises(ValueError, match="unknown SSA options"):
        nsa_self_attention_spec(TINY, transform="ssa", ssa=dict(temperature=2.0))
    with pytest.raises(NotImplementedError, match="attention=nsa_ssa: force_contiguous_qkv=False"):
        build(transform="ssa", ssa=dict(force_contiguous_qkv=False))
    with pytest.raises(NotImplementedError, match="attention=nsa_ssa: attention_dropout"):
        build(make_config(attention_dropout=0.1), transform="ssa")
    tp2 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 2), cp=None)
    with pytest.raises(NotImplementedError, match="attention=nsa_ssa: tensor_model_parallel_size=2.*SSA parameters"):
        NSASelfAttention(make_config(), None, 1, pg_collection=tp2, nsa=TINY, transform="ssa")


# --------------------------------------------- nsa_ssa through layer_spec, in a GPT
def gpt_from_layer_spec(attention, **options):
    from nemo_ssa.megatron.spec import layer_spec

    cfg = make_config(num_layers=2)
    torch.manual_seed(0)
    with cpu_device_shims():
        spec = layer_spec(cfg, attention=attention, attention_options=dict(TINY, **options), policy="free")
        return GPTModel(cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=S,
                        position_embedding_type="rope")


def test_layer_spec_builds_nsa_ssa_with_one_n_per_layer(megatron_cpu):
    nsa, nsa_ssa = gpt_from_layer_spec("nsa"), gpt_from_layer_spec("nsa_ssa")
    soft, ssa = dict(nsa.named_parameters()), dict(nsa_ssa.named_parameters())
    extra = set(ssa) - set(soft)
    assert extra == {f"decoder.layers.{i}.self_attention.n" for i in range(2)}
    assert set(soft) <= set(ssa) and all(ssa[k].shape == soft[k].shape for k in soft)
    assert sum(p.numel() for p in ssa.values()) - sum(p.numel() for p in soft.values()) == len(extra)
    for i, layer in enumerate(nsa_ssa.decoder.layers):
        att = layer.self_attention
        assert type(att) is NSASelfAttention and att.transform == "ssa" and att.nsa.window == TINY["window"]
        assert att.n.item() == 1.5 and att.b.item() == pytest.approx(0.8)  # the SSA policy's values
        assert nsa.decoder.layers[i].self_attention.transform == "softmax"
    assert all(no_weight_decay_cond(k, ssa[k]) for k in extra)
    assert ssa_values(nsa_ssa)["n"] == {1: 1.5, 2: 1.5} and ssa_values(nsa) == {"n": {}, "b": {}}
    # policy=free lets the SSA options through
    custom = gpt_from_layer_spec("nsa_ssa", n=2.0, learnable_b=True)
    assert ssa_values(custom)["n"] == {1: 2.0, 2: 2.0}
    assert "decoder.layers.0.self_attention.b" in dict(custom.named_parameters())
    with pytest.raises(NotImplementedError, match="'nsa_ssa' is marked experimental"):
        from nemo_ssa.megatron.spec import layer_spec

        layer_spec(make_config(), attention="nsa_ssa")


def test_nsa_ssa_gpt_forward_backward_reaches_n(megatron_cpu):
    model = gpt_from_layer_spec("nsa_ssa")
    with cpu_device_shims():
        tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(S)[None].expand(B, S)
        loss = model(tokens, pos, attention_mask=None, labels=tokens)
        assert torch.isfinite(loss).all()
        loss.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for layer in model.decoder.layers:
        assert layer.self_attention.n.grad.abs().item() > 0


def test_warmup_runs_nsa_without_touching_parameters(megatron_cpu):
    """The pre-step-0 warm-up (``warmup_attention``) also runs NSA self-attention (it has no
    core attention): forward+backward once per distinct (type, transform), parameters
    frozen meanwhile (no grad, so no DDP hook fires), requires_grad restored."""
    from nemo_ssa.train.warmup import warmup_attention

    model = gpt_from_layer_spec("nsa_ssa")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    reached = []  # a DDP grad hook would fire where these do
    for k, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, k=k: reached.append(k))
    with cpu_device_shims():
        warmed = warmup_attention(model, {"tokens": torch.zeros(B, S, dtype=torch.long)})
    assert warmed == 1  # two layers, one (type, transform)
    assert reached == []
    for k, p in model.named_parameters():
        assert p.grad is None, k
        assert p.requires_grad == flags[k], k
        assert torch.equal(p.detach(), before[k]), k
