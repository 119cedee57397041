"""nemo_ssa.testing: the sum-|terms| helpers compute the terms of dn/db (their signed sums
equal autograd's dn, db in fp64) for every layout the tests use -- dense causal, attention
masks, packed varlen and the three gated NSA branches -- so a bound scaled by them is
neither vacuous nor too tight."""

import math

import torch

from nemo_ssa.ops.nsa import NSAConfig, nsa_attention_naive
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.testing import (
    assert_scalar_grad_close,
    nsa_scalar_grad_terms,
    ssa_scalar_grad_terms,
    ssa_scalar_grad_terms_varlen,
)

F64 = torch.float64


def _nb(n=1.3, b=0.7):
    return torch.tensor([n], dtype=F64, requires_grad=True), torch.tensor([b], dtype=F64, requires_grad=True)


def _check(sums, dn, db):
    tn, tb, sn, sb = sums
    assert math.isclose(sn, dn.item(), rel_tol=1e-9, abs_tol=1e-12 * tn), (sn, dn.item())
    assert math.isclose(sb, db.item(), rel_tol=1e-9, abs_tol=1e-12 * tb), (sb, db.item())
    assert abs(sn) <= tn and abs(sb) <= tb and tn > 0 and tb > 0


def test_dense_causal_gqa_and_mask_terms_sum_to_autograd():
    q, k, v = torch.randn(2, 6, 9, 8, dtype=F64), torch.randn(2, 2, 11, 8, dtype=F64), torch.randn(2, 2, 11, 8, dtype=F64)
    go = torch.randn(2, 6, 9, 8, dtype=F64)
    keep = torch.rand(2, 1, 9, 11) > 0.4
    for kw in (dict(causal=True), dict(causal=False, softmax_scale=0.3), dict(causal=True, mask=keep)):
        n, b = _nb()
        o = attention_naive(q, k, v, n=n, b=b, causal=kw["causal"], softmax_scale=kw.get("softmax_scale"),
                            keep_mask=kw.get("mask"))
        dn, db = torch.autograd.grad(o, (n, b), go)
        _check(ssa_scalar_grad_terms(q, k, v, n, b, go, return_sums=True, **kw), dn, db)


def test_varlen_terms_sum_to_autograd():
    lens = [3, 1, 7]
    cu = torch.tensor([0, 3, 4, 11])
    q, k, v, go = (torch.randn(11, h, 8, dtype=F64) for h in (4, 2, 2, 4))
    n, b = _nb()
    outs = [attention_naive(*(t[cu[i]:cu[i + 1]].transpose(0, 1)[None] for t in (q, k, v)), n=n, b=b,
                            causal=True)[0].transpose(0, 1) for i in range(len(lens))]
    dn, db = torch.autograd.grad(torch.cat(outs), (n, b), go)
    _check(ssa_scalar_grad_terms_varlen(q, k, v, n, b, go, cu, cu, causal=True, return_sums=True), dn, db)


def test_nsa_terms_sum_to_autograd():
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=4, window=8, compress="mean")
    q = torch.randn(1, 6, 21, 8, dtype=F64)
    kv = {name: torch.randn(1, 2, 21, 8, dtype=F64) for name in ("k", "v", "k_slc", "v_slc", "k_win", "v_win")}
    gates = torch.randn(1, 6, 21, 3, dtype=F64)
    n, b = _nb()
    o, aux = nsa_attention_naive(q, kv["k"], kv["v"], gates, cfg, k_slc=kv["k_slc"], v_slc=kv["v_slc"],
                                 k_win=kv["k_win"], v_win=kv["v_win"], transform="ssa", n=n, b=b, return_aux=True)
    do = torch.randn_like(o)
    dn, db = torch.autograd.grad(o, (n, b), do)
    sums = nsa_scalar_grad_terms(q, gates, cfg, n, b, do, aux, k_slc=kv["k_slc"], v_slc=kv["v_slc"],
                                 k_win=kv["k_win"], v_win=kv["v_win"], return_sums=True)
    _check(sums, dn, db)


def test_scalar_grad_bound_fails_an_error_of_a_fraction_of_the_terms():
    """Negative control of the bound itself: 1e-3 of sum|terms| off fails at fp32 rtol."""
    ref = torch.tensor([0.01], dtype=F64)
    assert_scalar_grad_close("dn", ref + 1e-6, ref, 1.0, torch.float32)
    try:
        assert_scalar_grad_close("dn", ref + 1e-3, ref, 1.0, torch.float32)
    except AssertionError as e:
        assert "dn" in str(e)
    else:
        raise AssertionError("1e-3 of sum|terms| passed the fp32 bound")


def test_vector_grad_terms_bound_the_gradients_elementwise():
    """|dq|, |dk|, |dv| <= their |terms| arrays (elementwise), for SSA and softmax, GQA,
    causal and masked: the arrays are upper bounds of the right sums (and not 0)."""
    from nemo_ssa.testing import attention_grad_terms

    q, k, v = torch.randn(2, 6, 9, 8, dtype=F64), torch.randn(2, 2, 11, 8, dtype=F64), torch.randn(2, 2, 11, 8, dtype=F64)
    go = torch.randn(2, 6, 9, 8, dtype=F64)
    keep = torch.rand(2, 1, 9, 11) > 0.3
    for tr in ("ssa", "softmax"):
        n, b = _nb()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kw = dict(n=n, b=b) if tr == "ssa" else {}
        o = attention_naive(*leaves, transform=tr, causal=True, keep_mask=keep, **kw)
        grads = torch.autograd.grad(o, leaves, go)
        t = attention_grad_terms(q, k, v, go, transform=tr, causal=True, mask=keep, arrays=True, **kw)
        for name, g in zip(("dq", "dk", "dv"), grads):
            assert (g.abs() <= t[name] * (1 + 1e-9) + 1e-12).all(), (tr, name)
            assert t[name].norm() > 0 and t[name].norm() < 20 * g.norm() + 1, (tr, name)


def test_nsa_vector_terms_bound_dq():
    from nemo_ssa.testing import nsa_grad_terms

    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=4, window=8, compress="mean")
    q = torch.randn(1, 6, 21, 8, dtype=F64, requires_grad=True)
    k, v = (torch.randn(1, 2, 21, 8, dtype=F64, requires_grad=True) for _ in range(2))
    gates = torch.randn(1, 6, 21, 3, dtype=F64)
    o, aux = nsa_attention_naive(q, k, v, gates, cfg, return_aux=True)
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    t = nsa_grad_terms(q, gates, cfg, do, aux, k=k, v=v, k_slc=k, v_slc=v, k_win=k, v_win=v, transform="softmax")
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert 0 < g.norm().item() <= t[name] * (1 + 1e-9), (name, g.norm().item(), t[name])
