"""GPU gates for the fused flash SSA/softmax kernel (marker ``gpu``; skipped without CUDA).

Run on its own (another test module may set TRITON_INTERPRET=1 for the whole session):

    pytest -m gpu tests/ops/attention/test_flash_gpu.py -q

Gates (flash-attention's rule, docs/design.md):
* bf16: rel. error of o, dq, dk, dv vs the fp32 reference <= 2x the error of the eager
  bf16 reference (``attention_naive(..., upcast=False)``) + 1e-5; dn, db within 2x the
  eager error + 1.6e-2 x sum|terms| (``assert_scalar_grad_close``).
* fp32 with IEEE dots: o <= 1e-5, dq/dk/dv <= 1e-4 relative (vs float64); dn, db within
  2e-5 x sum|terms| of each.
* dn, db bit-identical over 5 runs; torch.compile (inductor) of a module using the op.

dn and db are sums over every score of terms of both signs; at random inputs they cancel
to ~1e-3..1e-5 of sum|terms| (measured: docs/results/2026-11-24-scalar-grads.md), so a
bound relative to their own value tests the draw (a case once seen: ``dn: 2.11e-04`` in fp32,
where fp32 itself is ~1e-9 of sum|terms| off). Inputs: fresh random draws per test, the
seed derived from the test id (tests/conftest.py), so a failure reproduces.

``gpu_quick`` marks the core cases run after any kernel change
(``python scripts/device/gpu_session.py --preset quick``).
"""

import math

import pytest
import torch

from nemo_ssa.ops.common.launch import is_interpreter
from nemo_ssa.ops.attention.flash import flash_attention, flash_attention_varlen, ssa_attention_triton
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.testing import (
    assert_scalar_grad_close,
    assert_within_2x_eager,
    case_id,
    make_qkv,
    rel_err,
    ssa_scalar_grad_terms,
    ssa_scalar_grad_terms_varlen,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(is_interpreter(), reason="TRITON_INTERPRET=1 is set in this session; run this file alone"),
]
DEV = "cuda"
F64 = torch.float64


def _params(requires_grad=True):
    n = 0.5 + 1.5 * torch.rand(()).item()
    b = 0.3 + 1.2 * torch.rand(()).item()
    return (torch.tensor([n], device=DEV, requires_grad=requires_grad),
            torch.tensor([b], device=DEV, requires_grad=requires_grad))


def _leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def _grads(fn, q, k, v, n, b, transform, go, **kw):
    leaves = [q, k, v] + ([n, b] if transform == "ssa" else [])
    if transform == "ssa":
        kw.update(n=n, b=b)
    o = fn(q, k, v, transform=transform, **kw)
    return o, torch.autograd.grad(o, leaves, go)


def _free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


QUICK = pytest.mark.gpu_quick

# (B, Hq, Hkv, Sq, Sk, D, causal), transforms, marks. Triton compiles per constexpr
# combination (head dim, causal, transform, dtype) and per integer specialisation (== 1,
# divisible by 16), so the softmax twin runs only where its compiled variant adds a case.
BF16_CASES = [
    ((2, 6, 2, 1, 1, 32, True), ("ssa",), ()),
    ((2, 6, 2, 63, 63, 48, True), ("ssa",), ()),
    ((2, 6, 2, 63, 100, 32, True), ("ssa", "softmax"), (QUICK,)),
    ((1, 6, 2, 100, 63, 32, True), ("ssa",), ()),
    ((2, 8, 2, 1000, 1000, 32, False), ("ssa", "softmax"), ()),
    ((1, 4, 4, 1000, 1000, 64, True), ("ssa",), ()),
    ((1, 8, 2, 1000, 1000, 128, True), ("ssa", "softmax"), ()),
    ((2, 24, 8, 1024, 1024, 32, True), ("ssa", "softmax"), (QUICK,)),  # the model's training shape
    ((1, 24, 8, 4096, 4096, 32, True), ("ssa",), ()),  # long rows (B=1 keeps the fp32 reference small)
]
BF16_PARAMS = [pytest.param(c, tr, id=f"{tr}-" + case_id(c[0], c[3], c[1], c[2], c[5], c[6], torch.bfloat16, Sk=c[4]),
                            marks=marks)
               for c, trs, marks in BF16_CASES for tr in trs]


