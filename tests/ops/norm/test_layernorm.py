"""LayerNorm1P's Triton kernels (nemo_ssa/ops/norm) vs the fp64 torch reference, 2x-eager rule.

The kernels run in the CPU interpreter (tests/conftest.py) at odd shapes: one element,
one row, widths that are not powers of two, more rows than one tile, more tiles than
backward programs (so each program walks several and sums its partials). Every buffer
the op allocates is NaN-poisoned, so an element or partial no program writes fails.
Negative controls: a forward that forgets the ``1 +`` of the zero-centred scale and a
backward that drops the ``xhat`` term of dx both fail the same check.
"""

import pytest
import torch
import triton
import triton.language as tl

from nemo_ssa.ops.norm import fused, layer_norm_1p, layer_norm_1p_eager, layer_norm_1p_naive
from nemo_ssa.testing import assert_within_2x_eager

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (GPU: test_layernorm_gpu.py)")

SHAPES = [(1, 1), (1, 768), (7, 3, 37), (5, 129), (70, 64), (2, 33, 100)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NAMES = ("y", "dx", "dw", "db")


def poison_outputs(monkeypatch):
    monkeypatch.setattr(fused, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                 device=device))


def inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 0.5  # an offset the mean must remove
    w = 0.1 * torch.randn(n, generator=g, dtype=torch.float64)  # trained-looking, not the zero init
    b = 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x, w, b, dy


def run(fn, x, w, b, dy, dtype):
    """(y, dx, dw, db) of ``fn`` on fresh leaves in ``dtype``."""
    xx, ww, bb = (t.detach().clone().to(dtype).requires_grad_() for t in (x, w, b))
    y = fn(xx, ww, bb)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, ww.grad, bb.grad


