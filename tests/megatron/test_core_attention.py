"""Core attentions against megatron-core's core-attention contract.

Ground truths used here, all independent of the module under test:
 - ``attention_naive`` (the op-level reference, itself tested against closed forms in
   tests/ops) fed with tensors permuted here and SSA scalars built here;
 - megatron's own ``DotProductAttention`` (the class whose contract we implement) for the
   softmax module, including Megatron's scale rules;
 - ``inspect.signature`` of ``DotProductAttention`` for the constructor/forward keywords.
"""

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_ssa.megatron.core_attention import SoftmaxCoreAttention, SSAReferenceCoreAttention
from nemo_ssa.megatron.cpu import cpu_device_shims
from nemo_ssa.ops.attention.naive import attention_naive

SQ, B, NP, NG, HN = 8, 2, 4, 2, 16
CLASSES = [SoftmaxCoreAttention, SSAReferenceCoreAttention]
IDS = ["softmax", "ssa_reference"]


def make_config(**overrides):
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
              use_cpu_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build(cls, config=None, layer_number=1, mask=AttnMaskType.causal, **kw):
    """Construct with every contract keyword spelled out, as megatron's SelfAttention does."""
    kw.setdefault("attention_dropout", None)
    kw.setdefault("softmax_scale", None)
    kw.setdefault("cp_comm_type", None)
    kw.setdefault("pg_collection", None)
    return cls(config=config or make_config(), layer_number=layer_number, attn_mask_type=mask,
               attention_type="self", **kw)


def megatron_qkv(dtype=torch.float32, seed=0, sq=SQ, requires_grad=False):
    """query [sq, b, np, hn], key/value [sk, b, ng, hn] (not expanded for GQA)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, B, NP, HN, generator=g).to(dtype)
    k = torch.randn(sq, B, NG, HN, generator=g).to(dtype)
    v = torch.randn(sq, B, NG, HN, generator=g).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def expected(cls, q, k, v, *, causal, scale, n=1.5, b=0.8):
    """attention_naive on [b, h, s, d] views, back to Megatron's [sq, b, np*hn]."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if cls is SoftmaxCoreAttention:
        o = attention_naive(qb, kb, vb, transform="softmax", causal=causal, softmax_scale=scale)
    else:
        o = attention_naive(qb, kb, vb, transform="ssa", n=torch.tensor([n]), b=torch.tensor([b]),
                            causal=causal, softmax_scale=scale)
    return o.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def tol(dtype):
    return dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- contract
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_signature_matches_megatron_dot_product_attention(cls):
    ref_init = list(inspect.signature(DotProductAttention.__init__).parameters)
    ours_init = list(inspect.signature(cls.__init__).parameters)
    assert ref_init == ["self", "config", "layer_number", "attn_mask_type", "attention_type",
                        "attention_dropout", "softmax_scale", "cp_comm_type", "pg_collection"]
    assert ours_init[: len(ref_init)] == ref_init
    for name in ref_init[5:]:  # optional contract keywords default to None
        assert inspect.signature(cls.__init__).parameters[name].default is None
    ref_fwd = list(inspect.signature(DotProductAttention.forward).parameters)
    assert list(inspect.signature(cls.forward).parameters) == ref_fwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_forward_matches_naive(cls, mask, dtype):
    mod = build(cls, mask=mask).eval()
    q, k, v = megatron_qkv(dtype)
    out = mod(q, k, v, None)
    assert out.shape == (SQ, B, NP * HN)
    assert out.dtype == dtype
    ref = expected(cls, q, k, v, causal=mask == AttnMaskType.causal, scale=1.0 / math.sqrt(HN))
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_causal_and_no_mask_differ(cls):
    """Guards the test above: the mask type really reaches the op."""
    q, k, v = megatron_qkv()
    a = build(cls, mask=AttnMaskType.causal).eval()(q, k, v, None)
    b = build(cls, mask=AttnMaskType.no_mask).eval()(q, k, v, None)
    # the last query row sees every key either way; the first row differs
    torch.testing.assert_close(a[-1], b[-1])
    assert (a[0] - b[0]).abs().max() > 1e-3


