"""SDPA softmax path vs the torch reference, and the softmax reference vs torch.softmax."""

import math

import pytest
import torch
import torch.nn.functional as F

from nemo_ssa.ops.softmax import sdpa as sdpa_mod
from nemo_ssa.ops.softmax.sdpa import softmax_attention_sdpa
from nemo_ssa.ops.attention.naive import softmax_attention_naive
from nemo_ssa.testing import case_id, make_qkv, rel_err


# (B, Hq, Hkv, Sq, Sk, D)
SHAPES = [
    (2, 4, 4, 7, 7, 16),
    (1, 6, 2, 33, 33, 32),   # GQA
    (2, 6, 3, 5, 12, 8),     # Sq < Sk
    (1, 4, 2, 9, 4, 8),      # Sq > Sk: causal rows 0..4 see nothing
]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

CASES = [
    pytest.param(s, causal, use_mask, dt,
                 id=case_id(s[0], s[3], s[1], s[2], s[5], causal, dt, Sk=s[4]) + ("-keepmask" if use_mask else ""))
    for s in SHAPES for causal in (False, True) for use_mask in (False, True)
    for dt in (torch.float32, torch.float64)
]


@pytest.mark.parametrize("shape,causal,use_mask,dtype", CASES)
def test_sdpa_matches_reference(shape, causal, use_mask, dtype):
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, requires_grad=True)
    keep = None
    if use_mask:
        keep = torch.rand(B, 1, Sq, Sk) > 0.3
        keep[0, 0, Sq // 2] = False  # a row emptied by the mask alone
    kw = dict(causal=causal, keep_mask=keep, softmax_scale=0.7 / math.sqrt(D))
    out = softmax_attention_sdpa(q, k, v, **kw)
    ref = softmax_attention_naive(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, D)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    gout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), gout)
    g_ref = torch.autograd.grad(ref, (q, k, v), gout)
    for name, a, r in zip("qkv", g, g_ref):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, r) < 10 * TOL[dtype], name


def test_dispatch_uses_is_causal_only_for_square(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(sdpa_mod.F, "scaled_dot_product_attention", spy)
    q, k, v = make_qkv(1, 4, 2, 6, 6, 8, torch.float32)
    softmax_attention_sdpa(q, k, v, causal=True)
    assert calls[-1].get("is_causal") is True and calls[-1].get("attn_mask") is None
    assert calls[-1].get("enable_gqa") is True
    q2, k2, v2 = make_qkv(1, 4, 2, 3, 6, 8, torch.float32)
    softmax_attention_sdpa(q2, k2, v2, causal=True)  # Sq != Sk: SDPA's is_causal is top-left
    assert not calls[-1].get("is_causal") and calls[-1]["attn_mask"].shape[-2:] == (3, 6)


def test_sdpa_dropout_zero_and_validation():
    q, k, v = make_qkv(1, 2, 2, 5, 5, 8, torch.float32)
    assert torch.equal(softmax_attention_sdpa(q, k, v, dropout_p=0.0), softmax_attention_sdpa(q, k, v))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        softmax_attention_sdpa(q, k[:, :1].expand(1, 3, 5, 8), v[:, :1].expand(1, 3, 5, 8))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_reference_matches_torch_softmax(causal):
    B, Hq, Hkv, Sq, Sk, D = 2, 6, 2, 5, 8, 16
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float64)
    out = softmax_attention_naive(q, k, v, causal=causal)
    kv_of = torch.arange(Hq) // (Hq // Hkv)
    s = q @ k[:, kv_of].transpose(-1, -2) / math.sqrt(D)
    if causal:  # bottom-right: j <= i + Sk - Sq
        vis = torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)
        s = s.masked_fill(~vis, float("-inf"))
    ref = torch.softmax(s, dim=-1) @ v[:, kv_of]
    assert rel_err(out, ref) < 1e-13


def test_registry_table_and_unknown_names():
    from nemo_ssa.ops import available, get_attention_fn
    from nemo_ssa.ops.attention.naive import ssa_attention_naive

    assert {("softmax", "reference"), ("softmax", "sdpa"), ("ssa", "reference"), ("ssa", "triton"),
            ("softmax", "triton")} <= set(available())
    assert get_attention_fn("softmax", "sdpa") is softmax_attention_sdpa
    assert get_attention_fn("softmax", "reference") is softmax_attention_naive
    assert get_attention_fn("ssa", "reference") is ssa_attention_naive
    for exc in (KeyError, ValueError):
        with pytest.raises(exc, match=r"known: .*softmax/reference, softmax/sdpa, .*ssa/reference"):
            get_attention_fn("ssa", "flash")
