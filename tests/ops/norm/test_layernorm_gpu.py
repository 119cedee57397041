"""LayerNorm1P's Triton kernels on a CUDA GPU: the recipe's width in bf16/fp16/fp32, 2x-eager rule.

Run on its own (``pytest -m gpu tests/ops/norm/test_layernorm_gpu.py -q``); skips when a CPU
test module decorated the kernels under ``TRITON_INTERPRET=1`` in the same session. Odd token
counts (the last row tile partial), megatron's ``[s, b, h]``, the backward's real program
count (4 per SM: every program walks several tiles at 32k tokens), a wide hidden size, and
``torch.compile`` (inductor, fullgraph) of a residual block around the op.
"""

import pytest
import torch

from nemo_ssa.ops.common.launch import is_interpreter
from nemo_ssa.ops.norm import fused, layer_norm_1p, layer_norm_1p_eager, layer_norm_1p_naive
from nemo_ssa.testing import assert_within_2x_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(is_interpreter(), reason="kernels built for TRITON_INTERPRET=1 in this session"),
]
DEV = "cuda"
NAMES = ("y", "dx", "dw", "db")


def grads(fn, x, w, b, dy, dtype):
    x, w, b = (t.detach().to(dtype).clone().requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy.to(dtype))
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.gpu_quick
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("s, b, h", [(999, 1, 768), (1024, 32, 768), (3, 5, 4096), (1, 1, 768)],
                         ids=["T999", "recipe-B32", "h4096", "one-token"])
def test_within_2x_eager(s, b, h, dtype, monkeypatch):
    monkeypatch.setattr(fused, "_empty", lambda shape, dt, device: torch.full(shape, float("nan"), dtype=dt,
                                                                              device=device))
    g = torch.Generator(device=DEV).manual_seed(s * 7 + b)
    x = torch.randn(s, b, h, device=DEV, generator=g, dtype=torch.float64) * 2 + 0.5
    w = 0.1 * torch.randn(h, device=DEV, generator=g, dtype=torch.float64)
    bias = 0.1 * torch.randn(h, device=DEV, generator=g, dtype=torch.float64)
    dy = torch.randn(s, b, h, device=DEV, generator=g, dtype=torch.float64)
    got = grads(lambda a, c, d: layer_norm_1p(a, c, d, impl="triton"), x, w, bias, dy, dtype)
    eager = grads(layer_norm_1p_eager, x, w, bias, dy, dtype)
    ref = grads(layer_norm_1p_naive, x, w, bias, dy, torch.float64)
    for name, gt, e, r in zip(NAMES, got, eager, ref):
        assert_within_2x_eager(gt, e, r, name=name)


def test_deterministic_at_the_recipe_shape():
    x = torch.randn(1024, 32, 768, device=DEV, dtype=torch.bfloat16)
    w, b = torch.randn(768, device=DEV) * 0.1, torch.randn(768, device=DEV) * 0.1
    dy = torch.randn_like(x)
    first = grads(lambda a, c, d: layer_norm_1p(a, c, d, impl="triton"), x, w, b, dy, torch.bfloat16)
    second = grads(lambda a, c, d: layer_norm_1p(a, c, d, impl="triton"), x, w, b, dy, torch.bfloat16)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_inductor_compiles_around_it():
    torch._dynamo.reset()
    x = torch.randn(128, 4, 768, device=DEV, dtype=torch.bfloat16)
    w, b = (torch.randn(768, device=DEV) * 0.1).bfloat16(), (torch.randn(768, device=DEV) * 0.1).bfloat16()

    def block(t, weight, bias):
        return t + layer_norm_1p(t * 1.5, weight, bias, impl="triton").relu()

    eager = block(x, w, b)
    compiled = torch.compile(block, fullgraph=True)(x, w, b)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
