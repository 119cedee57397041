"""Tests for the SSA / softmax torch reference (nemo_ssa/ops/attention/naive.py).

Everything is checked against formulas written independently here (torch.pow closed
form, hand-built bottom-right masks, per-head loops), not against the reference itself.
"""

import math

import pytest
import torch

from nemo_ssa.ops.attention.naive import (
    attention_naive,
    softmax_attention_naive,
    ssa_attention_naive,
    ssa_transform,
    visibility_mask,
)
from nemo_ssa.testing import assert_within_2x_eager, case_id, make_qkv, poison_, rel_err

F64 = torch.float64



def _params(dtype=torch.float32, n=None, b=None, requires_grad=False):
    """SSA parameters as shape-[1] tensors; random (n in [0.5, 2], b in [0.3, 1.5]) by default."""
    n = 0.5 + 1.5 * torch.rand(()).item() if n is None else n
    b = 0.3 + 1.2 * torch.rand(()).item() if b is None else b
    return (torch.tensor([n], dtype=dtype, requires_grad=requires_grad),
            torch.tensor([b], dtype=dtype, requires_grad=requires_grad))


def _bottom_right(sq, sk):
    """Independent of visibility_mask: key j visible from query i iff j - i <= sk - sq."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    return (j - i) <= (sk - sq)


def _closed_form_ssa(q, k, v, n, b, causal, scale=None):
    """w = (1 + b|s|)^(n sgn s) / sum w with torch.pow, in float64, per-head kv lookup."""
    q, k, v, n, b = (t.detach().to(F64) for t in (q, k, v, n, b))
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    kv_of = torch.tensor([h // (hq // hkv) for h in range(hq)])
    k, v = k[:, kv_of], v[:, kv_of]
    s = torch.einsum("bhid,bhjd->bhij", q, k) * (scale or 1 / math.sqrt(d))
    w = torch.pow(1 + b * s.abs(), n * torch.sign(s))
    if causal:
        w = w * _bottom_right(q.shape[2], k.shape[2])
    return torch.einsum("bhij,bhjd->bhid", w / w.sum(-1, keepdim=True), v)


# (B, Hq, Hkv, Sq, Sk, D): odd sizes, GQA, D=48, Sq < Sk (bottom-right matters)
CASES = [
    (1, 2, 2, 1, 1, 32),
    (2, 6, 2, 7, 7, 32),
    (1, 4, 1, 63, 63, 48),
    (2, 6, 2, 5, 9, 48),
    (1, 3, 3, 1, 17, 32),
]
CASE_PARAMS = [
    pytest.param(c, causal, id=case_id(c[0], c[3], c[1], c[2], c[5], causal, torch.float32, Sk=c[4]))
    for c in CASES for causal in (False, True)
]


def test_visibility_mask_bottom_right():
    assert visibility_mask(3, 3, False, "cpu") is None
    expect = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # Sq=2, Sk=4
    assert torch.equal(visibility_mask(2, 4, True, "cpu"), expect)
    expect = torch.tensor([[0, 0], [1, 0], [1, 1]], dtype=torch.bool)  # Sq=3, Sk=2: row 0 empty
    assert torch.equal(visibility_mask(3, 2, True, "cpu"), expect)
    assert torch.equal(visibility_mask(5, 5, True, "cpu"), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("case,causal", CASE_PARAMS)
def test_ssa_matches_closed_form(case, causal):
    B, Hq, Hkv, Sq, Sk, D = case
    n, b = _params()
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32)
    ref = _closed_form_ssa(q, k, v, n, b, causal)
    out32 = ssa_attention_naive(q, k, v, n, b, causal=causal)
    assert out32.dtype == torch.float32 and out32.shape == (B, Hq, Sq, D)
    assert rel_err(out32, ref) < 2e-6
    out64 = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=causal)
    assert out64.dtype == F64
    assert rel_err(out64, ref) < 1e-12


def test_custom_scale_and_first_causal_row():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, F64)
    n, b = _params(F64)
    out = ssa_attention_naive(q, k, v, n, b, causal=True, softmax_scale=0.3)
    assert rel_err(out, _closed_form_ssa(q, k, v, n, b, True, scale=0.3)) < 1e-12
    # row 0 sees only key 0: p = 1 exactly, so the output is v[..., 0, :]
    assert torch.equal(out[:, :, 0], v[:, :, 0])


def test_ssa_transform_gradients_match_formulas():
    """dz/ds = n b/(1+b|s|) (also at s=0), dz/dn = sgn log1p(b|s|), dz/db = n sgn |s|/(1+b|s|)."""
    s = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0], dtype=F64, requires_grad=True)
    n, b = _params(F64, n=1.5, b=0.8, requires_grad=True)
    z = ssa_transform(s, n, b)
    sg = torch.sign(s.detach())
    a = s.detach().abs()
    torch.testing.assert_close(z.detach(), 1.5 * sg * torch.log1p(0.8 * a), rtol=0, atol=1e-15)
    gs, = torch.autograd.grad(z.sum(), s, retain_graph=True)
    torch.testing.assert_close(gs, 1.5 * 0.8 / (1 + 0.8 * a))  # s=0 -> n*b, not 0
    gn, gb = [], []
    for i in range(5):  # per-element so a sign error cannot cancel in a sum
        dn, db = torch.autograd.grad(z[i], (n, b), retain_graph=True)
        gn.append(dn)
        gb.append(db)
    torch.testing.assert_close(torch.cat(gn), sg * torch.log1p(0.8 * a))
    torch.testing.assert_close(torch.cat(gb), 1.5 * sg * a / (1 + 0.8 * a))


GRADCHECK_CASES = [  # (Hq, Hkv, Sq, Sk, causal); Sq > Sk has fully masked rows
    pytest.param(2, 2, 5, 5, False, id="B1-T5-HQ2-HKV2-D4-full-fp64"),
    pytest.param(2, 2, 5, 5, True, id="B1-T5-HQ2-HKV2-D4-causal-fp64"),
    pytest.param(2, 1, 3, 5, True, id="B1-T3-TK5-HQ2-HKV1-D4-causal-fp64"),
    pytest.param(2, 1, 5, 3, True, id="B1-T5-TK3-HQ2-HKV1-D4-causal-fp64"),
]


@pytest.mark.parametrize("hq,hkv,sq,sk,causal", GRADCHECK_CASES)
def test_gradcheck_q_k_v_n_b(hq, hkv, sq, sk, causal):
    q, k, v = make_qkv(1, hq, hkv, sq, sk, 4, F64, requires_grad=True)
    n, b = _params(F64, requires_grad=True)

    def f(q, k, v, n, b):
        return ssa_attention_naive(q, k, v, n, b, causal=causal)

    assert torch.autograd.gradcheck(f, (q, k, v, n, b), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_softmax_with_keep_mask():
    q, k, v = make_qkv(1, 2, 1, 4, 5, 4, F64, requires_grad=True)
    keep = torch.rand(1, 2, 4, 5) > 0.4
    keep[0, 1, 2] = False  # one fully masked row
    f = lambda q, k, v: softmax_attention_naive(q, k, v, keep_mask=keep, causal=True)
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def _all_grads_finite(out, tensors):
    grads = torch.autograd.grad(out.square().sum(), tensors, allow_unused=False)
    return all(torch.isfinite(g).all() for g in grads), grads


@pytest.mark.parametrize("transform", ["ssa", "softmax"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_scores_stay_finite(transform, causal):
    q, k, v = make_qkv(2, 4, 2, 16, 16, 32, torch.float32)
    with torch.no_grad():
        q.mul_(100.0)
        k.mul_(30.0)  # std(s) = 3e3, max |s| ~ 1e4
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    kw = dict(transform=transform, causal=causal)
    tensors = [q, k, v]
    if transform == "ssa":
        n, b = _params(requires_grad=True)
        kw.update(n=n, b=b)
        tensors += [n, b]
    out = attention_naive(q, k, v, **kw)
    s_max = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)).abs().max().item() / math.sqrt(32)
    assert s_max > 5e3
    assert torch.isfinite(out).all()
    ok, _ = _all_grads_finite(out, tensors)
    assert ok


def _ssa_masking_s(q, k, v, n, b, mask):
    """Negative control: masks s (not z) before the transform."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(ssa_transform(s, n, b), -1) @ v