@pytest.mark.parametrize("case,transform", BF16_PARAMS)
def test_bf16_within_2x_eager(case, transform):
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, device=DEV, requires_grad=True)
    n, b = _params()
    go = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.bfloat16)
    o, g = _grads(flash_attention, q, k, v, n, b, transform, go, causal=causal)
    q32, k32, v32, n32, b32 = (_leaf(t, torch.float32) for t in (q, k, v, n, b))
    ref, g_ref = _grads(attention_naive, q32, k32, v32, n32, b32, transform, go.float(), causal=causal)
    del q32, k32, v32
    _free()
    qe, ke, ve, ne, be = (_leaf(t) for t in (q, k, v, n, b))
    eag, g_eag = _grads(lambda *a, **kw: attention_naive(*a, upcast=False, **kw), qe, ke, ve, ne, be,
                        transform, go, causal=causal)
    assert o.dtype == torch.bfloat16
    assert_within_2x_eager(o, eag, ref, "o")
    for name, x, e, r in zip("qkv", g[:3], g_eag[:3], g_ref[:3]):
        assert x.dtype == torch.bfloat16
        assert_within_2x_eager(x, e, r, f"d{name}")
    if transform == "ssa":  # scalar sums that cancel: 2x eager + rtol x sum|terms|
        terms = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)
        for name, x, e, r, t in zip("nb", g[3:], g_eag[3:], g_ref[3:], terms):
            assert_scalar_grad_close(f"d{name}", x, r, t, torch.bfloat16, eager=e)
    _free()


# every fp32 tile-table bucket (BLOCK_D 32/64/128/256), padded head dims, GQA/MHA,
# Sq < Sk and Sq > Sk, causal and full, N = 1
FP32_CASES = [
    ((1, 6, 2, 1, 1, 32, True), ("ssa",), ()),
    ((2, 6, 2, 63, 63, 32, True), ("ssa", "softmax"), (QUICK,)),
    ((1, 4, 2, 1000, 1000, 64, True), ("ssa", "softmax"), (QUICK,)),  # the dn case whose bound once tested the draw
    ((1, 4, 1, 300, 500, 48, True), ("ssa",), ()),
    ((1, 2, 1, 257, 257, 80, False), ("ssa",), ()),
    ((1, 2, 2, 200, 150, 96, True), ("ssa",), ()),
    ((1, 2, 1, 200, 200, 128, True), ("ssa", "softmax"), ()),
    ((1, 2, 1, 130, 130, 160, False), ("ssa",), ()),
    ((1, 2, 1, 100, 100, 256, True), ("ssa",), ()),
]


FP32_PARAMS = [pytest.param(c, tr, id=f"{tr}-" + case_id(c[0], c[3], c[1], c[2], c[5], c[6], torch.float32, Sk=c[4]),
                            marks=marks)
               for c, trs, marks in FP32_CASES for tr in trs]


@pytest.mark.parametrize("case,transform", FP32_PARAMS)
def test_fp32_ieee_tight(case, transform):
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32, device=DEV, requires_grad=True)
    n, b = _params()
    go = torch.randn(B, Hq, Sq, D, device=DEV)
    o, g = _grads(flash_attention, q, k, v, n, b, transform, go, causal=causal, input_precision="ieee")
    leaves = [_leaf(t, F64) for t in (q, k, v, n, b)]
    ref, g_ref = _grads(attention_naive, *leaves, transform, go.to(F64), causal=causal)
    assert rel_err(o, ref) <= 1e-5, f"o {rel_err(o, ref):.2e}"
    for name, x, r in zip("q k v".split(), g, g_ref):
        assert rel_err(x, r) <= 1e-4, f"d{name}: {rel_err(x, r):.2e}"
    if transform == "ssa":  # fp32 (lg2.approx included) is ~1e-8 of sum|terms| off
        for name, x, r, t in zip("nb", g[3:], g_ref[3:], ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)):
            assert_scalar_grad_close(f"d{name}", x, r, t, torch.float32)


