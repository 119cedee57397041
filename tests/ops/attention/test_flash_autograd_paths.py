"""Eager fast path of the fused attention (per-call host cost).

The cached launch itself is tested in ``tests/ops/common/test_launch.py``.

Eager calls go through ``_FlashAttnFn`` (a plain autograd.Function); torch.compile traces
the ``torch.library`` custom ops. Both must give bitwise-identical outputs and gradients
(same kernels, same arguments, same casts). Tiny shapes: the kernels run in the Triton
interpreter on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from nemo_ssa.ops.common import alloc, bwd  # noqa: E402
from nemo_ssa.ops.common import launch as launcher  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.ops.attention import flash as fl  # noqa: E402
from nemo_ssa.testing import make_qkv  # noqa: E402

DEVICE = "cpu" if is_interpreter() else "cuda"
pytestmark = pytest.mark.skipif(not (is_interpreter() or torch.cuda.is_available()),
                                reason="Triton kernels need the interpreter or CUDA")


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(alloc, "POISON_OUTPUTS", True)
    if not is_interpreter():
        # bitwise comparisons of two runs: on the GPU the single-pass backward's dq atomics
        # sum in a varying order, so these run the two-kernel backward there (the
        # interpreter runs programs in order: on CPU both paths take the default single pass)
        monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")


def _params(grad_n=True, grad_b=True):
    n = torch.tensor([0.5 + 1.5 * torch.rand(()).item()], device=DEVICE).requires_grad_(grad_n)
    b = torch.tensor([0.3 + 1.2 * torch.rand(()).item()], device=DEVICE).requires_grad_(grad_b)
    return n, b


def _fwd_bwd(monkeypatch, eager, call, leaves, go):
    monkeypatch.setattr(fl, "EAGER_FASTPATH", eager)
    calls = []
    real = fl._FlashAttnFn.apply
    monkeypatch.setattr(fl._FlashAttnFn, "apply", lambda *a: calls.append(1) or real(*a))
    o = call()
    want = [x for x in leaves if x.requires_grad]
    grads = torch.autograd.grad(o, want, go)
    monkeypatch.setattr(fl._FlashAttnFn, "apply", real)
    return o, grads, len(calls)


def _assert_paths_identical(monkeypatch, call, leaves, go):
    o_fast, g_fast, n_fast = _fwd_bwd(monkeypatch, True, call, leaves, go)
    o_op, g_op, n_op = _fwd_bwd(monkeypatch, False, call, leaves, go)
    # negative control: the two runs really took different paths
    assert (n_fast, n_op) == (1, 0)
    assert torch.equal(o_fast, o_op) and not o_fast.isnan().any()
    assert len(g_fast) == len(g_op)
    for x, y in zip(g_fast, g_op):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("transform,causal,dropout", [("ssa", True, 0.0), ("softmax", False, 0.0),
                                                      ("ssa", False, 0.25)])
def test_eager_path_bitwise_equals_custom_op(monkeypatch, transform, causal, dropout):
    q, k, v = make_qkv(2, 4, 2, 19, 23, 16, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _params()
    go = torch.randn_like(q)
    kw = dict(n=n, b=b) if transform == "ssa" else {}
    leaves = [q, k, v] + ([n, b] if transform == "ssa" else [])
    _assert_paths_identical(
        monkeypatch,
        lambda: fl.flash_attention(q, k, v, transform=transform, causal=causal, dropout_p=dropout,
                                   dropout_seed=7, **kw),
        leaves, go)


def test_eager_path_varlen_and_partial_param_grads(monkeypatch):
    q, k, v = (torch.randn(29, h, 16, device=DEVICE).requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor([0, 11, 29], dtype=torch.int32, device=DEVICE)
    n, b = _params(grad_n=True, grad_b=False)  # only dn wanted
    go = torch.randn_like(q)
    _assert_paths_identical(
        monkeypatch,
        lambda: fl.flash_attention_varlen(q, k, v, cu, cu, 18, 18, transform="ssa", n=n, b=b, causal=True),
        [q, k, v, n, b], go)


def test_eager_path_grad_flags_and_inference():
    q, k, v = make_qkv(1, 2, 1, 9, 9, 16, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _params(grad_n=False, grad_b=True)
    o = fl.ssa_attention_triton(q, k, v, n, b, causal=True)
    assert o.grad_fn is not None and type(o.grad_fn).__name__.startswith("_FlashAttnFn")
    dq, db = torch.autograd.grad(o.sum(), [q, b])
    assert n.grad is None and db.shape == b.shape and torch.isfinite(dq).all()
    with torch.no_grad():
        o2 = fl.ssa_attention_triton(q, k, v, n, b, causal=True)
    assert o2.grad_fn is None and torch.equal(o2, o.detach())
    # o unused by the loss: set_materialize_grads(False) -> backward gets None, returns None
    q2 = q.detach().requires_grad_()
    o3 = fl.softmax_attention_triton(q2, k, v)
    (g,) = torch.autograd.grad((q2 * 2).sum() + 0 * o3.sum(), [q2])
    assert torch.equal(g, torch.full_like(q2, 2.0))


def test_dn_db_single_reduction_bitwise_and_matches_separate_sums():
    """dn/db partials share one buffer reduced by one fp64 launch: bit-identical run to run
    and equal (to fp32 rounding of an fp64 sum) to reducing each partial on its own."""
    q, k, v = make_qkv(1, 4, 2, 21, 21, 16, torch.float32, device=DEVICE)
    n, b = _params(False, False)
    o, M = fl.flash_attention_fwd(q, k, v, n=n, b=b, causal=True)
    do = torch.randn_like(o)
    runs = [bwd.attention_bwd(do, q, k, v, o, M, n=n, b=b, causal=True) for _ in range(2)]
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    dn, db = runs[0][3], runs[0][4]
    assert dn.shape == (1,) and db.shape == (1,) and dn.abs().item() > 0 and db.abs().item() > 0
    # no aliasing between dn and db (ELSA's custom op returns both)
    assert dn.untyped_storage().data_ptr() != db.untyped_storage().data_ptr()
    # the non-contiguous-M fallback (separate partial buffers) gives the same numbers
    M_nc = M.transpose(1, 2).contiguous().transpose(1, 2)
    assert not M_nc.is_contiguous()
    r = bwd.attention_bwd(do, q, k, v, o, M_nc, n=n, b=b, causal=True)
    torch.testing.assert_close(r[3], dn, rtol=1e-6, atol=0)
    torch.testing.assert_close(r[4], db, rtol=1e-6, atol=0)
    assert bwd.attention_bwd(do, q, k, v, o, M, n=n, b=b, causal=True, need_dparams=False)[3] is None


@pytest.mark.skipif(is_interpreter(), reason="the cached launch only exists on the GPU")
def test_cached_launch_bitwise_equals_normal_launch_gpu(monkeypatch):
    q, k, v = make_qkv(2, 6, 2, 77, 77, 32, torch.bfloat16, device=DEVICE, requires_grad=True)
    n, b = _params()
    go = torch.randn_like(q)

    def once():
        o = fl.ssa_attention_triton(q, k, v, n, b, causal=True)
        return (o,) + torch.autograd.grad(o, [q, k, v, n, b], go)

    monkeypatch.setattr(launcher, "FAST_LAUNCH", False)
    ref = once()
    monkeypatch.setattr(launcher, "FAST_LAUNCH", True)
    monkeypatch.setattr(launcher, "_LAUNCH_CACHE", {})
    once()  # fills the cache
    assert len(launcher._LAUNCH_CACHE) >= 3  # forward, dQ (+delta), dK/dV
    for x, y in zip(once(), ref):
        assert torch.equal(x, y)


# ---- out= (kernel writes a preallocated, arbitrarily strided output) --------------------


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("transform", ["ssa", "softmax"])
def test_out_strided_in_place_matches_and_backward(monkeypatch, transform, eager):
    """out = a permuted view of a NaN-poisoned [Sq, B, H, D] buffer (Megatron's [s, b, h*d]):
    every element written, equal bitwise to the allocating call; the returned tensor aliases
    the buffer (its [s, b, h*d] reshape is a free view) and carries autograd, gradients
    identical with dO arriving in the buffer's strides."""
    monkeypatch.setattr(fl, "EAGER_FASTPATH", eager)
    B, H, Hkv, S, D = 2, 4, 2, 21, 16
    q, k, v = make_qkv(B, H, Hkv, S, S, D, torch.float32, device=DEVICE, requires_grad=True)
    n, b = _params()
    kw = dict(n=n, b=b) if transform == "ssa" else {}
    leaves = [q, k, v] + ([n, b] if transform == "ssa" else [])
    ref = fl.flash_attention(q, k, v, transform=transform, causal=True, **kw)
    go_sbhd = torch.randn(S, B, H * D, device=DEVICE)
    g_ref = torch.autograd.grad(ref, leaves, go_sbhd.view(S, B, H, D).permute(1, 2, 0, 3))

    buf = torch.full((S, B, H * D), float("nan"), device=DEVICE)
    view = buf.view(S, B, H, D).permute(1, 2, 0, 3)
    o = fl.flash_attention(q, k, v, transform=transform, causal=True, out=view, **kw)
    assert o.data_ptr() == buf.data_ptr() and o.stride() == view.stride()
    assert not buf.isnan().any()
    assert torch.equal(o, ref) and torch.equal(buf.view(S, B, H, D).permute(1, 2, 0, 3), ref)
    o_sbhd = o.permute(2, 0, 1, 3).reshape(S, B, H * D)
    assert o_sbhd.data_ptr() == buf.data_ptr() and o_sbhd.is_contiguous()  # no copy
    g = torch.autograd.grad(o_sbhd, leaves, go_sbhd)
    for x, y in zip(g, g_ref):
        assert torch.equal(x, y)


def test_out_wrappers_and_validation():
    import inspect
    for fn in (fl.flash_attention, fl.ssa_attention_triton, fl.softmax_attention_triton):
        assert "out" in inspect.signature(fn).parameters  # the layout helper's feature probe
    q, k, v = make_qkv(1, 2, 1, 9, 9, 16, torch.float32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    r = fl.softmax_attention_triton(q, k, v, out=out)
    assert r.data_ptr() == out.data_ptr() and torch.equal(r, out) and not out.isnan().any()
    bad = [(torch.empty(1, 2, 9, 8, device=DEVICE), "shape"), (q.new_empty(q.shape, dtype=torch.float16), "dtype"),
           (q.new_empty(1, 2, 1, 16).expand(1, 2, 9, 16), "overlapping"),
           (torch.empty_like(q).requires_grad_(), "requires grad"), ("x", "torch.Tensor")]
    r = fl.softmax_attention_triton(q, k, v, out=out)  # negative control: a good out passes
    for o, match in bad:
        with pytest.raises(ValueError, match=match):
            fl.softmax_attention_triton(q, k, v, out=o)