def test_masking_z_keeps_n_grad_finite():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, torch.float32)
    n, b = _params(requires_grad=True)
    out = ssa_attention_naive(q, k, v, n, b, causal=True)
    ok, (dn, db) = _all_grads_finite(out, [n, b])
    assert ok and dn.abs().item() > 0 and db.abs().item() > 0
    # the control shows the test can fail: masking s gives 0 * inf = NaN in dn
    bad = _ssa_masking_s(q, k, v, n, b, visibility_mask(6, 6, True))
    assert torch.isfinite(bad).all()
    dn_bad, = torch.autograd.grad(bad.square().sum(), [n])
    assert torch.isnan(dn_bad).any()


def test_keep_mask_and_causal_are_anded():
    q, k, v = make_qkv(2, 2, 2, 5, 5, 8, F64)
    n, b = _params(F64)
    keep = torch.rand(2, 1, 5, 5) > 0.3  # broadcast over heads
    keep[..., 0] = True  # every row keeps at least key 0
    out = ssa_attention_naive(q, k, v, n, b, causal=True, keep_mask=keep)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    w = torch.pow(1 + b * s.abs(), n * torch.sign(s)) * (keep & _bottom_right(5, 5))
    ref = (w / w.sum(-1, keepdim=True)) @ v
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_equals_expanded_heads(causal):
    hq, hkv, g = 6, 2, 3
    q, k, v = make_qkv(2, hq, hkv, 7, 9, 16, F64, requires_grad=True)
    n, b = _params(F64, requires_grad=True)
    gout = torch.randn(2, hq, 7, 16, dtype=F64)
    leaves = (q, k, v, n, b)

    out = ssa_attention_naive(q, k, v, n, b, causal=causal)
    grads = torch.autograd.grad(out, leaves, gout)

    # per-head loop: query head h reads kv head h // g (not h % g)
    per_head = torch.cat([
        ssa_attention_naive(q[:, h:h + 1], k[:, h // g:h // g + 1], v[:, h // g:h // g + 1], n, b, causal=causal)
        for h in range(hq)
    ], dim=1)
    grads_loop = torch.autograd.grad(per_head, leaves, gout)
    # repeat_interleave-expanded MHA
    expanded = ssa_attention_naive(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), n, b, causal=causal)
    grads_exp = torch.autograd.grad(expanded, leaves, gout)

    for other, other_grads in ((per_head, grads_loop), (expanded, grads_exp)):
        assert rel_err(out, other) < 1e-13
        for name, g1, g2 in zip("q k v n b".split(), grads, other_grads):
            assert rel_err(g1, g2) < 1e-12, name


def test_dropout_zero_is_identity_and_seeded_calls_repeat():
    q, k, v = make_qkv(2, 4, 2, 9, 9, 16, torch.float32)
    n, b = _params()
    base = ssa_attention_naive(q, k, v, n, b, causal=True)
    assert torch.equal(ssa_attention_naive(q, k, v, n, b, causal=True, dropout_p=0.0), base)
    torch.manual_seed(123)
    o1 = ssa_attention_naive(q, k, v, n, b, causal=True, dropout_p=0.25)
    torch.manual_seed(123)
    o2 = ssa_attention_naive(q, k, v, n, b, causal=True, dropout_p=0.25)
    o3 = ssa_attention_naive(q, k, v, n, b, causal=True, dropout_p=0.25)  # RNG advanced
    assert torch.equal(o1, o2)
    assert not torch.equal(o1, o3) and not torch.equal(o1, base)


def test_dropout_acts_on_probabilities_before_v():
    """With v = I (D = Sk) the output *is* the dropped p: each entry 0 or p/(1-dp)."""
    sk, dp = 8, 0.3
    q = torch.randn(1, 2, 8, 8, dtype=F64)
    k = torch.randn(1, 2, sk, 8, dtype=F64)
    v = torch.eye(sk, dtype=F64).expand(1, 2, sk, sk)
    n, b = _params(F64)
    p = ssa_attention_naive(q, k, v, n, b, causal=True)
    dropped = ssa_attention_naive(q, k, v, n, b, causal=True, dropout_p=dp)
    kept = dropped != 0
    assert 0 < kept.sum() < (p != 0).sum()
    torch.testing.assert_close(dropped[kept], p[kept] / (1 - dp), rtol=1e-12, atol=0)


def test_dropout_preserves_expectation():
    dp, reps = 0.3, 4000
    q, k, v = make_qkv(1, 2, 1, 6, 6, 4, torch.float32)
    n, b = _params()
    expect = ssa_attention_naive(q, k, v, n, b, causal=True)
    rep = lambda t: t.expand(reps, *t.shape[1:])  # one big batch of identical inputs
    samples = ssa_attention_naive(rep(q), rep(k), rep(v), n, b, causal=True, dropout_p=dp).double()
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(reps)
    assert (samples.std(0) > 0).all()  # dropout really happened everywhere
    z = (mean - expect[0].double()).abs() / (se + 1e-12)
    assert z.max() < 5.5, f"max |mean - E| = {z.max():.1f} standard errors"
    # without the 1/(1-p) rescaling the mean would be (1-p) * E: far outside the band
    z_wrong = (mean - (1 - dp) * expect[0].double()).abs() / (se + 1e-12)
    assert z_wrong.max() > 10


def test_eager_bf16_close_to_anchor_and_2x_rule():
    q, k, v = make_qkv(2, 4, 2, 33, 33, 32, torch.bfloat16)
    n, b = _params()
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=True)
    eager = ssa_attention_naive(q, k, v, n, b, causal=True, upcast=False)
    anchor_bf16 = ssa_attention_naive(q, k, v, n, b, causal=True)  # fp32 math, bf16 output
    assert eager.dtype == torch.bfloat16 and anchor_bf16.dtype == torch.bfloat16
    e = rel_err(eager, ref)
    assert 1e-4 < e < 2e-2  # bf16 rounding is visible but small
    # fp32 math rounded once to bf16 is at least as good as the eager bf16 path
    assert_within_2x_eager(anchor_bf16, eager, ref, "anchor-bf16")


