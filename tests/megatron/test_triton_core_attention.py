"""The fused Triton core attentions (ssa_triton, softmax_triton) in megatron's contract.

Runs the kernels in the Triton CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without CUDA) on tiny fp32 shapes. Ground truths: ``attention_naive`` and the unfused
``SSAReferenceCoreAttention`` / ``SoftmaxCoreAttention`` modules (tested against
megatron's own DotProductAttention in test_core_attention.py).
"""

import math

import pytest
import torch

from megatron.core.transformer.enums import AttnMaskType

from nemo_ssa.megatron.core_attention import (
    SoftmaxCoreAttention,
    SoftmaxTritonCoreAttention,
    SSAReferenceCoreAttention,
    SSATritonCoreAttention,
)
from test_core_attention import B, HN, NG, NP, SQ, build, expected, megatron_qkv

PAIRS = [(SSATritonCoreAttention, SSAReferenceCoreAttention), (SoftmaxTritonCoreAttention, SoftmaxCoreAttention)]
IDS = ["ssa_triton", "softmax_triton"]


def _expected_for(fused):
    return SoftmaxCoreAttention if fused is SoftmaxTritonCoreAttention else SSAReferenceCoreAttention


@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
@pytest.mark.parametrize("fused,ref", PAIRS, ids=IDS)
def test_forward_and_grads_match_the_unfused_module(fused, ref, mask):
    q, k, v = megatron_qkv(requires_grad=True, seed=5)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    mf, mr = build(fused, mask=mask).eval(), build(ref, mask=mask).eval()
    if hasattr(mr, "n"):
        mf.load_state_dict(mr.state_dict())
    out, out_r = mf(q, k, v, None), mr(qr, kr, vr, None)
    assert out.shape == (SQ, B, NP * HN)
    torch.testing.assert_close(out, out_r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, expected(_expected_for(fused), q.detach(), k.detach(), v.detach(),
                                             causal=mask == AttnMaskType.causal, scale=1 / math.sqrt(HN)),
                               atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    out.backward(g)
    out_r.backward(g)
    for a, b_, name in ((q, qr, "dq"), (k, kr, "dk"), (v, vr, "dv")):
        torch.testing.assert_close(a.grad, b_.grad, atol=5e-5, rtol=1e-4, msg=name)
    if hasattr(mr, "n"):
        torch.testing.assert_close(mf.n.grad, mr.n.grad, atol=1e-5, rtol=1e-4)
        assert mr.n.grad.abs().item() > 0


@pytest.mark.parametrize("fused,ref", PAIRS, ids=IDS)
def test_strided_megatron_views_without_copies(fused, ref):
    g = torch.Generator().manual_seed(3)
    mixed = torch.randn(SQ, B, NG, (NP // NG + 2) * HN + 5, generator=g)
    k = mixed[..., (NP // NG) * HN: (NP // NG + 1) * HN]
    v = mixed[..., (NP // NG + 1) * HN: (NP // NG + 2) * HN]
    q = torch.randn(B, SQ, NP, HN, generator=g).transpose(0, 1)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    want = build(ref).eval()(q, k, v, None)
    for force in (True, False):
        torch.testing.assert_close(build(fused, force_contiguous_qkv=force).eval()(q, k, v, None), want,
                                   atol=2e-5, rtol=1e-4)


def test_checkpoints_interchange_between_reference_and_triton():
    """Same parameter/buffer names: a state dict of one loads into the other, both ways."""
    ref = build(SSAReferenceCoreAttention)
    with torch.no_grad():
        ref.n.fill_(1.7)
    tri = build(SSATritonCoreAttention)
    tri.load_state_dict(ref.state_dict())
    assert tri.n.item() == pytest.approx(1.7) and set(tri.state_dict()) == set(ref.state_dict())
    back = build(SSAReferenceCoreAttention)
    back.load_state_dict(tri.state_dict())
    q, k, v = megatron_qkv(seed=9)
    torch.testing.assert_close(tri.eval()(q, k, v, None), back.eval()(q, k, v, None), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fused,ref", PAIRS, ids=IDS)
def test_packed_thd_equals_separate_sequences(fused, ref):
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [5, 8, 1]
    cu = torch.tensor([0, 5, 13, 14], dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    t = sum(lens)
    q = torch.randn(t, 1, NP, HN, generator=g)
    k = torch.randn(t, 1, NG, HN, generator=g)
    v = torch.randn(t, 1, NG, HN, generator=g)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    mod = build(fused).eval()
    out = mod(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 1, NP * HN)
    refm = build(ref).eval()
    for i in range(len(lens)):
        a, b_ = int(cu[i]), int(cu[i + 1])
        want = refm(q[a:b_], k[a:b_], v[a:b_], None)
        torch.testing.assert_close(out[a:b_], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [SSATritonCoreAttention, SoftmaxTritonCoreAttention], ids=IDS)
@pytest.mark.parametrize("mask", [AttnMaskType.padding, AttnMaskType.padding_causal, AttnMaskType.arbitrary])
def test_masked_types_refused_at_construction(fused, mask):
    with pytest.raises(NotImplementedError, match="supported: causal, no_mask"):
        build(fused, mask=mask)


def test_torch_compile_traces_a_module_using_the_kernel():
    """custom_op registration: dynamo captures the whole forward+backward in one graph."""
    mod = build(SSATritonCoreAttention).eval()
    q, k, v = megatron_qkv(seed=2, requires_grad=True)

    def step(q, k, v):
        return mod(q, k, v, None).square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)] + [mod.n.grad.clone()]
    for t in (q, k, v):
        t.grad = None
    mod.n.grad = None
    step(q, k, v).backward()
    for a, b_ in zip(grads, [t.grad for t in (q, k, v)] + [mod.n.grad]):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- experimental kernels
from nemo_ssa.megatron.core_attention import (  # noqa: E402
    ElsaCoreAttention,
    ElsaSSACoreAttention,
    SSAFlexCoreAttention,
)
from test_core_attention import make_config  # noqa: E402


@pytest.mark.parametrize("fused,ref", [(ElsaSSACoreAttention, SSAReferenceCoreAttention),
                                       (ElsaCoreAttention, SoftmaxCoreAttention)], ids=["elsa_ssa", "elsa"])
def test_elsa_two_pass_matches_the_unfused_module(fused, ref):
    q, k, v = megatron_qkv(requires_grad=True, seed=4)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    mf = build(fused, kernel_options={"num_partitions": 2}, attention_dropout=0.0).eval()
    mr = build(ref).eval()
    out, out_r = mf(q, k, v, None), mr(qr, kr, vr, None)
    torch.testing.assert_close(out, out_r, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    out.backward(g)
    out_r.backward(g)
    for a, b_ in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b_.grad, atol=5e-5, rtol=1e-4)
    if hasattr(mr, "n"):
        torch.testing.assert_close(mf.n.grad, mr.n.grad, atol=1e-5, rtol=1e-4)


def test_flex_forward_matches_the_reference_on_cpu():
    """FlexAttention has no CPU backward: forward only here (the GPU tests check grads)."""
    q, k, v = megatron_qkv(seed=6)
    with torch.no_grad():
        out = build(SSAFlexCoreAttention, attention_dropout=0.0).eval()(q, k, v, None)
        want = build(SSAReferenceCoreAttention).eval()(q, k, v, None)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cls", [SSAFlexCoreAttention, ElsaCoreAttention, ElsaSSACoreAttention],
                         ids=["ssa_flex", "elsa", "elsa_ssa"])
def test_kernels_without_dropout_refuse_it_at_construction(cls):
    with pytest.raises(NotImplementedError, match=r"attention_dropout=0.1 is not supported.*supported: 0.0"):
        build(cls, config=make_config(attention_dropout=0.1))


def test_nsa_replaces_the_self_attention_submodule(megatron_cpu):
    from nemo_ssa.megatron.nsa_attention import NSASelfAttention
    from nemo_ssa.megatron.spec import layer_spec

    cfg = make_config(num_layers=2)
    spec = layer_spec(cfg, attention="nsa", attention_options={"window": 64}, policy="free")
    sa = spec.layer_specs[0].submodules.self_attention
    assert sa.module is NSASelfAttention and sa.params["nsa"].window == 64
    with pytest.raises(NotImplementedError, match="experimental"):
        layer_spec(cfg, attention="nsa")


@pytest.mark.parametrize("cls", [SSATritonCoreAttention, SoftmaxTritonCoreAttention, ElsaCoreAttention,
                                 ElsaSSACoreAttention], ids=["ssa_triton", "softmax_triton", "elsa", "elsa_ssa"])
def test_unsupported_head_dim_refused_at_construction(cls):
    cfg = make_config(hidden_size=32, num_attention_heads=4, attention_dropout=0.0)  # head dim 8
    with pytest.raises(NotImplementedError, match=r"head dim 8 .*supported: 16 <= head dim <= 256"):
        build(cls, config=cfg)
