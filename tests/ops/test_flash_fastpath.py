"""The eager host path of the fused attention (issue 13, item 1) and its ``out=`` write.

- The eager ``torch.autograd.Function`` and the ``torch.library`` custom op (what
  ``torch.compile`` traces) launch the same kernels: outputs and every gradient are
  bitwise equal.
- ``out=``: the kernel writes straight into a strided view of a ``[s, b, h, d]`` buffer
  (Megatron's layout); the result shares the buffer's memory, equals the plain call
  bitwise, no element is left unwritten (the buffer is NaN-poisoned), and a strided
  ``dO`` (the gradient of ``[s, b, h*d]``) gives the plain call's gradients.
- Bad ``out`` arguments are refused with the supported form named.
"""

import pytest
import torch

from nemo_ssa.ops.ssa import flash
from nemo_ssa.ops.ssa.flash import flash_attention, ssa_attention_triton, softmax_attention_triton
from nemo_ssa.ops.common.attn_bwd import is_interpreter

DEV = "cpu" if is_interpreter() else "cuda"
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs the interpreter or CUDA")


def _inputs(B, Hq, Hkv, S, D, dtype=torch.float32):
    q = torch.randn(B, Hq, S, D, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device=DEV, dtype=dtype, requires_grad=True)
    n = torch.tensor([1.5], device=DEV, requires_grad=True)
    b = torch.tensor([0.8], device=DEV, requires_grad=True)
    return q, k, v, n, b


def _grads(out, leaves, go):
    return torch.autograd.grad(out, leaves, go)


@pytest.mark.parametrize("transform", ["ssa", "softmax"])
@pytest.mark.parametrize("causal", [True, False])
def test_eager_function_equals_custom_op_bitwise(transform, causal):
    q, k, v, n, b = _inputs(2, 3, 1, 21, 16)
    ssa = transform == "ssa"
    leaves = [q, k, v] + ([n, b] if ssa else [])
    o1 = flash_attention(q, k, v, transform=transform, n=n if ssa else None, b=b if ssa else None, causal=causal)
    assert o1.grad_fn is not None and "FlashAttnFn" in type(o1.grad_fn).__name__  # the eager path ran
    scale, prec, fast = flash._resolve(q, q.shape[-1], None, None, None)
    o2, _ = torch.ops.nemo_ssa.flash_attn_fwd(q, k, v, n if ssa else None, b if ssa else None, None, None, None,
                                              transform, causal, scale, 0.0, q.shape[2], k.shape[2], prec, fast)
    assert torch.equal(o1, o2)
    go = torch.randn_like(o1)
    for g1, g2, name in zip(_grads(o1, leaves, go), _grads(o2, leaves, go), "qkvnb"):
        assert torch.equal(g1, g2), name


def test_dparams_only_when_asked_and_frozen_params_get_none():
    q, k, v, n, b = _inputs(1, 2, 2, 17, 16)
    b.requires_grad_(False)
    o = ssa_attention_triton(q, k, v, n, b, causal=True)
    gq, gn = torch.autograd.grad(o.sum(), [q, n])
    assert torch.isfinite(gq).all() and torch.isfinite(gn).all() and gn.shape == n.shape
    n.requires_grad_(False)
    o = ssa_attention_triton(q, k, v, n, b, causal=True)
    (gq2,) = torch.autograd.grad(o.sum(), [q])
    assert torch.equal(gq, gq2)  # dq does not depend on whether dn/db were reduced


@pytest.mark.parametrize("fn", ["ssa", "softmax"])
def test_out_writes_megatron_layout_in_place(fn, monkeypatch):
    B, Hq, Hkv, S, D = 2, 4, 2, 19, 16
    q, k, v, n, b = _inputs(B, Hq, Hkv, S, D)
    call = (lambda **kw: ssa_attention_triton(q, k, v, n, b, causal=True, **kw)) if fn == "ssa" else \
        (lambda **kw: softmax_attention_triton(q, k, v, causal=True, **kw))
    leaves = [q, k, v] + ([n, b] if fn == "ssa" else [])
    ref = call()
    buf = torch.full((S, B, Hq, D), float("nan"), device=DEV)  # [s, b, h, d]; poisoned
    o = call(out=buf.permute(1, 2, 0, 3))
    assert o.data_ptr() == buf.data_ptr() and not torch.isnan(buf).any()
    assert torch.equal(o, ref)
    flat = o.permute(2, 0, 1, 3).reshape(S, B, Hq * D)  # Megatron's [s, b, h*d]: a view, no copy
    assert flat.data_ptr() == buf.data_ptr()
    g_flat = torch.randn(S, B, Hq * D, device=DEV)
    g_ref = g_flat.view(S, B, Hq, D).permute(1, 2, 0, 3)  # the same dO, strided
    for g1, g2, name in zip(torch.autograd.grad(flat, leaves, g_flat),
                            torch.autograd.grad(ref, leaves, g_ref.contiguous()), "qkvnb"):
        assert torch.equal(g1, g2), name


@pytest.mark.parametrize("bad, match", [
    (lambda q: torch.empty(q.shape[0], q.shape[1], q.shape[2], q.shape[3] + 1, device=q.device), "must match q"),
    (lambda q: torch.empty(q.shape, device=q.device, dtype=torch.float16), "must match q"),
    (lambda q: torch.empty(q.shape, device=q.device, requires_grad=True), "must not require grad"),
    (lambda q: torch.empty(1, 1, 1, q.shape[3], device=q.device).expand(q.shape), "stride-0"),
    (lambda q: [1.0], "torch.Tensor"),
])
def test_out_refused_with_reason(bad, match):
    q, k, v, n, b = _inputs(1, 2, 1, 9, 16)
    with pytest.raises(ValueError, match=match):
        ssa_attention_triton(q, k, v, n, b, out=bad(q))


def test_dn_db_bit_identical_run_to_run():
    q, k, v, n, b = _inputs(2, 3, 1, 33, 16)
    go = torch.randn(2, 3, 33, 16, device=DEV)
    runs = [torch.autograd.grad(ssa_attention_triton(q, k, v, n, b, causal=True), [n, b], go) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
