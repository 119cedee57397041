"""ELSA two-pass scan on a CUDA GPU: exactness bounds, bf16 2x-eager rule, structure.

Run on its own (``pytest -m gpu tests/ops/elsa/test_elsa_gpu.py -q``): a CPU test module imported in the
same session may have set ``TRITON_INTERPRET=1`` before the kernels were decorated, in which
case these tests skip rather than run interpreted.

Bounds (vs float64 ``attention_naive``):
* fp32 inputs, IEEE dots: ``o`` rel err <= 1e-5, dq/dk/dv <= 1e-4, dn/db <= 2e-5 x
  sum|terms|;
* bf16: output, dq, dk, dv within 2x the error of the eager bf16 reference
  (``attention_naive(..., upcast=False)``) + 1e-5 (``assert_within_2x_eager``); the scalar
  sums dn, db within 2x the eager error + 1.6e-2 x sum|terms| (``assert_scalar_grad_close``:
  they cancel to ~1e-3 of sum|terms| at random (n, b), so a bound on their own value
  tested the draw; with this bound random (n, b) are drawn again).
The same bounds hold for ELSA-softmax and ELSA-SSA.

Cases: each shape runs the (causal, transform) pairs that add a property or a compiled
variant (Triton compiles per head dim / causal / transform / dtype), not the full cross
product; ``gpu_quick`` marks the core ones.
"""

import pytest
import torch

from nemo_ssa.ops.elsa import elsa_attention
from nemo_ssa.ops.elsa.introspect import elsa_structure
from nemo_ssa.ops.elsa.routing import make_plan
from nemo_ssa.ops.elsa.scan import kernels_interpreted
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.testing import (
    assert_scalar_grad_close,
    assert_within_2x_eager,
    case_id,
    make_qkv,
    rel_err,
    ssa_scalar_grad_terms,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(kernels_interpreted(), reason="kernels built for TRITON_INTERPRET=1 in this session"),
]

DEV = "cuda"
NAMES = ["dq", "dk", "dv", "dn", "db"]

# (B, Hq, Hkv, Sq, Sk, D, forced partitions or None)
SHAPES = [
    (2, 4, 2, 1, 1, 64, None),  # N = 1
    (1, 4, 2, 63, 63, 64, 3),  # ragged, several partitions forced
    (2, 24, 8, 1000, 1000, 32, None),  # model-like GQA shape, routing
    (1, 4, 1, 1000, 1000, 48, 4),  # padded head dim
    (1, 4, 2, 4096, 4096, 64, None),  # routing picks > 1 partition (few heads)
    (1, 2, 2, 333, 4096, 128, None),  # Sq < Sk (chunked prefill)
    (1, 2, 1, 4096, 1000, 64, 2),  # Sq > Sk: empty rows
]


def _params(requires_grad=True):
    n = 0.5 + 1.5 * torch.rand(()).item()
    b = 0.3 + 1.2 * torch.rand(()).item()
    return (torch.tensor([n], device=DEV, requires_grad=requires_grad),
            torch.tensor([b], device=DEV, requires_grad=requires_grad))


def _run(fn, q, k, v, n, b, tr, causal, g, **kw):
    leaves = [q, k, v] + ([n, b] if tr == "ssa" else [])
    extra = dict(n=n, b=b) if tr == "ssa" else {}
    o = fn(q, k, v, transform=tr, causal=causal, **extra, **kw)
    return o.detach(), torch.autograd.grad(o, leaves, g.to(o.dtype))


def _leaves(dtype, *ts):
    return [t.detach().to(dtype).requires_grad_() for t in ts]


C, F = True, False
# shape index -> (causal, transform, quick) pairs
FP32_PLAN = {
    0: [(C, "ssa", F), (F, "softmax", F)],
    1: [(C, "ssa", True), (F, "ssa", F), (C, "softmax", F)],
    2: [(C, "ssa", F), (F, "softmax", True)],
    3: [(C, "ssa", F), (F, "ssa", F)],
    4: [(C, "ssa", F), (C, "softmax", F), (F, "ssa", F)],
    5: [(C, "ssa", F), (F, "softmax", F)],
    6: [(C, "ssa", F), (F, "softmax", F)],
}
BF16_PLAN = {
    0: [(C, "ssa", F)],
    1: [(C, "ssa", F)],
    2: [(C, "ssa", True), (C, "softmax", F)],
    3: [(C, "ssa", F)],
    4: [(C, "ssa", F), (F, "softmax", F)],
    5: [(C, "ssa", F)],
    6: [(C, "softmax", F)],
}


def _cases(dtype, plan):
    out = []
    for i, pairs in plan.items():
        B, Hq, Hkv, Sq, Sk, D, P = s = SHAPES[i]
        for causal, tr, quick in pairs:
            cid = f"{case_id(B, Sq, Hq, Hkv, D, causal, dtype, Sk=Sk)}-P{P}-{tr}"
            out.append(pytest.param(s, dtype, causal, tr, id=cid, marks=(pytest.mark.gpu_quick,) if quick else ()))
    return out


