"""nemo_ssa.megatron.fast_paths: the sync-free stand-ins give megatron's fallback results."""

import math

import pytest
import torch

from nemo_ssa.megatron import fast_paths


def _lists(dtype=torch.float32):
    shapes = [(7, 5), (3,), (11, 2, 3), (1,), (64,)]
    return [torch.randn(s, dtype=dtype) * (i + 1) for i, s in enumerate(shapes)]


def _megatron_norm(tensors):
    # megatron.core.utils.local_multi_tensor_l2_norm without its final move to "cuda"
    l2 = [[torch.norm(t) for t in tensors]]
    return torch.norm(torch.tensor(l2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_matches_megatron_fallback(dtype):
    ts = _lists(dtype)
    got, none = fast_paths.l2_norm(2048 * 32, None, [ts], False)
    assert none is None and got.shape == (1,) and got.dtype == torch.float32
    want = _megatron_norm(ts)
    # bf16: megatron's fallback takes the norm of the norms in bf16, ours in fp32 (megatron
    # clips fp32 main grads, so fp32 is the case that matters; it must agree to ~1 ulp)
    rtol = 1e-2 if dtype == torch.bfloat16 else 2e-6
    assert torch.allclose(got[0], want.float(), rtol=rtol, atol=0), (got, want)
    # and it is the true norm (a wrong formula would not pass both checks)
    flat = torch.cat([t.float().flatten() for t in ts])
    assert math.isclose(float(got), float(flat.norm()), rel_tol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2_norm_non_finite_like_megatron(bad):
    ts = _lists()
    ts[2][1, 0, 2] = bad
    got, _ = fast_paths.l2_norm(0, None, [ts], False)
    want = _megatron_norm(ts)
    assert (math.isnan(float(got)) and math.isnan(float(want))) or float(got) == float(want)


def test_empty_list():
    got, _ = fast_paths.l2_norm(0, None, [[]], False)
    assert float(got) == 0.0


@pytest.mark.parametrize("s", [0.37, 1.0])
def test_scale_in_place_and_copy(s):
    ts = _lists()
    ref = [t * s for t in ts]
    fast_paths.scale(0, None, [ts, ts], s)  # gradient clipping: same list
    for a, b in zip(ts, ref):
        assert torch.equal(a, b)
    src = _lists()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]  # main fp32 -> model bf16
    fast_paths.scale(0, None, [src, dst], s)
    for a, b in zip(dst, src):
        want = torch.empty_like(a)
        want.copy_(b * s)  # megatron's fallback: dst.copy_(src * scale)
        assert torch.equal(a, want)


def test_install_replaces_only_megatron_fallbacks():
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.optimizer.optimizer as mo
    import megatron.core.utils as mu

    saved = (cg.l2_norm_impl, cg.multi_tensor_scale_impl, mo.multi_tensor_scale_impl, mo._multi_tensor_copy_this_to_that)
    try:
        cg.l2_norm_impl, cg.multi_tensor_scale_impl = mu.local_multi_tensor_l2_norm, mu.local_multi_tensor_scale
        mo.multi_tensor_scale_impl = mu.local_multi_tensor_scale
        if fast_paths._ORIGINAL_COPY:
            mo._multi_tensor_copy_this_to_that = fast_paths._ORIGINAL_COPY[0]
        original_copy = mo._multi_tensor_copy_this_to_that
        assert original_copy.__module__ == mo.__name__
        done = fast_paths.install()
        assert cg.l2_norm_impl is fast_paths.l2_norm and cg.multi_tensor_scale_impl is fast_paths.scale
        assert mo.multi_tensor_scale_impl is fast_paths.scale and len(done) == 4
        assert mo._multi_tensor_copy_this_to_that is fast_paths.copy_this_to_that
        assert fast_paths._ORIGINAL_COPY == [original_copy]
        assert len(fast_paths.install()) == 4  # idempotent
        # an apex/TE kernel bound there is left alone, and so is another package's copy
        sentinel = object()
        cg.l2_norm_impl = sentinel
        other = lambda this, that, overflow_buf=None: None  # noqa: E731
        mo._multi_tensor_copy_this_to_that = other
        fast_paths.install()
        assert cg.l2_norm_impl is sentinel and mo._multi_tensor_copy_this_to_that is other
    finally:
        cg.l2_norm_impl, cg.multi_tensor_scale_impl, mo.multi_tensor_scale_impl, mo._multi_tensor_copy_this_to_that = saved


def test_param_copy_is_megatrons_copy_in_one_call(monkeypatch):
    """The bf16 main->model copy (no overflow buffer): the same bits as megatron's per-tensor
    loop, fp32 rounded to bf16 (and fp32 to fp32), through one foreach call, not one per tensor."""
    import megatron.core.optimizer.optimizer as mo

    fast_paths.install()
    original = fast_paths._ORIGINAL_COPY[0]
    src = _lists() + [torch.randn(5, dtype=torch.float32) * 1e3]
    dst = [torch.full_like(t, float("nan"), dtype=torch.bfloat16) for t in src[:-1]] + [torch.empty(5)]
    want = [torch.full_like(t, float("nan")) for t in dst]
    original(src, want, None)
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    mo._multi_tensor_copy_this_to_that(this=src, that=dst, overflow_buf=None)
    assert calls == [len(src)]
    for a, b in zip(dst, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # with an overflow buffer (fp16 with apex) megatron's own function runs
    seen = []
    monkeypatch.setattr(fast_paths, "_ORIGINAL_COPY", [lambda this, that, buf: seen.append(buf)])
    buf = torch.zeros(1, dtype=torch.int)
    fast_paths.copy_this_to_that(src, dst, buf)
    assert seen == [buf] and calls == [len(src)]


def test_fused_adamw_context_is_scoped():
    orig = torch.optim.AdamW
    p = torch.nn.Parameter(torch.randn(3))
    with fast_paths.fused_adamw():
        opt = torch.optim.AdamW([p], lr=1e-3)
        assert isinstance(opt, orig) and type(opt) is not orig
        assert not opt.param_groups[0]["fused"]  # CPU parameters: torch's default path
    assert torch.optim.AdamW is orig
    with fast_paths.fused_adamw(False):
        assert torch.optim.AdamW is orig


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW needs CUDA")
def test_fused_adamw_on_cuda_matches_foreach():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 7, device="cuda")) for _ in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    with fast_paths.fused_adamw():
        a = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    assert a.param_groups[0]["fused"]
    b = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1, foreach=True)
    for _ in range(3):
        for p, q in zip(ps, qs):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
