"""Fused squared-ReLU MLP (nemo_ssa/ops/mlp) vs the fp64 torch reference, 2x-eager rule.

The two Triton kernels run in the CPU interpreter (tests/conftest.py) at tiny odd shapes,
in fp16: the interpreter's bf16 ``tl.dot`` is wrong (bf16 kept as uint16), so bf16 is
checked on the GPU (test_mlp_gpu.py, benchmarks/bench_mlp.py). Every output the op
allocates is NaN-poisoned, so an element no program writes fails the check. Negative
controls: a relu (not relu^2) forward epilogue and a backward epilogue without the factor
2 both fail the same check.
"""

import pytest
import torch
import triton
import triton.language as tl

from nemo_ssa.ops.mlp import fused, mlp_relu2, mlp_relu2_naive, mlp_relu2_naive_backward
from nemo_ssa.ops.mlp.fused import Tile, _mm_tile, _tile_pids
from nemo_ssa.testing import assert_within_2x_eager

F16 = torch.float16
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (GPU: test_mlp_gpu.py)")

SHAPES = [  # M (tokens), K (hidden in), N (ffn), H (hidden out)
    (37, 32, 64, 32),   # odd M, recipe-like K == H
    (1, 16, 48, 32),    # one row; N = 48 shrinks the 64-wide tile to 16
    (70, 64, 32, 48),   # H != K
]
TILES = {"t16": "fwd=16x16x16/1/4,bwd=16x16x16/1/4",   # many tiles: grouped ordering, row wrap
         "t32": "fwd=32x64x32/1/4,bwd=32x32x16/1/4",
         "default": ""}                                 # the GPU tiles: one wrapped tile
LAYOUTS = ["contiguous", "row-strided", "sb3d", "transposed"]


def make_x(M, K, layout, dtype=F16):
    """x [M, K] or a megatron-like [s, b, K] view; leaf returned separately for its grad."""
    if layout == "contiguous":
        leaf = torch.randn(M, K, dtype=dtype).requires_grad_()
        return leaf, leaf
    if layout == "row-strided":  # a column slice: row pitch K + 8
        leaf = torch.randn(M, K + 8, dtype=dtype).requires_grad_()
        return leaf, leaf[:, :K]
    if layout == "sb3d":  # [s, b, K] contiguous (megatron's layernorm output), b = 1
        leaf = torch.randn(M, 1, K, dtype=dtype).requires_grad_()
        return leaf, leaf
    leaf = torch.randn(1, M, K, dtype=dtype).requires_grad_()  # [b, s, K] -> [s, b, K]
    return leaf, leaf.transpose(0, 1)


def weights(K, N, H, dtype=F16):
    w1 = (torch.randn(N, K) * K ** -0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(H, N) * N ** -0.5).to(dtype).requires_grad_()
    return w1, w2


def poison_outputs(monkeypatch):
    monkeypatch.setattr(fused, "_empty", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype,
                                                                       device=like.device))


def run_all(leaf, x, w1, w2, dy, fn):
    """(y, dx, dw1, dw2) of ``fn`` on fresh leaves copied from the given ones."""
    leaf_ = leaf.detach().to(dy.dtype).clone().requires_grad_()
    w1_ = w1.detach().to(dy.dtype).clone().requires_grad_()
    w2_ = w2.detach().to(dy.dtype).clone().requires_grad_()
    x_ = _same_view(leaf_, x, leaf)
    y = fn(x_, w1_, w2_)
    y.backward(dy)
    return y.detach(), leaf_.grad, w1_.grad, w2_.grad


def _same_view(new_leaf, view, old_leaf):
    return new_leaf.as_strided(view.shape, view.stride(), view.storage_offset() - old_leaf.storage_offset())