def test_assert_within_2x_eager_can_fail():
    ref = torch.randn(64, dtype=F64)
    eager = ref + 1e-3 * torch.randn(64, dtype=F64)
    e = rel_err(eager, ref)
    good = ref + 1e-3 * torch.randn(64, dtype=F64)
    good = ref + (good - ref) * (1.5 * e / rel_err(good, ref))  # exactly 1.5x eager's error
    info = assert_within_2x_eager(good, eager, ref, "good", floor=0.0)
    assert info["err"] <= info["bound"]
    bad = ref + (good - ref) * (2.5 / 1.5)  # 2.5x eager's error
    with pytest.raises(AssertionError, match="bad"):
        assert_within_2x_eager(bad, eager, ref, "bad", floor=0.0)
    with pytest.raises(AssertionError):  # an output never written stays NaN
        assert_within_2x_eager(poison_(torch.empty(64)), eager, ref, "poisoned")
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0  # ref = 0 guard
    assert rel_err(torch.ones(4), torch.zeros(4)) == 2.0


@pytest.mark.parametrize("transform", ["ssa", "softmax"])
def test_fully_masked_rows_are_zero_with_finite_grads(transform):
    q, k, v = make_qkv(2, 4, 2, 7, 4, 8, torch.float32, requires_grad=True)  # rows 0..2 see nothing
    keep = torch.ones(2, 4, 7, 4, dtype=torch.bool)
    keep[1, 3, 5] = False  # plus one row emptied by keep_mask
    kw = dict(transform=transform, causal=True, keep_mask=keep)
    tensors = [q, k, v]
    if transform == "ssa":
        n, b = _params(requires_grad=True)
        kw.update(n=n, b=b)
        tensors += [n, b]
    out = attention_naive(q, k, v, **kw)
    assert torch.isfinite(out).all()
    assert (out[:, :, :3] == 0).all() and (out[1, 3, 5] == 0).all()
    assert (out[:, :, 3:].abs().sum(-1) > 0).sum() == 2 * 4 * 4 - 1
    ok, grads = _all_grads_finite(out, tensors)
    assert ok
    assert (grads[0][:, :, :3] == 0).all() and (grads[0][1, 3, 5] == 0).all()


