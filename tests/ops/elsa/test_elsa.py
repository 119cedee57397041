"""ELSA two-pass scan (nemo_ssa/ops/elsa) on CPU through the Triton interpreter.

Tiny shapes with 16x16 tiles, so N = 63 already spans 4 query blocks, 4 key tiles and up to
3 partitions. Forward and every gradient are compared with the float64 reference
``attention_naive``; the (m, l, acc) merge is checked on its own, in torch and through the
phase-2 kernel (``merge_finalize_partials``).
bf16 kernels are GPU-only here (the interpreter's bf16 ``tl.dot`` is wrong), fp16 covers the
16-bit path. GPU bounds live in ``test_elsa_gpu.py``.

Without CUDA this module sets ``TRITON_INTERPRET=1`` before the kernels are decorated. On
a CUDA machine it leaves the variable alone and runs the same cases on the GPU (same
16x16 tiling through ``routing.TILE_OVERRIDE``).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is decorated

import math

import pytest

from nemo_ssa.ops.elsa import (
    combine,
    elsa_attention,
    elsa_softmax_attention,
    elsa_ssa_attention,
    finalize_partials,
    identity_partial,
    merge_partials,
    num_partitions,
)
from nemo_ssa.ops.elsa import routing
from nemo_ssa.ops.elsa.introspect import elsa_structure
from nemo_ssa.ops.elsa.monoid import partial_of
from nemo_ssa.ops.elsa.scan import elsa_forward, kernels_interpreted, merge_finalize_partials
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.testing import (
    assert_scalar_grad_close,
    assert_within_2x_eager,
    case_id,
    make_qkv,
    poison_,
    rel_err,
    ssa_scalar_grad_terms,
)

F64 = torch.float64
LOG2E = 1.0 / math.log(2.0)

# interpreted kernels take CPU tensors; compiled ones (a CUDA machine) take CUDA tensors
DEV = "cpu" if kernels_interpreted() else "cuda"
needs_kernels = pytest.mark.skipif(
    not (kernels_interpreted() or torch.cuda.is_available()),
    reason="Triton kernels were built for GPU (TRITON_INTERPRET=1 was set after import) and no CUDA",
)


@pytest.fixture(autouse=True)
def _small_tiles():
    """The interpreter's 16x16 tiling everywhere (partition/liveness expectations below)."""
    old = routing.TILE_OVERRIDE
    routing.TILE_OVERRIDE = routing.INTERPRET_TILES if DEV == "cpu" else (16, 16, 4, 1)
    yield
    routing.TILE_OVERRIDE = old


def _qkv(*shape, dtype=torch.float32, requires_grad=False):
    q, k, v = make_qkv(*shape, dtype, device=DEV)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_kernels_are_interpreted_on_cpu():
    """Fails (not skips) when the suite imported the kernels before TRITON_INTERPRET=1 was set."""
    if not torch.cuda.is_available():
        assert kernels_interpreted(), "set TRITON_INTERPRET=1 before nemo_ssa.ops.elsa is imported"


# ----------------------------------------------------------------------------------------
# the (m, l, acc) monoid in torch
# ----------------------------------------------------------------------------------------


def _rand_partials(P, R, D, n_identity=1, dtype=F64):
    """P random partials over R rows (some rows of some partials are identities)."""
    m = torch.randn(P, R, dtype=dtype) * 3
    l = torch.rand(P, R, dtype=dtype) * 5 + 0.1
    acc = torch.randn(P, R, D, dtype=dtype)
    for i in range(n_identity):
        p, r = i % P, (3 * i) % R
        m[p, r], l[p, r], acc[p, r] = float("-inf"), 0.0, 0.0
    return m, l, acc


def _close(a, b, tol=1e-12):
    for x, y in zip(a, b):
        assert torch.equal(torch.isinf(x), torch.isinf(y))
        fin = torch.isfinite(y)
        assert torch.allclose(x[fin], y[fin], rtol=tol, atol=tol), (x, y)