def check_against_reference(leaf, x, w1, w2, impl_fn=None):
    H = w2.shape[0]
    dy = torch.randn(*x.shape[:-1], H, dtype=F16)
    got = run_all(leaf, x, w1, w2, dy, impl_fn or (lambda a, b, c: mlp_relu2(a, b, c, impl="triton")))
    ref = run_all(leaf, x, w1, w2, dy.double(), mlp_relu2_naive)
    eager = run_all(leaf, x, w1, w2, dy, mlp_relu2_naive)
    for name, g, e, r in zip(("y", "dx", "dw1", "dw2"), got, eager, ref):
        assert g.dtype == F16 and g.shape == r.shape, name
        assert_within_2x_eager(g, e, r, name=name)
    return got


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiles", list(TILES), ids=list(TILES))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"M{m}-K{k}-N{n}-H{h}" for m, k, n, h in SHAPES])
def test_fwd_and_grads_within_2x_eager(shape, tiles, layout, monkeypatch):
    M, K, N, H = shape
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", TILES[tiles])
    poison_outputs(monkeypatch)
    leaf, x = make_x(M, K, layout)
    w1, w2 = weights(K, N, H)
    y = check_against_reference(leaf, x, w1, w2)[0]
    assert y.shape == (*x.shape[:-1], H)


def test_deterministic(monkeypatch):
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", TILES["t16"])
    leaf, x = make_x(37, 32, "contiguous")
    w1, w2 = weights(32, 64, 32)
    dy = torch.randn(37, 32, dtype=F16)
    fn = lambda a, b, c: mlp_relu2(a, b, c, impl="triton")  # noqa: E731
    first, second = run_all(leaf, x, w1, w2, dy, fn), run_all(leaf, x, w1, w2, dy, fn)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------- negative controls