def _bad(**over):
    q, k, v = make_qkv(1, 4, 2, 3, 5, 8, torch.float32)
    n, b = _params()
    kw = dict(q=q, k=k, v=v, transform="ssa", n=n, b=b)
    kw.update(over)
    return kw


INVALID = [
    pytest.param(dict(q=torch.randn(4, 3, 8)), "4-D", id="q-3d"),
    pytest.param(dict(k=torch.randn(1, 3, 5, 8), v=torch.randn(1, 3, 5, 8)), "multiple of kv heads", id="hq-not-multiple"),
    pytest.param(dict(v=torch.randn(1, 2, 4, 8)), "same shape", id="kv-shape"),
    pytest.param(dict(k=torch.randn(1, 2, 5, 4), v=torch.randn(1, 2, 5, 4)), "head-dim", id="head-dim"),
    pytest.param(dict(k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)), "batch", id="batch"),
    pytest.param(dict(v=torch.randn(1, 2, 5, 8, dtype=F64)), "dtype", id="dtype-mix"),
    pytest.param(dict(transform="sigmoid"), "unknown transform", id="transform-name"),
    pytest.param(dict(n=None), "needs `n`", id="n-missing"),
    pytest.param(dict(b=0.8), "torch.Tensor", id="b-python-float"),
    pytest.param(dict(n=torch.ones(2)), "shape", id="n-shape"),
    pytest.param(dict(transform="softmax"), "no `n`", id="softmax-with-n"),
    pytest.param(dict(dropout_p=1.0), "dropout_p", id="dropout-1"),
    pytest.param(dict(keep_mask=torch.ones(3, 5)), "bool", id="keep-mask-dtype"),
    pytest.param(dict(keep_mask=torch.ones(3, 4, dtype=torch.bool)), "broadcastable", id="keep-mask-shape"),
]


@pytest.mark.parametrize("over,match", INVALID)
def test_input_validation(over, match):
    with pytest.raises(ValueError, match=match):
        attention_naive(**_bad(**over))