def test_merge_associative_and_commutative():
    m, l, acc = _rand_partials(3, 7, 5, n_identity=3)
    a, b, c = [(m[i], l[i], acc[i]) for i in range(3)]
    left = combine(combine(a, b), c)
    right = combine(a, combine(b, c))
    _close(left, right)
    _close(combine(a, b), combine(b, a))
    _close(merge_partials(m, l, acc, dim=0), left)  # closed form == any fold order
    _close(merge_partials(m.flip(0), l.flip(0), acc.flip(0), dim=0), left)


def test_merge_identity_is_neutral_and_never_nan():
    m, l, acc = _rand_partials(1, 6, 4, n_identity=2)
    x = (m[0], l[0], acc[0])
    e = identity_partial((6,), 4, dtype=F64)
    _close(combine(x, e), x, tol=0)
    _close(combine(e, x), x, tol=0)
    ee = combine(e, e)  # -inf - -inf must not leak NaN
    assert not any(torch.isnan(t).any() for t in ee)
    assert (ee[0] == float("-inf")).all() and (ee[1] == 0).all() and (ee[2] == 0).all()
    stacked = [torch.stack([t, t]) for t in e]
    mm = merge_partials(*stacked, dim=0)
    assert not any(torch.isnan(t).any() for t in mm)
    o, M = finalize_partials(*mm)  # empty rows: o = 0, M = +inf
    assert (o == 0).all() and (M == float("inf")).all()


def test_merge_matches_direct_softmax_over_key_chunks():
    torch.manual_seed(0)
    R, J, D = 5, 23, 8
    z2 = torch.randn(R, J, dtype=F64) * 4
    z2[1, :] = float("-inf")  # a row that sees no key
    z2[2, 10:] = float("-inf")  # a row whose later chunks are empty
    v = torch.randn(J, D, dtype=F64)
    cuts = [0, 4, 4, 11, 17, 23]  # includes an empty chunk (identity everywhere)
    parts = [partial_of(z2[:, a:b], v[a:b]) if b > a else identity_partial((R,), D, dtype=F64)
             for a, b in zip(cuts, cuts[1:])]
    m, l, acc = (torch.stack(t, dim=1) for t in zip(*parts))  # partition axis 1: [R, P]
    o, M = finalize_partials(*merge_partials(m, l, acc, dim=1))
    p = torch.softmax(z2 / LOG2E, dim=-1).nan_to_num(0.0)  # z = z2 * ln 2
    ref = p @ v
    assert rel_err(o, ref) < 1e-13
    assert o[1].abs().sum() == 0 and M[1] == float("inf")
    lse2 = torch.logsumexp(z2 / LOG2E, dim=-1) * LOG2E
    assert torch.allclose(M[[0, 2, 3, 4]], lse2[[0, 2, 3, 4]], rtol=1e-13)
    # negative control: dropping the 2^(m_p - m*) rescaling gives a visibly wrong output
    bad = (acc.sum(1) / l.sum(1)[:, None])
    assert rel_err(bad[[0, 2, 3, 4]], ref[[0, 2, 3, 4]]) > 1e-2


def test_merge_partials_dim_keepdim_and_shape_errors():
    m, l, acc = _rand_partials(4, 6, 3)
    mt, lt, acct = m.t(), l.t(), acc.transpose(0, 1)  # partition axis last of m
    _close(merge_partials(mt, lt, acct, dim=-1), merge_partials(m, l, acc, dim=0))
    mk, lk, ak = merge_partials(m, l, acc, dim=0, keepdim=True)
    assert mk.shape == (1, 6) and ak.shape == (1, 6, 3)
    with pytest.raises(ValueError, match="acc"):
        merge_partials(m, l, acc[..., 0])


# ----------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------