@pytest.mark.parametrize("shape,dtype,causal,tr", _cases(torch.float32, FP32_PLAN))
def test_fp32_ieee_exact(shape, dtype, causal, tr):
    B, Hq, Hkv, Sq, Sk, D, P = shape
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32, device=DEV)
    n, b = _params()
    g = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.float64)
    o, grads = _run(elsa_attention, *_leaves(torch.float32, q, k, v), n, b, tr, causal, g,
                    num_partitions=P, fp32_precision="ieee")
    ref, rgrads = _run(attention_naive, *_leaves(torch.float64, q, k, v),
                       *_leaves(torch.float64, n, b), tr, causal, g)
    assert rel_err(o, ref) <= 1e-5, rel_err(o, ref)
    for name, a, r in zip(NAMES[:3], grads, rgrads):
        assert rel_err(a, r) <= 1e-4, f"{name}: {rel_err(a, r):.2e}"
    if tr == "ssa":
        terms = ssa_scalar_grad_terms(q, k, v, n, b, g, causal=causal)
        for name, a, r, t in zip(NAMES[3:], grads[3:], rgrads[3:], terms):
            assert_scalar_grad_close(name, a, r, t, torch.float32)


@pytest.mark.parametrize("shape,dtype,causal,tr", _cases(torch.bfloat16, BF16_PLAN))
def test_bf16_within_2x_eager(shape, dtype, causal, tr):
    B, Hq, Hkv, Sq, Sk, D, P = shape
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, device=DEV)
    n, b = _params()
    g = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.float64)
    o, grads = _run(elsa_attention, *_leaves(torch.bfloat16, q, k, v), n, b, tr, causal, g, num_partitions=P)
    eager, egrads = _run(attention_naive, *_leaves(torch.bfloat16, q, k, v), n, b, tr, causal, g, upcast=False)
    ref, rgrads = _run(attention_naive, *_leaves(torch.float64, q, k, v),
                       *_leaves(torch.float64, n, b), tr, causal, g)
    assert o.dtype == torch.bfloat16
    assert_within_2x_eager(o, eager, ref, "o")
    for name, a, e, r in zip(NAMES[:3], grads, egrads, rgrads):
        assert a.dtype == torch.bfloat16
        assert_within_2x_eager(a, e, r, name)
    if tr == "ssa":  # scalar sums that cancel: 2x eager + rtol x sum|terms|
        terms = ssa_scalar_grad_terms(q, k, v, n, b, g, causal=causal)
        for name, a, e, r, t in zip(NAMES[3:], grads[3:], egrads[3:], rgrads[3:], terms):
            assert_scalar_grad_close(name, a, r, t, torch.bfloat16, eager=e)


@pytest.mark.gpu_quick
def test_routing_uses_several_partitions_for_few_heads():
    plan = make_plan(1, 4, 4096, 4096, 64, torch.bfloat16, DEV)
    assert plan.num_partitions >= 2, plan
    assert make_plan(1, 16, 256, 256, 64, torch.bfloat16, DEV).num_partitions == 1


@pytest.mark.parametrize("N,P,causal,dtype", [
    pytest.param(1000, None, True, torch.bfloat16, id="T1000-Pauto-causal-bf16"),
    pytest.param(4096, 4, True, torch.float32, id="T4096-P4-causal-fp32", marks=pytest.mark.gpu_quick),
    pytest.param(4096, 4, False, torch.bfloat16, id="T4096-P4-full-bf16"),
    pytest.param(4096, None, True, torch.bfloat16, id="T4096-Pauto-causal-bf16"),
])
def test_structure_two_pass_round_trip(N, P, causal, dtype):
    q, k, v = make_qkv(1, 4, 2, N, N, 64, dtype, device=DEV)
    n, b = _params(requires_grad=False)
    st = elsa_structure(q, k, v, transform="ssa", n=n, b=b, causal=causal, num_partitions=P).verify()
    print(st.describe())
    if P is not None:
        assert st.num_partitions == P
    if causal and st.num_partitions > 1:
        assert st.phase1_launched == st.phase1_live < st.phase1_rectangle  # future partitions not launched
    ref = attention_naive(q.double(), k.double(), v.double(), transform="ssa", n=n.double(),
                          b=b.double(), causal=causal)
    assert rel_err(st.o, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_torch_compile_fullgraph():
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, torch.bfloat16, device=DEV, requires_grad=True)
    n, b = _params()

    @torch.compile(fullgraph=True)
    def f(q, k, v, n, b):
        return elsa_attention(q, k, v, transform="ssa", n=n, b=b, causal=True, num_partitions=2).float().square().sum()

    loss = f(q, k, v, n, b)
    loss.backward()
    eager = elsa_attention(q, k, v, transform="ssa", n=n, b=b, causal=True, num_partitions=2).float().square().sum()
    assert torch.allclose(loss, eager, rtol=1e-3)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, n, b))