@triton.jit
def _relu_not_squared_fwd_kernel(x_ptr, w1_ptr, a_ptr, M, N, K, stride_xm, stride_xk, stride_w1n, stride_w1k,
                                 stride_am, stride_an, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    u = _mm_tile(x_ptr, w1_ptr, M, K, stride_xm, stride_xk, stride_w1k, stride_w1n, pid_m, pid_n,
                 BLOCK_M, BLOCK_N, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(a_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an,
             tl.maximum(u, 0.0).to(a_ptr.dtype.element_ty), mask=rows[:, None] < M)  # relu, not relu^2


@triton.jit
def _du_without_factor_2_kernel(dy_ptr, w2_ptr, a_ptr, du_ptr, M, N, K, stride_dym, stride_dyk, stride_w2k,
                                stride_w2n, stride_am, stride_an, stride_dum, stride_dun, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    da = _mm_tile(dy_ptr, w2_ptr, M, K, stride_dym, stride_dyk, stride_w2k, stride_w2n, pid_m, pid_n,
                  BLOCK_M, BLOCK_N, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows[:, None] < M
    a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an, mask=mask, other=0.0)
    tl.store(du_ptr + rows[:, None] * stride_dum + cols[None, :] * stride_dun,
             (da * tl.sqrt(a.to(tl.float32))).to(du_ptr.dtype.element_ty), mask=mask)  # the 2 dropped


@pytest.mark.parametrize("wrong, which", [("relu2_fwd_kernel", r"^y:"), ("relu2_bwd_kernel_du", r"^dx:")],
                         ids=["fwd-relu-not-squared", "bwd-no-factor-2"])
def test_negative_control_wrong_epilogue_fails(wrong, which, monkeypatch):
    bad = {"relu2_fwd_kernel": _relu_not_squared_fwd_kernel, "relu2_bwd_kernel_du": _du_without_factor_2_kernel}
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", TILES["t16"])
    leaf, x = make_x(37, 32, "contiguous")
    w1, w2 = weights(32, 64, 32)
    check_against_reference(leaf, x, w1, w2)  # the real kernels pass on these inputs
    monkeypatch.setattr(fused, wrong, bad[wrong])
    with pytest.raises(AssertionError, match=which):
        check_against_reference(leaf, x, w1, w2)


def test_poisoning_catches_an_unwritten_tile(monkeypatch):
    """Negative control for the poisoning: a launch that skips the last row tile leaves NaN."""
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", TILES["t16"])
    poison_outputs(monkeypatch)
    real = fused._launch_fwd

    def short_launch(x2d, w1, tile):
        a = real(x2d[:32], w1, tile)  # rows 32.. never computed
        out = fused._empty((x2d.shape[0], w1.shape[0]), x2d)
        out[:32] = a
        return out

    monkeypatch.setattr(fused, "_launch_fwd", short_launch)
    leaf, x = make_x(37, 32, "contiguous")
    w1, w2 = weights(32, 64, 32)
    with pytest.raises(AssertionError, match="^y:"):
        check_against_reference(leaf, x, w1, w2)


# ------------------------------------------------------------------- CPU path, reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_path_is_the_reference(dtype):
    """Where Triton does not run (the CPU loop: fp32; bf16 in the interpreter) ``auto`` runs
    the torch reference: bit-equal output and gradients."""
    leaf, x = make_x(9, 32, "sb3d", dtype)
    w1, w2 = weights(32, 64, 32, dtype)
    assert not fused.triton_available(x.device, dtype)
    dy = torch.randn(9, 1, 32, dtype=dtype)
    got = run_all(leaf, x, w1, w2, dy, mlp_relu2)
    ref = run_all(leaf, x, w1, w2, dy, mlp_relu2_naive)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_explicit_backward_equals_autograd():
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(48, 16, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(32, 48, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 5, 32, dtype=torch.float64)
    mlp_relu2_naive(x, w1, w2).backward(dy)
    for got, want in zip(mlp_relu2_naive_backward(x, w1, w2, dy), (x.grad, w1.grad, w2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("shapes, match", [
    (((4, 24), (64, 24), (32, 64)), "multiples of 16"),
    (((4, 32), (40, 32), (32, 40)), "multiples of 16"),
    (((4, 32), (64, 16), (32, 64)), "do not chain"),
    (((4, 32), (64, 32), (32, 48)), "do not chain"),
])
def test_unsupported_shapes_are_refused(shapes, match):
    x, w1, w2 = (torch.zeros(s, dtype=F16) for s in shapes)
    with pytest.raises(ValueError, match=match):
        mlp_relu2(x, w1, w2)


def test_other_refusals(monkeypatch):
    x, w1, w2 = torch.zeros(4, 32), torch.zeros(64, 32), torch.zeros(32, 64)
    with pytest.raises(ValueError, match="supported: auto, triton, torch"):
        mlp_relu2(x, w1, w2, impl="cuda")
    with pytest.raises(ValueError, match="impl='triton' needs bf16/fp16"):
        mlp_relu2(x, w1, w2, impl="triton")
    with pytest.raises(ValueError, match="share one dtype"):
        mlp_relu2(x.half(), w1, w2)
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", "fwd=128x128/4")
    with pytest.raises(ValueError, match="BMxBNxBK/stages/warps"):
        fused.tiles()
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", "up=128x128x64/4/4")
    with pytest.raises(ValueError, match="supported keys: fwd, bwd"):
        fused.tiles()
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", "bwd=64x256x32/3/8")
    assert fused.tiles() == {"fwd": fused.DEFAULT_TILES["fwd"], "bwd": Tile(64, 256, 32, 8, 3, 8)}


def test_fit_picks_a_divisor():
    assert [fused._fit(256, n) for n in (3072, 48, 64, 16)] == [256, 16, 64, 16]
    assert fused._fit(64, 768) == 64 and fused._fit(100, 96) == 32


# ------------------------------------------------------------- torch.compile sees through
def test_dynamo_traces_through_without_graph_break(monkeypatch):
    """The surgical-fusion property: dynamo traces the autograd.Function and both Triton
    custom ops in one graph (fullgraph=True raises on a graph break); aot_eager runs the
    traced forward and backward with the real kernels (in the interpreter here)."""
    torch._dynamo.reset()
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", TILES["t16"])
    leaf, x = make_x(37, 32, "sb3d")
    w1, w2 = weights(32, 64, 32)

    def layer(x, w1, w2):  # the ops around the MLP are what compile keeps fusing
        return x[..., :32] + mlp_relu2(x * 0.5, w1, w2, impl="triton")

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    dy = torch.randn(37, 1, 32, dtype=F16)
    got = run_all(leaf, x, w1, w2, dy, compiled)
    want = run_all(leaf, x, w1, w2, dy, layer)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch._dynamo.reset()