def test_routing_rule():
    kw = dict(block_m=128, block_n=64, sms=132)
    assert num_partitions(1, 16, 256, 256, 64, **kw) == 1  # short -> one partition
    assert num_partitions(1, 16, 512, 512, 64, **kw) == 1
    # decode: one query row per head, long context -> split the keys to fill the GPU
    assert num_partitions(1, 8, 1, 32768, 64, **kw) == math.ceil(2 * 132 / 8)
    # many query blocks already fill the GPU: only the length bound splits
    long_p = num_partitions(1, 16, 32768, 32768, 64, **kw)
    assert long_p == 2  # ceil(32768 / max_part_keys)
    assert num_partitions(8, 16, 4096, 4096, 64, **kw) == 1
    # more SMs or fewer heads -> never fewer partitions
    assert num_partitions(1, 2, 2048, 2048, 64, **kw) >= num_partitions(1, 16, 2048, 2048, 64, **kw)
    # forced: clamped to [1, key tiles]
    assert num_partitions(1, 16, 100, 100, 64, forced=3, **kw) == 2  # 100 keys = 2 tiles of 64
    assert num_partitions(1, 16, 4096, 4096, 64, forced=5, **kw) == 5
    # summary budget: a huge problem stays at one partition
    assert num_partitions(64, 64, 65536, 65536, 128, **kw) == 1


# ----------------------------------------------------------------------------------------
# forward / backward vs float64 reference
# ----------------------------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, causal, forced partitions, transform)
CASES = [
    (1, 2, 1, 1, 1, 32, True, None, "softmax"),  # N = 1
    (1, 2, 2, 1, 1, 48, False, 2, "ssa"),  # forced 2 with one key tile -> 1
    (1, 4, 2, 63, 63, 32, True, 3, "ssa"),  # GQA, causal diagonal inside partitions
    (1, 4, 2, 63, 63, 32, False, 2, "softmax"),
    (1, 2, 1, 100, 100, 48, True, 2, "softmax"),  # N = 100: ragged tile, D = 48 padded
    (1, 2, 1, 100, 100, 48, False, 3, "ssa"),
    (1, 3, 3, 63, 63, 32, True, 1, "softmax"),  # one partition: phase 2 fused
    (2, 2, 1, 20, 37, 32, True, 2, "ssa"),  # Sq < Sk (bottom-right)
    (2, 2, 1, 37, 20, 48, True, 3, "softmax"),  # Sq > Sk: 17 rows see no key
    (1, 4, 1, 1, 100, 32, True, 3, "ssa"),  # decode: one query sees every key (split-K)
]


def _cid(c):
    B, Hq, Hkv, Sq, Sk, D, causal, P, tr = c
    return f"{case_id(B, Sq, Hq, Hkv, D, causal, torch.float32, Sk=Sk)}-P{P}-{tr}"


CASE_PARAMS = [pytest.param(c, id=_cid(c)) for c in CASES]


def _params(requires_grad=False):
    n = 0.5 + 1.5 * torch.rand(()).item()
    b = 0.3 + 1.2 * torch.rand(()).item()
    return (torch.tensor([n], device=DEV, requires_grad=requires_grad),
            torch.tensor([b], device=DEV, requires_grad=requires_grad))