@QUICK
def test_dn_db_bit_identical_5_runs():
    q, k, v = make_qkv(2, 24, 8, 1024, 1024, 32, torch.bfloat16, device=DEV, requires_grad=True)
    n, b = _params()
    go = torch.randn(2, 24, 1024, 32, device=DEV, dtype=torch.bfloat16)
    runs = []
    for _ in range(5):
        o = flash_attention(q, k, v, n=n, b=b, causal=True)
        runs.append(torch.autograd.grad(o, (q, k, v, n, b), go))
    for r in runs[1:]:
        assert torch.equal(r[3], runs[0][3]) and torch.equal(r[4], runs[0][4])
        for x, y in zip(r[:3], runs[0][:3]):  # no atomics anywhere: everything repeats
            assert torch.equal(x, y)


@QUICK
def test_megatron_strided_layout_and_force_contiguous():
    S, B, Hq, Hkv, D = 777, 2, 24, 8, 32
    q = torch.randn(S, B, Hq, D, device=DEV, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    k = torch.randn(S, B, Hkv, D, device=DEV, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    v = torch.randn(S, B, Hkv, D, device=DEV, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    q, k, v = (_leaf(t) for t in (q, k, v))
    n, b = _params()
    go = torch.randn(S, B, Hq, D, device=DEV, dtype=torch.bfloat16).permute(1, 2, 0, 3)
    o, g = _grads(flash_attention, q, k, v, n, b, "ssa", go, causal=True)
    assert o.permute(2, 0, 1, 3).is_contiguous()  # o comes back in [s, b, h, d] memory order
    qc, kc, vc = (_leaf(t.contiguous()) for t in (q, k, v))
    oc, gc = _grads(flash_attention, qc, kc, vc, n, b, "ssa", go.contiguous(), causal=True)
    assert rel_err(o, oc) < 1e-3
    for x, y in zip(g, gc):
        assert rel_err(x, y) < 1e-2
    of = flash_attention(q, k, v, n=n, b=b, causal=True, force_contiguous_qkv=True)
    assert rel_err(of, oc) < 1e-3


@QUICK
def test_varlen_matches_dense_kernel():
    lens = [1, 63, 1000, 517]
    Hq, Hkv, D = 8, 2, 64
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    T = sum(lens)
    q = torch.randn(T, Hq, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, Hkv, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, Hkv, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    n, b = _params()
    o = flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), n=n, b=b, causal=True)
    go = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v, n, b), go)
    leaves = [_leaf(t, torch.float32) for t in (q, k, v, n, b)]
    outs = []
    for i in range(len(lens)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        outs.append(attention_naive(*(t[sl].transpose(0, 1)[None] for t in leaves[:3]),
                                    n=leaves[3], b=leaves[4], causal=True)[0].transpose(0, 1))
    ref = torch.cat(outs)
    g_ref = torch.autograd.grad(ref, leaves, go.float())
    assert rel_err(o, ref) < 1e-2
    for name, x, r in zip("q k v".split(), g, g_ref):
        assert rel_err(x, r) < 2e-2, name
    terms = ssa_scalar_grad_terms_varlen(q, k, v, n, b, go, cu, cu, causal=True)
    for name, x, r, t in zip("nb", g[3:], g_ref[3:], terms):
        assert_scalar_grad_close(f"d{name}", x, r, t, torch.bfloat16)


def test_dropout_mask_read_back_gpu():
    B, Hq, Hkv, S, dp = 2, 8, 2, 128, 0.2
    q, k, _ = make_qkv(B, Hq, Hkv, S, S, 128, torch.float32, device=DEV, requires_grad=True)
    n, b = _params()
    eye = torch.eye(S, device=DEV).expand(B, Hkv, S, S)[..., :128]
    with torch.no_grad():
        p = flash_attention(q, k, eye, n=n, b=b, causal=True)
        pd = flash_attention(q, k, eye, n=n, b=b, causal=True, dropout_p=dp, dropout_seed=7)
    vis = p > 0
    keep = (pd != 0) & vis
    frac = 1 - keep.sum().item() / vis.sum().item()
    assert abs(frac - dp) < 5 * math.sqrt(dp * (1 - dp) / vis.sum().item())
    torch.testing.assert_close(pd[keep], p[keep] / (1 - dp), rtol=1e-5, atol=1e-7)
    # backward regenerates the same mask: compare with a torch reference using it
    v = torch.randn(B, Hkv, S, 128, device=DEV, requires_grad=True)
    go = torch.randn(B, Hq, S, 128, device=DEV)
    o = flash_attention(q, k, v, n=n, b=b, causal=True, dropout_p=dp, dropout_seed=7)
    g = torch.autograd.grad(o, (q, k, v, n, b), go)
    leaves = [_leaf(t, F64) for t in (q, k, v, n, b)]
    e64 = torch.eye(S, device=DEV, dtype=F64).expand(B, Hkv, S, S)
    pr = attention_naive(leaves[0], leaves[1], e64, n=leaves[3], b=leaves[4], causal=True)
    ref = (pr * keep.to(F64) / (1 - dp)) @ leaves[2].repeat_interleave(Hq // Hkv, 1)
    g_ref = torch.autograd.grad(ref, leaves, go.to(F64))
    assert rel_err(o, ref) < 1e-5
    for name, x, r in zip("q k v".split(), g, g_ref):
        assert rel_err(x, r) < 1e-4, name
    terms = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True, keep=keep, dropout_p=dp)
    for name, x, r, t in zip("nb", g[3:], g_ref[3:], terms):
        assert_scalar_grad_close(f"d{name}", x, r, t, torch.float32)


@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_huge_logits_finite_gpu(transform):
    q, k, v = make_qkv(2, 8, 2, 512, 512, 64, torch.bfloat16, device=DEV)
    with torch.no_grad():
        q.mul_(100.0)
        k.mul_(30.0)
    q, k, v = (_leaf(t) for t in (q, k, v))
    n, b = _params()
    go = torch.randn(2, 8, 512, 64, device=DEV, dtype=torch.bfloat16)
    o, g = _grads(flash_attention, q, k, v, n, b, transform, go, causal=True)
    assert torch.isfinite(o).all() and all(torch.isfinite(x).all() for x in g)


def test_torch_compile_inductor():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 3 * 64, device=DEV, dtype=torch.bfloat16)
            self.n = torch.nn.Parameter(torch.tensor([1.5], device=DEV))
            self.register_buffer("b", torch.tensor([0.8], device=DEV))

        def qkv(self, x):  # x [s, b, h*d] like Megatron
            s, bsz, _ = x.shape
            qkv = self.proj(x).view(s, bsz, 3, 4, 16)
            return [qkv[:, :, i].permute(1, 2, 0, 3) for i in range(3)]  # strided views

        def forward(self, x):
            return ssa_attention_triton(*self.qkv(x), self.n, self.b, causal=True).float().square().mean()

    torch.manual_seed(0)
    eager = Block()
    comp = Block()
    comp.load_state_dict(eager.state_dict())
    x = torch.randn(300, 2, 64, device=DEV, dtype=torch.bfloat16)
    le = eager(x)
    le.backward()
    cm = torch.compile(comp, fullgraph=True)
    lc = cm(x)
    lc.backward()
    assert rel_err(lc, le) < 1e-2
    assert rel_err(comp.proj.weight.grad, eager.proj.weight.grad) < 2e-2
    # dn: a cancelling sum, bounded by its sum|terms| (go = d mean(o^2) / do = 2 o / numel)
    with torch.no_grad():
        q, k, v = eager.qkv(x)
        o = ssa_attention_triton(q, k, v, eager.n, eager.b, causal=True).float()
        tn, _ = ssa_scalar_grad_terms(q, k, v, eager.n, eager.b, 2 * o / o.numel(), causal=True)
    assert_scalar_grad_close("dn compiled vs eager", comp.n.grad, eager.n.grad, tn, torch.bfloat16)