def check(shape, dtype, zero_centred=True, tiles=None, seed=0):
    x, w, b, dy = inputs(shape, seed)
    got = run(lambda a, c, d: layer_norm_1p(a, c, d, 1e-5, zero_centred, impl="triton", tiles=tiles),
              x, w, b, dy, dtype)
    eager = run(lambda a, c, d: layer_norm_1p_eager(a, c, d, 1e-5, zero_centred), x, w, b, dy, dtype)
    ref = run(lambda a, c, d: layer_norm_1p_naive(a, c, d, 1e-5, zero_centred), x, w, b, dy, torch.float64)
    for name, g, e, r in zip(NAMES, got, eager, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        assert_within_2x_eager(g, e, r, name=name)
    return got


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_fwd_and_grads_within_2x_eager(shape, dtype, monkeypatch):
    poison_outputs(monkeypatch)
    check(shape, dtype)


@pytest.mark.parametrize("tiles", [[1, 128, 4, 3], [4, 128, 4, 2], [16, 128, 4, 64]],
                         ids=["row-tiles-3-programs", "4-row-tiles-2-programs", "more-programs-than-tiles"])
def test_tiles_and_program_counts(tiles, monkeypatch):
    """Programs that walk several tiles (and a count above the tiles, which the launcher
    caps): the partial sums cover every row exactly once."""
    poison_outputs(monkeypatch)
    check((37, 100), torch.float32, tiles=tiles)


def test_plain_layernorm_without_zero_centred_gamma(monkeypatch):
    poison_outputs(monkeypatch)
    check((9, 48), torch.float32, zero_centred=False)


def test_strided_input_rows():
    """A column slice (row pitch wider than the row) is read through its stride, not copied."""
    x, w, b, _ = inputs((11, 40))
    wide = torch.randn(11, 56, dtype=torch.float64)
    wide[:, :40] = x
    view = wide.float()[:, :40]
    assert view.stride() == (56, 1)
    got = layer_norm_1p(view, w.float(), b.float(), impl="triton")
    torch.testing.assert_close(got.double(), layer_norm_1p_naive(x, w, b), rtol=1e-5, atol=1e-5)


def test_deterministic():
    x, w, b, dy = inputs((37, 100))
    fn = lambda a, c, d: layer_norm_1p(a, c, d, impl="triton", tiles=[2, 128, 4, 3])  # noqa: E731
    first, second = run(fn, x, w, b, dy, torch.float32), run(fn, x, w, b, dy, torch.float32)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


# ------------------------------------------------------------------- negative controls
@triton.jit
def _bwd_without_xhat_term(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, M, N,
                           stride_dym, stride_xm, stride_dxm, ZERO_CENTRED: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + 1.0
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        gdy = dy * g[None, :]
        dx = (gdy - tl.sum(gdy, axis=1)[:, None] / N) * rstd[:, None]  # the xhat * mean(xhat g dy) term dropped
        tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


def test_negative_control_forward_scale_without_one_fails(monkeypatch):
    """The real forward kernel launched as a plain LayerNorm (scale w, not 1 + w) fails."""
    check((13, 48), torch.float32)  # the real launch passes on these inputs
    real = fused.launch_kw

    def plain(kernel, grid, tensors, scalars, meta, **kw):
        if kernel is fused.layernorm_fwd_kernel:
            meta = dict(meta, ZERO_CENTRED=False)
        return real(kernel, grid, tensors, scalars, meta, **kw)

    monkeypatch.setattr(fused, "launch_kw", plain)
    with pytest.raises(AssertionError, match=r"^y:"):
        check((13, 48), torch.float32)


def test_negative_control_backward_without_the_xhat_term_fails(monkeypatch):
    check((13, 48), torch.float32)
    monkeypatch.setattr(fused, "layernorm_bwd_kernel", _bwd_without_xhat_term)
    with pytest.raises(AssertionError, match=r"^dx:"):
        check((13, 48), torch.float32)


def test_poisoning_catches_an_unwritten_partial(monkeypatch):
    """Negative control for the poisoning: a backward launched with fewer programs than its
    partials buffer has rows leaves NaN rows that reach dw."""
    poison_outputs(monkeypatch)
    real = fused.launch_kw

    def short(kernel, grid, *args, **kw):
        if kernel is fused.layernorm_bwd_kernel:
            grid = (max(1, grid[0] - 1),)
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(fused, "launch_kw", short)
    with pytest.raises(AssertionError, match="^dw:"):
        check((37, 100), torch.float32, tiles=[4, 128, 4, 3])


# ------------------------------------------------------------------- reference, refusals
def test_cpu_path_is_the_reference():
    """``impl=torch`` (what ``auto`` runs without CUDA or the interpreter) is the reference."""
    x, w, b, dy = inputs((5, 3, 24))
    got = run(lambda a, c, d: layer_norm_1p(a, c, d, impl="torch"), x, w, b, dy, torch.float32)
    ref = run(layer_norm_1p_naive, x, w, b, dy, torch.float32)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_naive_matches_torch_layer_norm_in_fp64():
    x, w, b, _ = inputs((6, 50))
    torch.testing.assert_close(layer_norm_1p_naive(x, w, b), layer_norm_1p_eager(x, w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("args, match", [
    (dict(shape=(4, 8), n_w=7), r"weight \(7,\)"),
    (dict(shape=(4, fused.MAX_N + 1), n_w=fused.MAX_N + 1), "hidden size"),
    (dict(shape=(4, 8), n_w=8, dtype=torch.float64, impl="bogus"), "impl='bogus'; supported"),
])
def test_refusals_name_what_is_supported(args, match):
    dtype = args.get("dtype", torch.float32)
    x = torch.randn(*args["shape"], dtype=dtype)
    w, b = torch.zeros(args["n_w"], dtype=dtype), torch.zeros(args["n_w"], dtype=dtype)
    with pytest.raises(ValueError, match=match):
        layer_norm_1p(x, w, b, impl=args.get("impl", "triton"))


def test_unsupported_dtype_reason():
    assert "supported: bf16, fp16, fp32" in fused.unsupported_reason(64, torch.float64)
    assert fused.unsupported_reason(768, torch.bfloat16) is None


def test_compiled_graph_takes_the_custom_ops_and_matches_eager():
    """Under torch.compile the op is reached through its custom ops (no graph break,
    ``fullgraph=True``) and gives eager's output and gradients; eager calls skip them."""
    x, w, b, dy = inputs((6, 40))
    fn = lambda a, c, d: layer_norm_1p(a * 1.5, c, d, impl="triton").relu()  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for g, e in zip(run(compiled, x, w, b, dy, torch.float32), run(fn, x, w, b, dy, torch.float32)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_eager_calls_skip_the_custom_op_dispatch(monkeypatch):
    calls = []
    for name in ("_fwd_call", "_bwd_call"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    x, w, b, dy = inputs((3, 16))
    run(lambda a, c, d: layer_norm_1p(a, c, d, impl="triton"), x, w, b, dy, torch.float32)
    assert calls == []