def _ref(q, k, v, tr, n, b, causal, grad_out=None):
    """float64 reference output (and grads of <o, grad_out> w.r.t. q, k, v[, n, b])."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    kw = dict(transform=tr, causal=causal)
    if tr == "ssa":
        nb = [t.detach().double().requires_grad_() for t in (n, b)]
        leaves += nb
        kw.update(n=nb[0], b=nb[1])
    o = attention_naive(*leaves[:3], **kw)
    if grad_out is None:
        return o.detach(), None
    return o.detach(), torch.autograd.grad(o, leaves, grad_out.double())


@needs_kernels
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_forward_and_grads_match_reference(case):
    _assert_fwd_bwd_match_reference(case)


def _assert_fwd_bwd_match_reference(case):
    B, Hq, Hkv, Sq, Sk, D, causal, P, tr = case
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D, requires_grad=True)
    n, b = _params(requires_grad=True)
    kw = dict(transform=tr, causal=causal, num_partitions=P)
    leaves = [q, k, v]
    if tr == "ssa":
        kw.update(n=n, b=b)
        leaves += [n, b]
    o = elsa_attention(q, k, v, **kw)
    g = torch.randn_like(o)
    ref, ref_grads = _ref(q, k, v, tr, n, b, causal, g)
    assert o.dtype == torch.float32 and o.shape == (B, Hq, Sq, D)
    assert rel_err(o, ref) <= 2e-6, rel_err(o, ref)
    grads = torch.autograd.grad(o, leaves, g)
    terms = ssa_scalar_grad_terms(q, k, v, n, b, g, causal=causal) if tr == "ssa" else ()
    for i, (name, gk, gr) in enumerate(zip(["dq", "dk", "dv", "dn", "db"], grads, ref_grads)):
        assert gk.shape == gr.shape and gk.dtype == torch.float32, name
        if i < 3:
            assert rel_err(gk, gr) <= 2e-5, f"{name}: {rel_err(gk, gr):.2e}"
        else:  # scalar sums that may cancel: bound relative to sum|terms| (nemo_ssa.testing)
            assert_scalar_grad_close(name, gk, gr, terms[i - 3], torch.float32)
    if causal and Sq > Sk:  # rows 0 .. Sq-Sk-1 see nothing: exact zeros, zero grads
        assert (o[:, :, : Sq - Sk] == 0).all() and (grads[0][:, :, : Sq - Sk] == 0).all()


@needs_kernels
def test_partition_count_does_not_change_the_result():
    q, k, v = _qkv(1, 2, 1, 63, 63, 32)
    n, b = _params()
    outs = [elsa_ssa_attention(q, k, v, n, b, causal=True, num_partitions=p) for p in (1, 2, 3, 4)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-6
    ref, _ = _ref(q, k, v, "ssa", n, b, True)
    # negative controls: the comparison can fail (wrong mask / wrong transform are far off)
    assert rel_err(outs[2], _ref(q, k, v, "ssa", n, b, False)[0]) > 1e-2
    assert rel_err(outs[2], _ref(q, k, v, "softmax", None, None, True)[0]) > 1e-2
    assert rel_err(outs[2], ref) < 2e-6


@needs_kernels
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16_within_2x_eager(causal):
    q, k, v = _qkv(1, 4, 2, 63, 63, 32, dtype=torch.float16)
    n, b = _params()
    ref, _ = _ref(q, k, v, "ssa", n, b, causal)
    eager = attention_naive(q, k, v, transform="ssa", n=n, b=b, causal=causal, upcast=False)
    o = elsa_ssa_attention(q, k, v, n, b, causal=causal, num_partitions=3)
    assert o.dtype == torch.float16
    assert_within_2x_eager(o, eager, ref, "elsa-fp16")


@needs_kernels
def test_strided_inputs_and_softmax_scale():
    B, S, Hq, Hkv, D = 2, 40, 4, 2, 32
    qs = torch.randn(B, S, Hq, D, device=DEV)  # Megatron-like [b, s, h, d] viewed as [b, h, s, d]
    kv = torch.randn(B, S, 2, Hkv, D, device=DEV)  # k and v interleaved in one buffer
    q, k, v = qs.transpose(1, 2), kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    o = elsa_softmax_attention(q, k, v, causal=True, softmax_scale=0.3, num_partitions=2)
    ref = attention_naive(q.double(), k.double(), v.double(), transform="softmax", causal=True,
                          softmax_scale=0.3)
    assert rel_err(o, ref) <= 2e-6
    oc = elsa_softmax_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                                softmax_scale=0.3, num_partitions=2)
    assert rel_err(o, oc) < 1e-6


@needs_kernels
@pytest.mark.parametrize("P", [1, 3])
def test_every_output_written_nan_poisoned(P):
    """Outputs start as NaN: any element the forward skips stays NaN and fails.

    (The backward's outputs are the shared ``attention_bwd``'s, poisoned in its own tests.)
    """
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 37, 20, 48  # empty rows, ragged tiles, padded D
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D)
    n, b = _params()
    o = poison_(torch.empty(B, Hq, Sq, D, device=DEV))
    lse = poison_(torch.empty(B, Hq, Sq, device=DEV))
    elsa_forward(q, k, v, n, b, transform=1, causal=True, scale=D ** -0.5, num_partitions=P, out=(o, lse))
    assert torch.isfinite(o).all() and not torch.isnan(lse).any()
    assert (lse[:, :, : Sq - Sk] == float("inf")).all() and torch.isfinite(lse[:, :, Sq - Sk:]).all()
    ref, _ = _ref(q, k, v, "ssa", n, b, True)
    assert rel_err(o, ref) <= 2e-6


@needs_kernels
@pytest.mark.parametrize("causal,Sq,Sk,P", [(True, 63, 63, 3), (False, 63, 63, 1), (True, 37, 20, 2)],
                         ids=["causal-T63-P3", "full-T63-P1-two-pass", "causal-T37-TK20-P2"])
def test_structure_summaries_round_trip(causal, Sq, Sk, P):
    q, k, v = _qkv(1, 2, 1, Sq, Sk, 48)
    n, b = _params()
    st = elsa_structure(q, k, v, transform="ssa", n=n, b=b, causal=causal, num_partitions=P).verify()
    assert st.num_partitions == P
    ref, _ = _ref(q, k, v, "ssa", n, b, causal)
    assert rel_err(st.o, ref) <= 2e-6
    if causal and Sq == Sk:  # 16-row blocks, partitions = key tiles [0,1), [1,2), [2,4)
        assert st.live_per_q_block == [1, 2, 3, 3]
        assert st.phase1_launched == 9 * 2 < st.phase1_rectangle  # future partitions not launched
    if causal and Sq > Sk:
        assert st.live_per_q_block[0] == 0  # rows 0..15 see no key: nothing computed
    assert "K-partitions" in st.describe()
    # the check can fail: a summary that phase 2 reads, corrupted, breaks the equality
    st.acc[0, 0, 0, -1, 0] += 1.0
    with pytest.raises(AssertionError):
        st.verify()


def test_compact_grid_host_count_matches_live_set():
    """Closed-form live pairs (``first_live_q_block``, the kernel's decode) == enumeration."""
    for (bm, bn), Sq, Sk, P in [((16, 16), 63, 63, 3), ((16, 16), 20, 70, 5), ((16, 16), 90, 40, 3),
                                ((16, 32), 100, 33, 2), ((32, 16), 1, 100, 7), ((16, 16), 300, 17, 2),
                                ((64, 32), 1000, 4000, 64), ((128, 64), 4000, 1000, 7)]:
        plan = routing.ElsaPlan(bm, bn, 16, 1, 1, 16, 1, -(-Sq // bm), -(-Sk // bn),
                                num_partitions(1, 1, Sq, Sk, 16, block_m=bm, block_n=bn, sms=8, forced=P))
        live = {(qb, p) for qb in range(plan.n_q_blocks) for p in range(plan.num_partitions)
                if plan.partition_keys(p, Sk)[0] <= min((qb + 1) * bm, Sq) - 1 + Sk - Sq}
        closed = {(qb, p) for p in range(plan.num_partitions)
                  for qb in range(plan.first_live_q_block(p, Sq, Sk), plan.n_q_blocks)}
        assert closed == live, (bm, bn, Sq, Sk, P)
        counts = [plan.live_partitions(qb, Sq, Sk, True) for qb in range(plan.n_q_blocks)]
        assert sorted(live) == [(qb, p) for qb, c in enumerate(counts) for p in range(c)]  # prefixes
        assert plan.phase1_grid(2, 3, Sq, Sk, causal=True, fused=False) == (sum(counts), 6)
        assert plan.phase1_grid(2, 3, Sq, Sk, causal=True, fused=True) == (plan.n_q_blocks, plan.num_partitions, 6)
        assert plan.phase1_grid(2, 3, Sq, Sk, causal=False, fused=False) == (plan.n_q_blocks, plan.num_partitions, 6)


# (B, Hq, Hkv, Sq, Sk, D, causal, forced partitions, transform): several partitions, Sq != Sk
COMPACT_CASES = [
    (1, 2, 1, 40, 60, 32, True, 4, "ssa"),  # Sq < Sk: live per block [3, 4, 4]
    (2, 2, 1, 90, 40, 16, True, 3, "softmax"),  # Sq > Sk: 3 blocks see no key: no program
]


@needs_kernels
@pytest.mark.parametrize("case", [pytest.param(c, id=_cid(c)) for c in COMPACT_CASES])
def test_causal_phase1_launches_only_live_pairs(case):
    """Causal, P > 1: the phase-1 grid is the live (query block, partition) pairs, no more."""
    B, Hq, Hkv, Sq, Sk, D, causal, P, tr = case
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D)
    n, b = _params()
    kw = dict(n=n, b=b) if tr == "ssa" else {}
    st = elsa_structure(q, k, v, transform=tr, causal=True, num_partitions=P, **kw).verify()
    live = [st.plan.live_partitions(qb, Sq, Sk, True) for qb in range(st.plan.n_q_blocks)]
    assert st.num_partitions == P and st.phase1_grid == (sum(live), B * Hq)
    assert st.phase1_launched == sum(live) * B * Hq < st.phase1_rectangle
    assert f"launched {st.phase1_launched} (live pairs) of {st.phase1_rectangle}" in st.describe()
    ref, _ = _ref(q, k, v, tr, n, b, True)
    assert rel_err(st.o, ref) <= 2e-6
    _assert_fwd_bwd_match_reference(case)  # and through autograd (fused routing not involved)


# ----------------------------------------------------------------------------------------
# the phase-2 kernel on caller partials (context-parallel / split-K merge)
# ----------------------------------------------------------------------------------------


def _partials_with_identities(P, B, H, S, D):
    """fp32 partials ``[P, B, H, S(, D)]``; some identities, and row S-1 all-identity."""
    m, l, acc = _rand_partials(P, B * H * S, D, n_identity=5, dtype=torch.float32)
    m, l, acc = m.view(P, B, H, S), l.view(P, B, H, S), acc.view(P, B, H, S, D)
    m[:, :, :, -1], l[:, :, :, -1], acc[:, :, :, -1] = float("-inf"), 0.0, 0.0
    m[1:, 0, 0, 0], l[1:, 0, 0, 0], acc[1:, 0, 0, 0] = float("-inf"), 0.0, 0.0  # one live partial
    return m, l, acc


def _assert_matches_torch_merge(o, M, m, l, acc):
    o_ref, M_ref = finalize_partials(*merge_partials(m.double(), l.double(), acc.double(), dim=0))
    assert torch.equal(torch.isinf(M), torch.isinf(M_ref)) and not torch.isnan(M).any()
    fin = torch.isfinite(M_ref)
    assert torch.allclose(M[fin].double(), M_ref[fin], rtol=1e-6, atol=1e-6)
    assert (o[~fin] == 0).all() and (M[~fin] == float("inf")).all()  # all-identity rows
    assert rel_err(o, o_ref) <= (2e-6 if o.dtype == torch.float32 else 1e-3)


@needs_kernels
@pytest.mark.parametrize("P,D", [(1, 16), (3, 24), (5, 40)], ids=["P1-D16", "P3-D24", "P5-D40"])
def test_merge_finalize_partials_kernel_matches_torch_monoid(P, D):
    B, H, S = 2, 2, 20
    m, l, acc = _partials_with_identities(P, B, H, S, D)
    o, M = merge_finalize_partials(m.to(DEV), l.to(DEV), acc.to(DEV))
    assert o.shape == (B, H, S, D) and o.dtype == torch.float32 and M.shape == (B, H, S)
    _assert_matches_torch_merge(o.cpu(), M.cpu(), m, l, acc)
    assert (M[:, :, -1] == float("inf")).all() and (o[:, :, -1] == 0).all()
    # every partial the identity: identity out, never NaN
    e = identity_partial((P, 1, 1, 3), D, device=DEV)
    o_e, M_e = merge_finalize_partials(*e)
    assert (o_e == 0).all() and (M_e == float("inf")).all()


@needs_kernels
def test_merge_finalize_partials_strided_and_out_dtype():
    P, B, H, S, D = 3, 1, 2, 17, 32
    m, l, acc = _partials_with_identities(P, B, H, S, D)
    # ELSA's own summary layout [B, H, P, S(, D)] seen as [P, B, H, S(, D)]; l with other strides
    m_s = m.permute(1, 2, 0, 3).contiguous().to(DEV).permute(2, 0, 1, 3)
    acc_s = acc.permute(1, 2, 0, 3, 4).contiguous().to(DEV).permute(2, 0, 1, 3, 4)
    assert not m_s.is_contiguous() and not acc_s.is_contiguous()
    for l_s in (l.permute(1, 2, 0, 3).contiguous().to(DEV).permute(2, 0, 1, 3), l.to(DEV)):
        o, M = merge_finalize_partials(m_s, l_s, acc_s)
        _assert_matches_torch_merge(o.cpu(), M.cpu(), m, l, acc)
    o16, M16 = merge_finalize_partials(m_s, l_s, acc_s, out_dtype=torch.float16)
    assert o16.dtype == torch.float16 and torch.equal(M16, M)
    _assert_matches_torch_merge(o16.cpu(), M16.cpu(), m, l, acc)


@needs_kernels
def test_merge_finalize_partials_split_k_decode():
    """Split-K decode: per-chunk partials of one query row, merged by the kernel == attention."""
    B, H, Sk, D = 1, 2, 50, 32
    q, k, v = _qkv(B, H, H, 1, Sk, D)
    z2 = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5 * LOG2E  # [B, H, 1, Sk]
    cuts = [0, 13, 13, 30, 50]  # an empty chunk: identity partial
    parts = [partial_of(z2[..., a:c], v.double()[..., a:c, :]) if c > a else
             identity_partial((B, H, 1), D, dtype=F64, device=DEV) for a, c in zip(cuts, cuts[1:])]
    m, l, acc = (torch.stack(t).float() for t in zip(*parts))  # [P, B, H, 1(, D)]
    o, M = merge_finalize_partials(m, l, acc)
    ref = attention_naive(q.double(), k.double(), v.double(), transform="softmax")
    assert rel_err(o, ref) <= 2e-6
    lse2 = torch.logsumexp(z2 / LOG2E, dim=-1) * LOG2E
    assert torch.allclose(M.double(), lse2, rtol=1e-6)


def test_merge_finalize_partials_validation():
    m, l, acc = identity_partial((2, 1, 1, 4), 16, device=DEV)
    with pytest.raises(ValueError, match="float32"):
        merge_finalize_partials(m.double(), l, acc)
    with pytest.raises(ValueError, match=r"acc \[P, B, H, S, D\]"):
        merge_finalize_partials(m, l, acc[..., 0])
    with pytest.raises(ValueError, match="D <= 256"):
        merge_finalize_partials(*identity_partial((2, 1, 1, 4), 300, device=DEV))
    with pytest.raises(ValueError, match="out_dtype"):
        merge_finalize_partials(m, l, acc, out_dtype=torch.float64)


@needs_kernels
def test_opcheck_forward_op():
    """torch.library registration (fake impl, schema, autograd) is consistent."""
    from nemo_ssa.ops.elsa.scan import _elsa_fwd_op

    q, k, v = _qkv(1, 2, 1, 17, 17, 16, requires_grad=True)
    n, b = _params(requires_grad=True)
    torch.library.opcheck(_elsa_fwd_op, (q, k, v, n, b, "ssa", True, 0.25, 2, "ieee", False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@needs_kernels
def test_torch_compile_fullgraph_sees_one_custom_op():
    """Dynamo traces validation + routing and keeps the kernels as the custom op (aot_eager)."""
    q, k, v = _qkv(1, 2, 1, 40, 40, 32, requires_grad=True)
    n, b = _params(requires_grad=True)

    def f(q, k, v, n, b):
        return elsa_ssa_attention(q, k, v, n, b, causal=True, num_partitions=2).square().sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, n, b)
    grads = torch.autograd.grad(loss, (q, k, v, n, b))
    loss_e = f(q, k, v, n, b)
    grads_e = torch.autograd.grad(loss_e, (q, k, v, n, b))
    assert torch.allclose(loss, loss_e, rtol=1e-6)
    for a, e in zip(grads, grads_e):
        assert rel_err(a, e) < 1e-6


# ----------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------


def _bad(**over):
    q, k, v = _qkv(1, 4, 2, 3, 5, 16)
    n, b = _params()
    kw = dict(q=q, k=k, v=v, transform="ssa", n=n, b=b)
    # the table's tensors are built at collection time on the CPU: move them to the
    # device under test so each case fails on the property it names, not on devices
    kw.update({key: (t.to(DEV) if isinstance(t, torch.Tensor) else t) for key, t in over.items()})
    return kw


INVALID = [
    pytest.param(dict(dropout_p=0.1), "dropout", id="dropout"),
    pytest.param(dict(keep_mask=torch.ones(3, 5, dtype=torch.bool)), "keep_mask", id="keep-mask"),
    pytest.param(dict(q=torch.randn(1, 4, 3, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8)),
                 "head dims: 16 <= D <= 256", id="D8"),
    pytest.param(dict(q=torch.randn(1, 4, 3, 320), k=torch.randn(1, 2, 5, 320), v=torch.randn(1, 2, 5, 320)),
                 "head dims: 16 <= D <= 256", id="D320"),
    pytest.param(dict(q=torch.randn(1, 4, 3, 16, dtype=F64), k=torch.randn(1, 2, 5, 16, dtype=F64),
                      v=torch.randn(1, 2, 5, 16, dtype=F64)), "float16, bfloat16, float32", id="fp64"),
    pytest.param(dict(num_partitions=0), "num_partitions", id="partitions-0"),
    pytest.param(dict(num_partitions=2.0), "num_partitions", id="partitions-float"),
    pytest.param(dict(softmax_scale=-1.0), "softmax_scale > 0", id="negative-scale"),
    pytest.param(dict(fp32_precision="bf16"), "fp32_precision", id="precision"),
    pytest.param(dict(transform="sigmoid"), "unknown transform", id="transform-name"),
    pytest.param(dict(n=None), "needs `n`", id="n-missing"),
    pytest.param(dict(k=torch.randn(1, 3, 5, 16), v=torch.randn(1, 3, 5, 16)), "multiple of kv heads", id="gqa"),
]


@pytest.mark.parametrize("over,match", INVALID)
def test_input_validation(over, match):
    with pytest.raises(ValueError, match=match):
        elsa_attention(**_bad(**over))


@needs_kernels
def test_deterministic_argument_takes_the_two_kernel_backward(monkeypatch):
    """``elsa_attention(deterministic=True)``: the shared backward's dQ kernel runs even where
    its mode says single pass (``NEMO_SSA_BWD=atomic``); None keeps the single pass."""
    from nemo_ssa.ops.common import launch as launcher
    from nemo_ssa.ops.elsa import elsa_attention

    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    real = launcher.launch
    q, k, v = _qkv(1, 2, 1, 33, 33, 16, requires_grad=True)
    for det, want in ((None, False), (True, True)):
        names = []

        def rec(kernel, grid, args, meta, ntensors=None, cached=True):
            names.append(getattr(kernel, "__name__", str(kernel)))
            return real(kernel, grid, args, meta, ntensors, cached)

        monkeypatch.setattr(launcher, "launch", rec)  # launch_kw's positional call
        o = elsa_attention(q, k, v, transform="softmax", causal=True, deterministic=det)
        torch.autograd.grad(o.sum(), [q, k, v])
        assert ("attn_bwd_kernel_dq" in names) == want, (det, names)
    with pytest.raises(TypeError, match="deterministic must be None or a bool"):
        elsa_attention(q, k, v, transform="softmax", deterministic="yes")