# ---- single-pass backward (NEMO_SSA_BWD=atomic|auto): dq by atomics, dn from C ------------
# The pinned policy trains n and fixes b: that is the case the single pass serves for SSA
# (softmax takes it always). b needs no gradient below; n does.

SINGLE_BF16 = [
    pytest.param((2, 6, 2, 63, 100, 32, True), marks=QUICK, id="B2-Sq63-Sk100-H6/2-D32-causal"),
    pytest.param((2, 24, 8, 1024, 1024, 32, True), marks=QUICK, id="B2-N1024-H24/8-D32-causal"),
    pytest.param((1, 6, 2, 100, 63, 32, True), id="B1-Sq100-Sk63-H6/2-D32-causal"),
    pytest.param((2, 8, 2, 1000, 1000, 32, False), id="B2-N1000-H8/2-D32-full"),
    pytest.param((1, 4, 4, 1000, 1000, 64, True), id="B1-N1000-H4/4-D64-causal"),
    pytest.param((1, 8, 2, 1000, 1000, 128, True), id="B1-N1000-H8/2-D128-causal"),
]


def _grads_n_only(fn, q, k, v, n, b, go, **kw):
    o = fn(q, k, v, transform="ssa", n=n, b=b, **kw)
    return o, torch.autograd.grad(o, [q, k, v, n], go)