@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
def test_softmax_matches_megatron_dot_product_attention(megatron_cpu, mask):
    cfg = make_config()
    ours = build(SoftmaxCoreAttention, cfg, mask=mask).eval()
    ref_mod = DotProductAttention(cfg, 1, mask, "self").eval()
    q, k, v = megatron_qkv()
    causal_mask = torch.ones(SQ, SQ, dtype=torch.bool).triu(1)[None, None]  # True = masked
    with cpu_device_shims():  # DotProductAttention's buffer lives on current_device()
        ref = ref_mod(q, k, v, causal_mask if mask == AttnMaskType.causal else None)
    torch.testing.assert_close(ours(q, k, v, None), ref, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- scale rules
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_default_scale_is_inverse_sqrt_head_dim(cls):
    q, k, v = megatron_qkv(torch.float64)
    out = build(cls, softmax_scale=None).eval()(q, k, v, None)
    torch.testing.assert_close(out, expected(cls, q, k, v, causal=True, scale=0.25), **tol(torch.float64))
    # the scale matters: 1.0 instead of 1/sqrt(16) gives a different output
    wrong = expected(cls, q, k, v, causal=True, scale=1.0)
    assert (out - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_explicit_softmax_scale_is_used(cls):
    q, k, v = megatron_qkv(torch.float64)
    out = build(cls, softmax_scale=0.7).eval()(q, k, v, None)
    torch.testing.assert_close(out, expected(cls, q, k, v, causal=True, scale=0.7), **tol(torch.float64))


def test_megatron_layer_scaling_leaves_the_math_unchanged(megatron_cpu):
    """Ground truth for the next test: Megatron's DotProductAttention, layer 3, with
    apply_query_key_layer_scaling divides the QK^T scale by the layer number AND multiplies
    the softmax input back by it (FusedScaleMaskSoftmax(scale=coeff)): plain 1/sqrt(hn)."""
    cfg = make_config(apply_query_key_layer_scaling=True)
    ref_mod = DotProductAttention(cfg, 3, AttnMaskType.causal, "self").eval()
    assert math.isclose(ref_mod.softmax_scale, 0.25 / 3)  # the flag is really on
    q, k, v = megatron_qkv()
    with cpu_device_shims():
        ref = ref_mod(q, k, v, torch.ones(SQ, SQ, dtype=torch.bool).triu(1)[None, None])
    torch.testing.assert_close(ref, expected(SoftmaxCoreAttention, q, k, v, causal=True, scale=0.25),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_layer_scaling_matches_megatron_semantics(cls):
    q, k, v = megatron_qkv(torch.float64)
    mod = build(cls, make_config(apply_query_key_layer_scaling=True), layer_number=3).eval()
    torch.testing.assert_close(mod(q, k, v, None), expected(cls, q, k, v, causal=True, scale=0.25),
                               **tol(torch.float64))


# ---------------------------------------------------------------------- strided inputs
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_strided_inputs_same_result_contiguous_or_not(cls):
    g = torch.Generator().manual_seed(3)
    # like megatron's split of the fused QKV projection: views into one wider tensor
    mixed = torch.randn(SQ, B, NG, (NP // NG + 2) * HN + 5, generator=g)
    k = mixed[..., (NP // NG) * HN: (NP // NG + 1) * HN]
    v = mixed[..., (NP // NG + 1) * HN: (NP // NG + 2) * HN]
    assert not k.is_contiguous() and not v.is_contiguous()
    qt = torch.randn(B, SQ, NP, HN, generator=g).transpose(0, 1)  # non-contiguous query too
    assert not qt.is_contiguous()
    ref = expected(cls, qt.contiguous(), k.contiguous(), v.contiguous(), causal=True, scale=0.25)
    for force in (True, False):
        out = build(cls, force_contiguous_qkv=force).eval()(qt, k, v, None)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_dropout_rate_and_train_eval(cls, megatron_cpu):
    cfg = make_config()  # megatron's default attention_dropout is 0.1
    assert build(cls, cfg).dropout_p == pytest.approx(cfg.attention_dropout)
    assert build(cls, cfg, attention_dropout=0.0).dropout_p == 0.0
    q, k, v = megatron_qkv()
    mod = build(cls, cfg, attention_dropout=0.5)
    train_out = mod.train()(q, k, v, None)
    eval_out = mod.eval()(q, k, v, None)
    torch.testing.assert_close(eval_out, expected(cls, q, k, v, causal=True, scale=0.25),
                               atol=2e-6, rtol=1e-5)
    assert (train_out - eval_out).abs().max() > 1e-3


# ------------------------------------------------------------------------- SSA params
def test_ssa_n_and_b_defaults():
    mod = build(SSAReferenceCoreAttention)
    params = dict(mod.named_parameters())
    buffers = dict(mod.named_buffers())
    assert list(params) == ["n"] and isinstance(mod.n, torch.nn.Parameter)
    assert mod.n.shape == (1,) and mod.n.dtype == torch.float32 and mod.n.item() == 1.5
    assert "b" in buffers and "b" not in params
    assert mod.b.shape == (1,) and mod.b.dtype == torch.float32
    assert mod.b.item() == torch.tensor(0.8, dtype=torch.float32).item()
    assert set(mod.state_dict()) == {"n", "b"}  # b is persistent

    lb = build(SSAReferenceCoreAttention, learnable_b=True)
    assert set(dict(lb.named_parameters())) == {"n", "b"}
    assert isinstance(lb.b, torch.nn.Parameter) and lb.b.shape == (1,)


def test_n_min_projects_a_learnable_n_before_each_use():
    """policy=free's ``n_min`` (the paper's "n >= 1"): an optimizer step that takes n below
    the floor is undone at the next forward (projected gradient descent), in place, with n
    still the same Parameter and its gradient still flowing; no floor, no projection."""
    mod = build(SSAReferenceCoreAttention, n_init=1.2, n_min=1.0).eval()  # eval: no dropout RNG
    n_obj = mod.n
    opt = torch.optim.SGD([mod.n], lr=1.0)
    q, k, v = megatron_qkv()
    seen = []
    for _ in range(3):
        opt.zero_grad()
        out = mod(q, k, v, None)
        seen.append(mod.n.item())
        (out.float().sum() + 5.0 * mod.n.sum()).backward()  # pushes n down by ~5 per step
        assert mod.n.grad is not None and mod.n.grad.item() > 0
        opt.step()
    assert mod.n.item() < 1.0  # the step itself is unconstrained...
    assert seen[0] == pytest.approx(1.2) and seen[1:] == [1.0, 1.0]  # ...every use is projected
    assert mod.n is n_obj and isinstance(mod.n, torch.nn.Parameter)

    free = build(SSAReferenceCoreAttention, n_init=1.2).eval()
    free.n.data.fill_(0.5)
    free(q, k, v, None)
    assert free.n.item() == 0.5
    with pytest.raises(ValueError, match="n_min must be finite and at most the initial n"):
        build(SSAReferenceCoreAttention, n_init=0.9, n_min=1.0)
    fixed = build(SSAReferenceCoreAttention, n_init=1.3, n_min=1.0, learnable_n=False)
    assert fixed._n_min is None  # a fixed n only has to start above the floor


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
@pytest.mark.parametrize("learnable_b", [False, True])
def test_ssa_scalars_stay_fp32_and_exact_through_the_half_cast(cast, learnable_b):
    """n and b -- parameters and buffers alike -- stay fp32 and exact through Megatron's
    half-precision cast, as the same Parameter objects (optimizers and DDP hooks hold
    them); their checkpointing in half models is nemo_ssa/megatron/optimizer_fixes.py's
    (tested in tests/scripts/test_parallel_cpu.py)."""
    mod = build(SSAReferenceCoreAttention, learnable_b=learnable_b, n_init=1.3)
    n_obj = mod.n
    wrapper = torch.nn.ModuleDict({"core_attention": mod, "proj": torch.nn.Linear(4, 4)})
    getattr(wrapper, cast)()
    low = torch.bfloat16 if cast == "bfloat16" else torch.float16
    assert wrapper["proj"].weight.dtype == low  # the cast did happen around it
    assert mod.n is n_obj and isinstance(mod.n, torch.nn.Parameter) and mod.n.dtype == torch.float32
    assert mod.n.item() == torch.tensor(1.3, dtype=torch.float32).item()  # not bf16's 1.296875
    assert isinstance(mod.b, torch.nn.Parameter) == learnable_b
    assert mod.b.dtype == torch.float32
    assert mod.b.item() == torch.tensor(0.8, dtype=torch.float32).item()  # not 0.80078125


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_fixed_n_buffer_survives_cast_exactly(cast):
    mod = build(SSAReferenceCoreAttention, n_init=1.3, learnable_n=False)
    getattr(mod, cast)()
    assert not isinstance(mod.n, torch.nn.Parameter) and mod.n.dtype == torch.float32
    assert mod.n.item() == torch.tensor(1.3, dtype=torch.float32).item()
    assert mod.b.item() == torch.tensor(0.8, dtype=torch.float32).item()


def test_n_receives_the_reference_gradient():
    mod = build(SSAReferenceCoreAttention).eval()
    q, k, v = megatron_qkv(torch.float64)
    w = torch.randn(SQ, B, NP * HN, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (mod(q, k, v, None) * w).sum().backward()
    assert mod.n.grad is not None and mod.n.grad.shape == (1,)

    n_ref = torch.tensor([1.5], dtype=torch.float64, requires_grad=True)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    o = attention_naive(qb, kb, vb, transform="ssa", n=n_ref, b=torch.tensor([0.8]), causal=True,
                        softmax_scale=0.25)
    (o.permute(2, 0, 1, 3).reshape(SQ, B, -1) * w).sum().backward()
    assert n_ref.grad.abs().item() > 1e-6
    torch.testing.assert_close(mod.n.grad.double(), n_ref.grad, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- unsupported options
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_context_parallel_needs_a_matching_group_and_a_causal_or_no_mask(cls):
    """CP itself runs (tests/megatron/test_parallel_attention.py); what it cannot do is refused
    at construction, naming what is supported."""
    cp2 = SimpleNamespace(tp=None, cp=SimpleNamespace(size=lambda: 2, rank=lambda: 0))
    cfg = make_config(context_parallel_size=2)
    build(cls, cfg, pg_collection=cp2)  # causal: fine
    build(cls, cfg, mask=AttnMaskType.no_mask, pg_collection=cp2)
    with pytest.raises(NotImplementedError, match="supported: causal, no_mask"):
        build(cls, cfg, mask=AttnMaskType.padding_causal, pg_collection=cp2)
    with pytest.raises(ValueError, match="context-parallel process group has 1 rank"):
        build(cls, cfg)  # no CP group of size 2 anywhere


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_tensor_parallel_splits_heads_for_every_attention(cls):
    tp2 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 2), cp=None)
    mod = build(cls, pg_collection=tp2)
    assert mod.num_heads_per_partition == NP // 2 and mod.num_groups_per_partition == NG // 2


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_cross_attention_refused(cls):
    with pytest.raises(NotImplementedError, match="attention_type"):
        cls(config=make_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
            attention_type="cross")


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_unsupported_mask_type_refused(cls):
    with pytest.raises(NotImplementedError, match="attn_mask_type"):
        build(cls, mask=AttnMaskType.causal_bottom_right)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_packed_sequences_and_bias_refused_at_forward(cls):
    from megatron.core.packed_seq_params import PackedSeqParams

    mod = build(cls).eval()
    q, k, v = megatron_qkv()
    mod(q, k, v, None)  # fine without them
    with pytest.raises(NotImplementedError, match="packed"):
        mod(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(NotImplementedError, match="attention_bias"):
        mod(q, k, v, None, attention_bias=torch.zeros(1, NP, SQ, SQ))


# ------------------------------------------------------------------- sharded state dict
def test_sharded_state_dict(megatron_cpu):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    prefix = "decoder.layers.0.self_attention.core_attention."
    ssa = build(SSAReferenceCoreAttention)
    sd = ssa.sharded_state_dict(prefix=prefix)
    assert set(sd) == {prefix + "n", prefix + "b"}
    for name in ("n", "b"):
        st = sd[prefix + name]
        assert isinstance(st, ShardedTensor) and st.key == prefix + name
        torch.testing.assert_close(st.data, getattr(ssa, name))
    assert build(SoftmaxCoreAttention).sharded_state_dict(prefix=prefix) == {}


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", ["ssa_triton", "softmax_triton", "elsa", "elsa_ssa"])
def test_deterministic_follows_megatrons_deterministic_mode_unless_set(name, monkeypatch):
    """The attention option ``deterministic`` unset: the op gets megatron's
    ``deterministic_mode``; set, it wins. The op receives it as ``deterministic=``."""
    from nemo_ssa.megatron.spec import CORE_ATTENTIONS

    cls = CORE_ATTENTIONS[name]
    assert cls.supports_deterministic
    with cpu_device_shims():
        for mode, option, want in ((False, None, False), (True, None, True), (False, True, True),
                                   (True, False, False)):
            opts = {} if option is None else {"deterministic": option}
            layer = build(cls, config=make_config(deterministic_mode=mode), kernel_options=opts,
                          attention_dropout=0.0)
            assert layer.kernel_options["deterministic"] is want, (mode, option)
    got = {}
    layer = build(cls, config=make_config(deterministic_mode=True), attention_dropout=0.0)
    monkeypatch.setattr(layer, "_attend", lambda *a, **kw: got.update(kw) or a[0])
    q, k, v = (t.permute(1, 2, 0, 3) for t in megatron_qkv())
    layer._call_op(q, k, v, causal=True, keep_mask=None, dropout_p=0.0)
    assert got["deterministic"] is True


def test_attentions_without_the_option_get_no_deterministic_keyword():
    with cpu_device_shims():
        for cls in CLASSES:
            assert not cls.supports_deterministic
            assert "deterministic" not in build(cls, config=make_config(deterministic_mode=True)).kernel_options
