"""Single-pass backward of the fused attention (``NEMO_SSA_BWD=atomic``, the default
unless deterministic algorithms are requested).

The dK/dV kernel also adds ``dq`` into an fp32 buffer with atomics (no dQ kernel
recomputing ``p``), and SSA's ``dn`` comes from key-row partials of ``sum dz (smag - C_i)``
with the forward's row means ``C_i = sum_j p_ij smag_ij``. Checked here on CPU (Triton
interpreter, 16x16 tiles; programs run one after another, so even dq repeats bitwise):
against float64 references on odd shapes, GQA, causal and not, Sq != Sk, varlen, dropout;
against the two-kernel backward; the mode switch; NaN-poisoned outputs throughout (the
fp32 dq accumulator too: a row the preprocess kernel fails to zero stays NaN).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from nemo_ssa.ops.common import alloc, bwd_config, bwd_kernels, dispatch  # noqa: E402
from nemo_ssa.ops.common.bwd import attention_bwd  # noqa: E402
from nemo_ssa.ops.common import launch as launcher  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.ops.attention import flash as fl  # noqa: E402
from nemo_ssa.ops.attention.naive import attention_naive, ssa_transform  # noqa: E402
from nemo_ssa.testing import assert_scalar_grad_close, case_id, make_qkv, rel_err, ssa_scalar_grad_terms  # noqa: E402

F64 = torch.float64
DEVICE = "cpu" if is_interpreter() else "cuda"
pytestmark = pytest.mark.skipif(not (is_interpreter() or torch.cuda.is_available()),
                                reason="Triton kernels need the interpreter or CUDA")


def _single(transform, d, **kw):
    return dispatch.backward_schedule(transform, d, **kw).path == dispatch.SINGLE



@pytest.fixture(autouse=True)
def _poison_and_mode(monkeypatch):
    monkeypatch.setattr(alloc, "POISON_OUTPUTS", True)
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")


def _nb(n=None, b=None):
    n = 0.5 + 1.5 * torch.rand(()).item() if n is None else n
    b = 0.3 + 1.2 * torch.rand(()).item() if b is None else b
    return (torch.tensor([n], device=DEVICE, requires_grad=True), torch.tensor([b], device=DEVICE))


def _grads(fn, q, k, v, n, b, tr, go, **kw):
    leaves = [q, k, v] + ([n] if tr == "ssa" else [])
    if tr == "ssa":
        kw.update(n=n, b=b)
    o = fn(q, k, v, transform=tr, **kw)
    return o, torch.autograd.grad(o, leaves, go)


def _ref(q, k, v, n, b, tr, go, **kw):
    up = [t.detach().to(F64).requires_grad_() for t in (q, k, v, n)]
    return _grads(attention_naive, *up[:3], up[3], b.to(F64), tr, go.to(F64), **kw)


_REAL_LAUNCH = launcher.launch


def _launched(monkeypatch):
    """Record (kernel name, meta) of every launch (forward and backward) from now on: the
    positional ``launch`` that ``launch_kw`` ends in, with the presence flags in ``meta``."""
    got = []

    def rec(kernel, grid, args, meta, ntensors=None, cached=True):
        got.append((getattr(kernel, "__name__", str(kernel)), dict(meta)))
        return _REAL_LAUNCH(kernel, grid, args, meta, ntensors, cached)
    monkeypatch.setattr(launcher, "launch", rec)
    return got


# (B, Hq, Hkv, Sq, Sk, D, causal, transform)
CASES = [
    (1, 6, 2, 63, 63, 32, True, "ssa"),
    (1, 6, 2, 63, 63, 32, False, "ssa"),
    (2, 6, 2, 20, 45, 32, True, "ssa"),
    (1, 3, 1, 45, 20, 48, True, "ssa"),  # Sq > Sk causal: rows that see no key
    (2, 2, 1, 37, 29, 16, False, "ssa"),
    (1, 2, 1, 24, 33, 80, True, "ssa"),
    (1, 4, 2, 64, 64, 32, True, "ssa"),  # whole query blocks (EVEN_Q)
    (1, 2, 2, 1, 1, 32, True, "ssa"),
    (1, 6, 2, 63, 63, 32, True, "softmax"),
    (2, 2, 2, 33, 17, 32, False, "softmax"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c[7]}-" + case_id(c[0], c[3], c[1], c[2], c[5], c[6],
                                                                          torch.float32, Sk=c[4])) for c in CASES])
def test_single_pass_matches_fp64(monkeypatch, case):
    B, Hq, Hkv, Sq, Sk, D, causal, tr = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _nb()
    go = torch.randn(B, Hq, Sq, D, device=DEVICE)
    launches = _launched(monkeypatch)
    o, g = _grads(fl.flash_attention, q, k, v, n, b, tr, go, causal=causal)
    names = [x[0] for x in launches]
    assert "attn_bwd_kernel_dq" not in names and names.count("attn_bwd_kernel_dkv") == 1, names
    kv_meta = [m for nm, m in launches if nm == "attn_bwd_kernel_dkv"][0]
    assert kv_meta["ATOMIC_DQ"] and kv_meta["DN_KV"] == (tr == "ssa")
    ref_o, g_ref = _ref(q, k, v, n, b, tr, go, causal=causal)
    assert rel_err(o, ref_o) <= 1e-5
    for name, x, r in zip("qkv", g, g_ref):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, r) <= 1e-4, f"d{name}: {rel_err(x, r):.2e}"
    if tr == "ssa":
        tn, _ = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)
        assert_scalar_grad_close("dn", g[3], g_ref[3], tn, torch.float32)
    if causal and Sq > Sk:
        assert (g[0][:, :, :Sq - Sk] == 0).all()


def test_single_pass_equals_two_kernel_backward(monkeypatch):
    """Same forward, both backwards: dk, dv identical (same dK/dV arithmetic; bitwise under
    the interpreter, whose tiles are the same), dq and dn equal to fp32 rounding."""
    q, k, v = make_qkv(2, 6, 2, 50, 41, 32, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _nb()
    go = torch.randn(2, 6, 50, 32, device=DEVICE)
    _, single = _grads(fl.flash_attention, q, k, v, n, b, "ssa", go, causal=True)
    monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
    _, two = _grads(fl.flash_attention, q, k, v, n, b, "ssa", go, causal=True)
    for name, x, y in zip("qkvn", single, two):
        if is_interpreter() and name in "kv":
            assert torch.equal(x, y), name
        assert rel_err(x, y) <= (1e-5 if name != "n" else 1e-4), f"d{name}: {rel_err(x, y):.2e}"


def test_dn_bitwise_repeatable_and_independent_of_stored_o_rounding():
    """dn = sum dz (smag - C_i): the delta inside dz (do . o, from the *stored* o) multiplies
    sum_j p (smag - C_i) = 0, so rounding o to bf16 must not move dn (it moved the naive
    sum by 3.8e-3 of its value at this shape, attention/test_flash.py); and it repeats bitwise."""
    torch.manual_seed(0)
    Hq, Hkv, S, D = 4, 2, 70, 32
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    q, k, v, go = (bf(torch.randn(1, h, S, D)).to(DEVICE) for h in (Hq, Hkv, Hkv, Hq))
    n, b = torch.tensor([1.3], device=DEVICE), torch.tensor([0.7], device=DEVICE)
    o, M, C = fl._flash_fwd(q, k, v, n, b, None, None, None, "ssa", True, D ** -0.5, 0.0, S, S, "ieee", False,
                            save_c=True)
    runs = [attention_bwd(go, q, k, v, bf(o), M, n=n, b=b, causal=True, need_db=False, cstat=C,
                          deterministic=False) for _ in range(2)]
    assert runs[0][4] is None
    for x, y in zip(runs[0][:4], runs[1][:4]):
        assert torch.equal(x, y)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, n)]
    ref = attention_naive(*leaves[:3], n=leaves[3], b=b.to(F64), causal=True)
    dn_ref = torch.autograd.grad(ref, leaves[3], go.to(F64))[0]
    tn, _ = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True)
    assert_scalar_grad_close("dn", runs[0][3], dn_ref, tn, torch.float32)


def test_forward_row_means_c():
    """C_i = sum_j p_ij sgn(s_ij) log2(1 + b|s_ij|) (fp32, M's layout); 0 for rows that see
    no key; only written for SSA."""
    q, k, v = make_qkv(1, 4, 2, 40, 30, 32, torch.float32, device=DEVICE)
    n, b = torch.tensor([1.4], device=DEVICE), torch.tensor([0.9], device=DEVICE)
    o, M, C = fl._flash_fwd(q, k, v, n, b, None, None, None, "ssa", True, 32 ** -0.5, 0.0, 40, 30, "ieee", False,
                            save_c=True)
    assert C.shape == M.shape and C.stride() == M.stride() and C.dtype == torch.float32
    q64, k64 = q.double(), k.double().repeat_interleave(2, 1)
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(32)
    z = ssa_transform(s, n.double(), b.double())
    vis = torch.ones(40, 30, dtype=torch.bool, device=DEVICE).tril(30 - 40)
    z = z.masked_fill(~vis, float("-inf"))
    p = torch.softmax(z, -1).nan_to_num(0.0)
    smag = torch.sign(s) * torch.log2(1 + b.double() * s.abs())
    want = (p * smag).sum(-1)
    torch.testing.assert_close(C.double(), want, rtol=1e-5, atol=1e-6)
    assert (C[:, :, :10] == 0).all()  # rows 0..9 see no key (Sq - Sk = 10)
    assert fl._flash_fwd(q, k, v, None, None, None, None, None, "softmax", True, 0.2, 0.0, 40, 30, "ieee",
                         False, save_c=True)[2] is None


def test_varlen_and_dropout_single_pass(monkeypatch):
    """Packed sequences (per-sequence rows of dq and dn partials) and in-kernel dropout
    through the single pass agree with the two-kernel backward on the same forward mask."""
    lens = [5, 23, 1, 17]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 16, device=DEVICE).requires_grad_() for h in (4, 2, 2))
    n, b = _nb()
    go = torch.randn(T, 4, 16, device=DEVICE)
    out = {}
    for mode in ("atomic", "deterministic"):
        monkeypatch.setenv("NEMO_SSA_BWD", mode)
        o = fl.flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), transform="ssa", n=n, b=b,
                                      causal=True, dropout_p=0.2, dropout_seed=11)
        out[mode] = (o,) + torch.autograd.grad(o, [q, k, v, n], go)
    assert torch.equal(out["atomic"][0], out["deterministic"][0])
    for name, x, y in zip("oqkvn", out["atomic"], out["deterministic"]):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, y) <= 1e-4, f"{name}: {rel_err(x, y):.2e}"


def test_mode_selection(monkeypatch):
    q, k, v = make_qkv(1, 2, 1, 17, 17, 16, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _nb()

    def kernels():
        got = _launched(monkeypatch)
        o = fl.flash_attention(q, k, v, n=n, b=b, causal=True)
        torch.autograd.grad(o.sum(), [q, n])
        return [(nm, m.get("SAVE_C"), m.get("ATOMIC_DQ")) for nm, m in got]

    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    got = kernels()
    assert ("_attn_fwd_kernel", True, None) in got and all(nm != "attn_bwd_kernel_dq" for nm, _, _ in got), got
    monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
    got = kernels()
    assert ("_attn_fwd_kernel", False, None) in got and any(nm == "attn_bwd_kernel_dq" for nm, _, _ in got), got
    # auto: the single pass where it measured faster (SSA, head dim <= 32), never when torch's
    # deterministic-algorithms switch is on (Megatron's deterministic_mode)
    monkeypatch.setenv("NEMO_SSA_BWD", "auto")
    assert _single("ssa", 32) and _single("ssa", 16)
    assert not _single("ssa", 64) and not _single("softmax", 32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not _single("ssa", 32)
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    assert _single("softmax", 128)
    # b learnable: db needs the dQ kernel's row sums -> two-kernel backward even in atomic mode
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    bl = b.detach().clone().requires_grad_()
    got = _launched(monkeypatch)
    o = fl.flash_attention(q, k, v, n=n, b=bl, causal=True)
    torch.autograd.grad(o.sum(), [q, n, bl])
    assert any(nm == "attn_bwd_kernel_dq" for nm, _ in got)
    monkeypatch.setenv("NEMO_SSA_BWD", "fast")
    with pytest.raises(ValueError, match="supported: auto, atomic, deterministic"):
        fl.flash_attention(q, k, v, n=n, b=b, causal=True)


def test_dn_wrong_formula_fails_the_check():
    """Negative control: dn without the -C_i centring (sum dz smag with the stored-o delta)
    must fail the same bound the kernel passes, at the cancelling init-like inputs (fp32,
    o rounded to bf16 as a bf16 forward stores it: the centred sum is 3e-10 of sum|terms|
    off, the uncentred one 6e-6)."""
    torch.manual_seed(2)
    B, H, N, D = 1, 2, 96, 32
    q = (torch.randn(B, H, N, D) * 0.3).to(DEVICE)
    k = (torch.randn(B, H, N, D) * 0.3).to(DEVICE)
    v = (torch.randn(1, 1, 1, D) + 0.1 * torch.randn(B, H, N, D)).to(DEVICE)
    go = torch.randn(B, H, N, D).to(DEVICE)
    n, b = torch.tensor([1.0], device=DEVICE), torch.tensor([1.0], device=DEVICE)
    o, M, C = fl._flash_fwd(q, k, v, n, b, None, None, None, "ssa", True, D ** -0.5, 0.0, N, N, "ieee", False,
                            save_c=True)
    ob = o.to(torch.bfloat16).float()
    dn = attention_bwd(go, q, k, v, ob, M, n=n, b=b, causal=True, need_db=False, cstat=C, deterministic=False)[3]
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, n)]
    ref = attention_naive(*leaves[:3], n=leaves[3], b=b.to(F64), causal=True)
    dn_ref = torch.autograd.grad(ref, leaves[3], go.to(F64))[0]
    tn, _ = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True)
    assert_scalar_grad_close("dn", dn, dn_ref, tn, torch.float32, rtol=1e-7)  # measured 3e-10
    dn_bad = attention_bwd(go, q, k, v, ob, M, n=n, b=b, causal=True, need_db=False,
                           cstat=torch.zeros_like(C), deterministic=False)[3]
    with pytest.raises(AssertionError, match="dn"):
        assert_scalar_grad_close("dn", dn_bad, dn_ref, tn, torch.float32, rtol=1e-7)  # 5.7e-6


# bf16 only on the GPU: the interpreter's bf16 tl.dot is wrong (bf16 kept as uint16)
_TAIL_DTYPES = [torch.float16, torch.float32] + ([] if is_interpreter() else [torch.bfloat16])


@pytest.mark.parametrize("dtype", _TAIL_DTYPES, ids=str)
@pytest.mark.parametrize("tr", ["ssa", "softmax"])
@pytest.mark.parametrize("layout", ["bhsd", "sbhd-view", "packed-qkv-slice"])
def test_postprocess_tail_casts_dq_and_sums_dn(monkeypatch, dtype, tr, layout):
    """The backward's tail is one launch (not three torch ops): dq's
    fp32 accumulator cast to the input dtype (a flat cast: dq and the accumulator share
    q's dense layout) and dn's float64 sum. NaN-poisoned outputs: an element it misses
    fails; strided q (a permuted [S, B, H, D] view, a non-dense slice of a packed QKV
    buffer) keeps the flat cast honest."""
    B, Hq, Hkv, S, D = 2, 4, 2, 37, 32
    base = make_qkv(B, Hq, Hkv, S, S, D, torch.float32, device=DEVICE)
    if layout == "bhsd":
        q, k, v = (t.to(dtype).requires_grad_() for t in base)
    elif layout == "sbhd-view":
        q, k, v = (t.to(dtype).permute(2, 0, 1, 3).contiguous().detach().requires_grad_() for t in base)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    else:  # one [S, B, Hq + 2 Hkv, D] buffer, q/k/v non-dense slices of it
        buf = torch.cat([t.permute(2, 0, 1, 3) for t in base], dim=2).to(dtype).requires_grad_()
        q = buf[:, :, :Hq].permute(1, 2, 0, 3)
        k = buf[:, :, Hq:Hq + Hkv].permute(1, 2, 0, 3)
        v = buf[:, :, Hq + Hkv:].permute(1, 2, 0, 3)
    n, b = _nb()
    go = torch.randn(B, Hq, S, D, device=DEVICE).to(dtype)
    launches = _launched(monkeypatch)
    tail_args = []
    rec = launcher.launch

    def keep_tail(kernel, grid, args, meta, ntensors=None, cached=True):
        if kernel is bwd_kernels.attn_bwd_postprocess:
            tail_args.append(args)
        return rec(kernel, grid, args, meta, ntensors, cached)
    monkeypatch.setattr(launcher, "launch", keep_tail)
    kw = dict(n=n, b=b) if tr == "ssa" else {}
    o = fl.flash_attention(q, k, v, transform=tr, causal=True, **kw)
    leaves = [q, k, v] + ([n] if tr == "ssa" else [])
    g = torch.autograd.grad(o, leaves, go)
    names = [nm for nm, _ in launches]
    cast, dparams = dtype != torch.float32, tr == "ssa"
    want = ["_attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_kernel_dkv"]
    want += ["attn_bwd_postprocess"] if (cast or dparams) else []
    assert names == want, names
    if cast or dparams:
        meta = launches[-1][1]
        assert meta["CAST"] == cast and meta["DPARAMS"] == dparams
    assert g[0].dtype == dtype and g[0].shape == q.shape
    up = [t.detach().to(F64).requires_grad_() for t in (q, k, v, n)]
    kw_ref = dict(n=up[3], b=b.to(F64)) if tr == "ssa" else {}
    ref = attention_naive(*up[:3], transform=tr, causal=True, **kw_ref)
    g_ref = torch.autograd.grad(ref, up[:3] + ([up[3]] if tr == "ssa" else []), go.to(F64))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, x, r in zip("qkv", g, g_ref):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, r) <= tol, f"d{name}: {rel_err(x, r):.2e}"
    if tr == "ssa":
        assert g[3].shape == n.shape and g[3].dtype == n.dtype
        tn, _ = ssa_scalar_grad_terms(q.float(), k.float(), v.float(), n, b, go.float(), causal=True)
        assert_scalar_grad_close("dn", g[3], g_ref[3], tn, dtype)
        # the kernel's fp64 sum = torch's fp64 sum of the same per-key-block partials, to 1 fp32 ulp
        dnk, nk = tail_args[-1][2], tail_args[-1][4]
        assert nk == B * Hkv * math.ceil(S / bwd_config.single_config(D, dtype).block_n_kv)
        want = dnk[:2 * nk].view(torch.float64).sum().to(torch.float32)
        torch.testing.assert_close(g[3].reshape(()), want, rtol=1.2e-7, atol=0)


@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_argument_takes_the_two_kernel_backward(monkeypatch, varlen):
    """``deterministic=True`` on the public op: the dQ kernel runs (every gradient
    bit-identical run to run) even where the mode says single pass (``atomic``, the
    autouse fixture); ``None`` keeps the single pass; a non-bool is refused."""
    q, k, v = make_qkv(1, 4, 2, 33, 33, 32, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _nb()
    if varlen:
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, 17, 33], dtype=torch.int32, device=DEVICE)

        def call(**kw):
            return fl.flash_attention_varlen(q, k, v, cu, cu, 17, 17, n=n, b=b, causal=True, **kw)
    else:
        def call(**kw):
            return fl.flash_attention(q, k, v, n=n, b=b, causal=True, **kw)
    for det, want_dq_kernel in ((None, False), (False, False), (True, True)):
        got = _launched(monkeypatch)
        torch.autograd.grad(call(deterministic=det).sum(), [q, k, v, n])
        assert any(nm == "attn_bwd_kernel_dq" for nm, _ in got) == want_dq_kernel, det
    with pytest.raises(TypeError, match="deterministic must be None or a bool"):
        call(deterministic=1)