@pytest.mark.parametrize("case", SINGLE_BF16)
def test_single_pass_bf16_within_2x_eager(monkeypatch, case):
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, device=DEV, requires_grad=True)
    n, b = _params()
    b = b.detach()
    go = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.bfloat16)
    o, g = _grads_n_only(flash_attention, q, k, v, n, b, go, causal=causal)
    q32, k32, v32, n32 = (_leaf(t, torch.float32) for t in (q, k, v, n))
    ref, g_ref = _grads_n_only(attention_naive, q32, k32, v32, n32, b, go.float(), causal=causal)
    del q32, k32, v32
    _free()
    qe, ke, ve, ne = (_leaf(t) for t in (q, k, v, n))
    eag, g_eag = _grads_n_only(lambda *a, **kw: attention_naive(*a, upcast=False, **kw), qe, ke, ve, ne, b, go,
                               causal=causal)
    assert_within_2x_eager(o, eag, ref, "o")
    for name, x, e, r in zip("qkv", g[:3], g_eag[:3], g_ref[:3]):
        assert x.dtype == torch.bfloat16
        assert_within_2x_eager(x, e, r, f"d{name}")
    tn, _ = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)
    assert_scalar_grad_close("dn", g[3], g_ref[3], tn, torch.bfloat16, eager=g_eag[3])
    _free()


@pytest.mark.parametrize("case", [pytest.param((2, 6, 2, 63, 63, 32, True), marks=QUICK, id="N63-D32-causal"),
                                  pytest.param((1, 4, 2, 1000, 1000, 64, True), marks=QUICK, id="N1000-D64-causal"),
                                  pytest.param((1, 2, 1, 257, 257, 80, False), id="N257-D80-full"),
                                  pytest.param((1, 2, 1, 100, 100, 256, True), id="N100-D256-causal")])
def test_single_pass_fp32_ieee_tight(monkeypatch, case):
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32, device=DEV, requires_grad=True)
    n, b = _params()
    b = b.detach()
    go = torch.randn(B, Hq, Sq, D, device=DEV)
    o, g = _grads_n_only(flash_attention, q, k, v, n, b, go, causal=causal, input_precision="ieee")
    leaves = [_leaf(t, F64) for t in (q, k, v, n)]
    ref, g_ref = _grads_n_only(attention_naive, *leaves, b.to(F64), go.to(F64), causal=causal)
    assert rel_err(o, ref) <= 1e-5, f"o {rel_err(o, ref):.2e}"
    for name, x, r in zip("q k v".split(), g, g_ref):
        assert rel_err(x, r) <= 1e-4, f"d{name}: {rel_err(x, r):.2e}"
    tn, _ = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)
    assert_scalar_grad_close("dn", g[3], g_ref[3], tn, torch.float32)


@QUICK
def test_single_pass_dn_dk_dv_bit_identical_5_runs(monkeypatch):
    """dq is summed by atomics (order varies: equal to fp32 rounding); dk, dv and dn are
    written without atomics and must repeat bit for bit."""
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    q, k, v = make_qkv(2, 24, 8, 1024, 1024, 32, torch.bfloat16, device=DEV, requires_grad=True)
    n, b = _params()
    b = b.detach()
    go = torch.randn(2, 24, 1024, 32, device=DEV, dtype=torch.bfloat16)
    runs = [_grads_n_only(flash_attention, q, k, v, n, b, go, causal=True)[1] for _ in range(5)]
    for r in runs[1:]:
        assert torch.equal(r[1], runs[0][1]) and torch.equal(r[2], runs[0][2]) and torch.equal(r[3], runs[0][3])
        assert rel_err(r[0], runs[0][0]) < 1e-2
    monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
    det = [_grads_n_only(flash_attention, q, k, v, n, b, go, causal=True)[1] for _ in range(2)]
    for x, y in zip(*det):
        assert torch.equal(x, y)
    for name, x, y in zip("qkv", runs[0][:3], det[0][:3]):  # the two schedules agree
        assert rel_err(x, y) < 1e-2, name
