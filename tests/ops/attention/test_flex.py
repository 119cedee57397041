"""SSA through FlexAttention (nemo_ssa/ops/attention/flex.py), CPU side.

FlexAttention has no CPU backward for q/k/v, so here: the score_mod itself through
autograd (fp64 gradcheck for n and b, with a negative control that detaches n), forward
against the float64 reference (causal/full, GQA, odd and unequal lengths, rows without
keys, mask_mod and keep_mask), dn/db through every dn strategy (n, b are the only leaves
that require grad, which CPU flex allows), the Triton dn kernel under the interpreter
(in a subprocess: TRITON_INTERPRET must be set before triton is imported), backend
validation and compile gating (its log lines). Eager flex only (compile=False or
gated): compiled CPU flex is inference-only and takes ~20 s to build.
GPU forward + all gradients: test_flex_gpu.py.
"""

import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn.attention.flex_attention import or_masks

import nemo_ssa.ops.attention.flex as flex
from nemo_ssa.ops.attention.flex import (
    resolve_compile,
    resolve_dn_mode,
    ssa_attention_flex,
    ssa_flex_param_grads,
    ssa_score_mod,
)
from nemo_ssa.ops.attention.naive import ssa_attention_naive, ssa_transform
from nemo_ssa.testing import (
    assert_scalar_grad_close,
    assert_within_2x_eager,
    case_id,
    make_qkv,
    rel_err,
    ssa_scalar_grad_terms,
)

F64 = torch.float64
LOGGER = "nemo_ssa.ops.attention.flex"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(autouse=True)
def _fresh_flex_state():
    """Log-once memory and compile fallbacks are process-wide; isolate tests."""
    flex._LOGGED.clear()
    flex._COMPILE_BROKEN.clear()
    yield
    flex._LOGGED.clear()
    flex._COMPILE_BROKEN.clear()


def _params(dtype=torch.float32, n=None, b=None, requires_grad=False):
    """Shape-[1] n in [0.5, 2], b in [0.3, 1.5] (random unless given)."""
    n = 0.5 + 1.5 * torch.rand(()).item() if n is None else n
    b = 0.3 + 1.2 * torch.rand(()).item() if b is None else b
    return (torch.tensor([n], dtype=dtype, requires_grad=requires_grad),
            torch.tensor([b], dtype=dtype, requires_grad=requires_grad))


def _idx(m):
    z = torch.zeros(m, dtype=torch.int32)
    return z, z, torch.arange(m, dtype=torch.int32), torch.arange(m, dtype=torch.int32)


# ------------------------------------------------------------------ score_mod autograd


def _detached_score_mod(n, b, scale=1.0):
    """Negative control: the seed's bug (n, b turned into Python floats)."""
    n_val, b_val = float(n.detach()), float(b.detach())

    def score_mod(score, batch, head, q_idx, kv_idx):
        t = score * scale
        sg = torch.where(t >= 0, 1.0, -1.0).to(t.dtype)
        return n_val * sg * torch.log1p(b_val * t * sg)

    return score_mod


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_score_mod_gradcheck_n_b_and_score(scale):
    s = torch.tensor([-3.0, -0.7, -1e-3, 0.2, 0.9, 2.5], dtype=F64, requires_grad=True)
    n, b = _params(F64, requires_grad=True)

    def f(s, n, b):
        return ssa_score_mod(n, b, scale)(s, *_idx(s.numel()))

    assert torch.autograd.gradcheck(f, (s, n, b), eps=1e-6, atol=1e-8, rtol=1e-6)
    # 0-d parameters are accepted too (reshaped to [1] inside, the form that compiles)
    n0, b0 = n.detach().reshape(()).requires_grad_(), b.detach().reshape(()).requires_grad_()
    assert torch.autograd.gradcheck(f, (s, n0, b0), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_score_mod_gradcheck_fails_when_n_is_detached():
    """The check above can fail: the seed's float(n) score_mod does not pass it."""
    s = torch.tensor([-1.5, 0.4, 2.0], dtype=F64, requires_grad=True)
    n, b = _params(F64, requires_grad=True)

    def f(s, n, b):
        return _detached_score_mod(n, b)(s, *_idx(3))

    with pytest.raises(Exception):  # gradcheck: analytical dn = 0 vs numerical != 0
        torch.autograd.gradcheck(f, (s, n, b), eps=1e-6, atol=1e-8, rtol=1e-6)
    z = f(s, n, b)
    assert torch.autograd.grad(z.sum(), (n,), allow_unused=True)[0] is None


def test_score_mod_matches_reference_transform_and_formulas():
    """Value = naive.ssa_transform; dz/ds = n b/(1+b|s|) also at s=0; dz/dn, dz/db per element."""
    s = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0], dtype=F64, requires_grad=True)
    n, b = _params(F64, n=1.5, b=0.8, requires_grad=True)
    z = ssa_score_mod(n, b)(s, *_idx(5))
    torch.testing.assert_close(z, ssa_transform(s, n, b), rtol=0, atol=1e-15)
    a, sg = s.detach().abs(), torch.where(s.detach() >= 0, 1.0, -1.0).to(F64)
    gs, = torch.autograd.grad(z.sum(), s, retain_graph=True)
    torch.testing.assert_close(gs, 1.5 * 0.8 / (1 + 0.8 * a))  # 1.2 at s = 0, not 0
    for i in range(5):  # element by element: a sign error cannot cancel
        dn, db = torch.autograd.grad(z[i], (n, b), retain_graph=True)
        torch.testing.assert_close(dn, (sg * torch.log1p(0.8 * a))[i:i + 1])
        torch.testing.assert_close(db, (1.5 * s.detach() / (1 + 0.8 * a))[i:i + 1])


def test_score_mod_rejects_python_floats():
    with pytest.raises(ValueError, match="1-element tensor"):
        ssa_score_mod(1.5, torch.tensor([0.8]))
    with pytest.raises(ValueError, match="1-element tensor"):
        ssa_score_mod(torch.ones(2), torch.tensor([0.8]))


# --------------------------------------------------------------------- forward (CPU)

# (B, Hq, Hkv, Sq, Sk, D): odd sizes, GQA, Sq < Sk and Sq > Sk (first rows see nothing)
FWD_CASES = [
    (1, 2, 2, 1, 1, 16),
    (2, 6, 2, 37, 37, 16),
    (1, 4, 1, 63, 63, 48),
    (2, 6, 2, 5, 9, 32),
    (1, 4, 2, 9, 5, 16),
]
FWD_PARAMS = [
    pytest.param(c, causal, dt, id=case_id(c[0], c[3], c[1], c[2], c[5], causal, dt, Sk=c[4]))
    for c in FWD_CASES for causal in (False, True) for dt in (torch.float32, F64)
]


@pytest.mark.parametrize("case,causal,dtype", FWD_PARAMS)
def test_forward_matches_reference(case, causal, dtype):
    B, Hq, Hkv, Sq, Sk, D = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype)
    n, b = _params(dtype)
    with torch.no_grad():
        out = ssa_attention_flex(q, k, v, n, b, causal=causal, compile=False)
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=causal)
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, D)
    assert rel_err(out, ref) < (1e-12 if dtype == F64 else 2e-6)
    if causal and Sq > Sk:  # bottom-right: rows i < Sq - Sk see no key -> exactly 0
        assert (out[:, :, : Sq - Sk] == 0).all()


def test_forward_bf16_within_2x_eager_and_custom_scale():
    q, k, v = make_qkv(2, 4, 2, 45, 45, 32, torch.bfloat16)
    n, b = _params()
    with torch.no_grad():
        out = ssa_attention_flex(q, k, v, n, b, causal=True, softmax_scale=0.3, compile=False)
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=True,
                              softmax_scale=0.3)
    eager = ssa_attention_naive(q, k, v, n, b, causal=True, softmax_scale=0.3, upcast=False)
    assert out.dtype == torch.bfloat16
    assert_within_2x_eager(out, eager, ref, "o-bf16")


def _doc_ids(B, S, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    cuts = torch.rand(B, S, generator=g) < 0.15
    cuts[:, 0] = False
    return cuts.cumsum(-1)  # [B, S] document index per position


def _mask_cases():
    """(name, factory -> (mask_mod, keep_mask [B|1, Hq|1, S, S]), causal, per_head); B=2, Hq=4, S=41."""
    B, S = 2, 41

    def documents():
        doc = _doc_ids(B, S)
        mod = lambda b, h, qi, ki: doc[b, qi] == doc[b, ki]  # noqa: E731
        keep = doc[:, None, :, None] == doc[:, None, None, :]
        return mod, keep

    def prefix_lm():
        prefix = 11
        mod = or_masks(lambda b, h, qi, ki: ki <= qi, lambda b, h, qi, ki: ki < prefix)
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        return mod, ((j <= i) | (j < prefix))[None, None]

    def window_per_head():
        w = torch.tensor([2, 5, 9, 40])
        mod = lambda b, h, qi, ki: qi - ki <= w[h]  # noqa: E731
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        return mod, (i - j)[None, None] <= w[None, :, None, None]

    return [("documents", documents, True, False), ("prefix_lm", prefix_lm, False, False),
            ("window_per_head", window_per_head, True, True)]


MASK_CASES = [pytest.param(*c, id=c[0]) for c in _mask_cases()]


@pytest.mark.parametrize("name,make,causal,per_head", MASK_CASES)
def test_forward_mask_mod_matches_reference_keep_mask(name, make, causal, per_head):
    B, Hq, Hkv, S, D = 2, 4, 2, 41, 16
    q, k, v = make_qkv(B, Hq, Hkv, S, S, D, F64)
    n, b = _params(F64)
    mod, keep = make()
    with torch.no_grad():
        out = ssa_attention_flex(q, k, v, n, b, causal=causal, mask_mod=mod, mask_per_head=per_head,
                                 compile=False)
        via_keep = ssa_attention_flex(q, k, v, n, b, causal=causal, keep_mask=keep, compile=False)
    ref = ssa_attention_naive(q, k, v, n, b, causal=causal, keep_mask=keep)
    assert rel_err(out, ref) < 1e-12, name
    assert rel_err(via_keep, ref) < 1e-12, name


def test_keep_mask_empty_row_is_zero():
    q, k, v = make_qkv(2, 4, 2, 7, 7, 16, F64)
    n, b = _params(F64)
    keep = torch.rand(2, 1, 7, 7) > 0.3
    keep[1, 0, 4] = False  # row 4 of batch 1 sees nothing (all heads)
    with torch.no_grad():
        out = ssa_attention_flex(q, k, v, n, b, causal=True, keep_mask=keep, compile=False)
    ref = ssa_attention_naive(q, k, v, n, b, causal=True, keep_mask=keep)
    assert rel_err(out, ref) < 1e-12
    assert (out[1, :, 4] == 0).all() and torch.isfinite(out).all()


# ------------------------------------------------------- dn, db (n, b are the CPU leaves)

GRAD_MODES = ["chunked", "flex", "capture", "capture_rows"]
GRAD_CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal)
    pytest.param((2, 6, 2, 37, 37, 16, True), id="B2-T37-HQ6-HKV2-D16-causal"),
    pytest.param((1, 4, 1, 5, 9, 16, True), id="B1-T5-TK9-HQ4-HKV1-D16-causal"),
    pytest.param((1, 2, 2, 9, 5, 16, True), id="B1-T9-TK5-HQ2-HKV2-D16-causal-emptyrows"),
    pytest.param((2, 4, 2, 13, 13, 16, False), id="B2-T13-HQ4-HKV2-D16-full"),
]


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("mode", GRAD_MODES)
def test_dn_db_every_mode_matches_reference(case, mode):
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, F64)
    n, b = _params(F64, requires_grad=True)
    go = torch.randn(B, Hq, Sq, D, dtype=F64)
    out = ssa_attention_flex(q, k, v, n, b, causal=causal, compile=False, dn_mode=mode)
    dn, db = torch.autograd.grad(out, (n, b), go)
    ref = ssa_attention_naive(q, k, v, n, b, causal=causal)
    dn_r, db_r = torch.autograd.grad(ref, (n, b), go)
    assert rel_err(out, ref) < 1e-12
    assert dn.abs().item() > 0 and db.abs().item() > 0  # learnable, not detached
    # scalar sums that may cancel: bounded by sum |terms| (nemo_ssa.testing), fp64 rtol
    tn, tb = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)
    assert_scalar_grad_close("dn", dn, dn_r, tn, F64)
    assert_scalar_grad_close("db", db, db_r, tb, F64)


@pytest.mark.parametrize("mode", ["chunked", "flex", "capture"])
@pytest.mark.parametrize("name,make,causal,per_head", MASK_CASES)
def test_dn_db_with_mask_mod(mode, name, make, causal, per_head):
    B, Hq, Hkv, S, D = 2, 4, 2, 41, 16
    q, k, v = make_qkv(B, Hq, Hkv, S, S, D, F64)
    n, b = _params(F64, requires_grad=True)
    mod, keep = make()
    go = torch.randn(B, Hq, S, D, dtype=F64)
    out = ssa_attention_flex(q, k, v, n, b, causal=causal, mask_mod=mod, mask_per_head=per_head,
                             compile=False, dn_mode=mode)
    grads = torch.autograd.grad(out, (n, b), go)
    ref = ssa_attention_naive(q, k, v, n, b, causal=causal, keep_mask=keep)
    grads_r = torch.autograd.grad(ref, (n, b), go)
    terms = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal, mask=keep)
    for nm, g, gr, t in zip("nb", grads, grads_r, terms):
        assert_scalar_grad_close(f"{name}/{mode}: d{nm}", g, gr, t, F64)


def test_dn_only_when_b_is_fixed_and_param_dtype_kept():
    """b fixed by policy: flex mode stacks 2 weight heads, db is None; n in bf16 gets a bf16 grad."""
    q, k, v = make_qkv(1, 4, 2, 20, 20, 16, torch.float32)
    n = torch.tensor([1.5], dtype=torch.bfloat16, requires_grad=True)
    b = torch.tensor([0.8])
    go = torch.randn(1, 4, 20, 16)
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=True)
    dn_r, = torch.autograd.grad(ref, (n,), go.double())
    tn, _ = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True)
    for mode in ("flex", "chunked"):
        out = ssa_attention_flex(q, k, v, n, b, causal=True, compile=False, dn_mode=mode)
        dn, = torch.autograd.grad(out, (n,), go)
        assert dn.dtype == torch.bfloat16 and dn.shape == (1,)
        # fp32 computation (bounded by sum|terms|) + rounding the result to bf16 (relative)
        err, bound = abs(dn.double().item() - dn_r.item()), 2.0 ** -8 * abs(dn_r.item()) + 2e-5 * tn
        assert err <= bound, (mode, err, bound)


def test_param_grads_entry_point_fp32_modes_agree():
    q, k, v = make_qkv(2, 4, 2, 30, 30, 16, torch.float32)
    n, b = _params()
    go = torch.randn(2, 4, 30, 16)
    nr, br = n.double().requires_grad_(), b.double().requires_grad_()
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), nr, br, causal=True)
    dn_r, db_r = torch.autograd.grad(ref, (nr, br), go.double())
    s = ssa_transform(q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4.0,
                      nr.detach(), br.detach())
    s = s.masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1).float()
    tn, tb = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True)
    for mode in ("chunked", "flex"):
        dn, db = ssa_flex_param_grads(q, k, v, ref.detach().float(), go, lse, n, b, causal=True, mode=mode)
        assert dn.dtype == F64 and dn.dim() == 0
        assert_scalar_grad_close(f"{mode}: dn", dn, dn_r, tn, torch.float32)
        assert_scalar_grad_close(f"{mode}: db", db, db_r, tb, torch.float32)
    with pytest.raises(ValueError, match="mode must be"):
        ssa_flex_param_grads(q, k, v, ref.float(), go, lse, n, b, mode="capture")


# ------------------------------------------------ Triton dn kernel (interpreter, subprocess)

_TRITON_SCRIPT = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(1)
    import nemo_ssa.ops.attention.flex as flex
    from nemo_ssa.ops.attention.naive import ssa_attention_naive
    from nemo_ssa.testing import make_qkv, rel_err, ssa_scalar_grad_terms
    assert flex._TRITON_IMPORT_ERROR is None, flex._TRITON_IMPORT_ERROR
    assert flex._kernel_interpreted()
    torch.manual_seed(int(SEED))
    res = {}
    # (B, Hq, Hkv, Sq, Sk, D, causal): 64-wide blocks, so 70/90 cover ragged tails, D=24/48 pads
    for case in [(1, 4, 2, 70, 70, 24, True), (1, 2, 1, 33, 90, 16, True),
                 (1, 2, 2, 90, 33, 48, True), (2, 2, 1, 40, 40, 16, False)]:
        B, Hq, Hkv, Sq, Sk, D, causal = case
        q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.float32)
        go = torch.randn(B, Hq, Sq, D)
        n = torch.tensor([1.3], requires_grad=True)
        b = torch.tensor([0.7], requires_grad=True)
        ref = ssa_attention_naive(q.double(), k.double(), v.double(), n, b, causal=causal)
        dn_r, db_r = torch.autograd.grad(ref, (n, b), go.double())
        runs = []
        for _ in range(2):
            out = flex.ssa_attention_flex(q, k, v, n, b, causal=causal, compile=False, dn_mode="triton")
            runs.append(torch.autograd.grad(out, (n, b), go))
        (dn, db), (dn2, db2) = runs
        tn, tb = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=causal)
        # dn/db errors relative to sum |terms| (sums that may cancel; nemo_ssa.testing)
        res[str(case)] = dict(o=rel_err(out, ref), dn=abs(dn.item() - dn_r.item()) / tn,
                              db=abs(db.item() - db_r.item()) / tb,
                              same=bool(torch.equal(dn, dn2) and torch.equal(db, db2)))
    # the stored o enters only through the delta, which the kernel replaces by the exact
    # sum_j p dp: o rounded to bf16 or even perturbed by 1e-2 must not move dn/db
    B, Hq, Hkv, S, D = 1, 4, 2, 70, 32
    q, k, v = make_qkv(B, Hq, Hkv, S, S, D, torch.float32)
    go = torch.randn(B, Hq, S, D)
    n, b = torch.tensor([1.5]), torch.tensor([0.8])
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=True)
    s2 = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / D ** 0.5
    z = torch.where(s2 >= 0, 1.5, -1.5) * torch.log1p(0.8 * s2.abs())
    lse = torch.logsumexp(z.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -float("inf")), -1).float()
    tn, tb = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True)
    exact = flex.ssa_flex_param_grads(q, k, v, ref.float(), go, lse, n, b, causal=True, mode="triton")
    for label, o in (("bf16", ref.bfloat16()), ("noisy", (ref + 1e-2 * torch.randn_like(ref)).float())):
        got = flex.ssa_flex_param_grads(q, k, v, o, go, lse, n, b, causal=True, mode="triton")
        res["stored-o " + label] = dict(o=0.0, dn=abs(got[0].item() - exact[0].item()) / tn,
                                        db=abs(got[1].item() - exact[1].item()) / tb, same=True)
    print("RESULT " + json.dumps(res))
    """
)


def test_triton_dn_kernel_interpreted_matches_reference_and_is_deterministic():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    seed = torch.randint(0, 2 ** 31, ()).item()  # from the test's own seed (conftest)
    proc = subprocess.run([sys.executable, "-c", f"SEED = {seed}\n" + _TRITON_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[0][len("RESULT "):])
    assert len(res) == 6
    for case, r in res.items():  # dn/db: |err| / sum|terms| (fp32 rtol of nemo_ssa.testing)
        assert r["o"] < 2e-6 and r["dn"] < 2e-5 and r["db"] < 2e-5, (case, r)
        assert r["same"], f"{case}: dn/db differ between two identical runs"


@pytest.mark.parametrize("mode", ["chunked", "flex"])
def test_dn_db_do_not_depend_on_the_stored_output(mode):
    """dn/db use the exact row delta sum_j p dp, not do . o of the stored (16-bit) o:
    o rounded to bf16, or perturbed by 1e-2, leaves them unchanged to fp32 rounding. With
    the stored o's delta the perturbation moves dn by ~1e-3 of sum|terms| (the control)."""
    B, Hq, Hkv, S, D = 1, 4, 2, 30, 16
    q, k, v = make_qkv(B, Hq, Hkv, S, S, D, torch.float32)
    go = torch.randn(B, Hq, S, D)
    n, b = torch.tensor([1.5]), torch.tensor([0.8])
    ref = ssa_attention_naive(q.double(), k.double(), v.double(), n.double(), b.double(), causal=True)
    s = ssa_transform(q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4.0, n.double(), b.double())
    lse = torch.logsumexp(s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf), -1).float()
    tn, tb = ssa_scalar_grad_terms(q, k, v, n, b, go, causal=True)
    exact = ssa_flex_param_grads(q, k, v, ref.float(), go, lse, n, b, causal=True, mode=mode)
    noisy = (ref + 1e-2 * torch.randn_like(ref))
    for o in (ref.bfloat16(), noisy.bfloat16()):
        got = ssa_flex_param_grads(q, k, v, o, go, lse, n, b, causal=True, mode=mode)
        assert_scalar_grad_close("dn", got[0], exact[0], tn, torch.float32)
        assert_scalar_grad_close("db", got[1], exact[1], tb, torch.float32)
    # control: the delta of the perturbed stored o moves dn by far more than the bound
    p = torch.softmax(s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf), -1)
    dp = go.double() @ v.double().repeat_interleave(2, 1).transpose(-1, -2)
    g = s / 1.5  # s holds z = n sgn ln(1 + b|.|), so dz/dn = z / n
    dn_stored = (p * (dp - (noisy * go.double()).sum(-1, keepdim=True)) * g).sum()
    with pytest.raises(AssertionError, match="dn"):
        assert_scalar_grad_close("dn", dn_stored, exact[0], tn, torch.float32)


# ----------------------------------------------------------- dn_mode, backend, compile


def test_dn_mode_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dn_mode("auto", cpu, torch.float32, False) == "chunked"
    assert resolve_dn_mode("auto", cuda, torch.bfloat16, True) == "flex"
    assert resolve_dn_mode("auto", cuda, torch.float64, False) == "chunked"
    expect = "triton" if flex._TRITON_IMPORT_ERROR is None and not flex._kernel_interpreted() else "flex"
    assert resolve_dn_mode("auto", cuda, torch.bfloat16, False) == expect
    with pytest.raises(ValueError, match="causal/full masks only"):
        resolve_dn_mode("triton", cuda, torch.bfloat16, True)
    with pytest.raises(ValueError, match="unknown dn_mode"):
        resolve_dn_mode("atomic", cpu, torch.float32, False)
    # past the kernels' head dim (the GPU ops fuzz: D 291 ran out of shared memory on an H200)
    assert resolve_dn_mode("auto", cuda, torch.float32, False, 291) == "chunked"
    assert resolve_dn_mode("auto", cuda, torch.float32, True, 291) == "chunked"
    assert resolve_dn_mode("auto", cuda, torch.float32, False, 256) == expect
    with pytest.raises(ValueError, match="head dim <= 256, got 291"):
        resolve_dn_mode("triton", cuda, torch.float32, False, 291)


def _spy_flex(monkeypatch):
    calls = []
    real = flex.flex_attention

    def spy(q, k, v, **kw):
        calls.append(dict(kw))
        kw.pop("kernel_options", None)
        return real(q, k, v, **kw)

    monkeypatch.setattr(flex, "flex_attention", spy)
    return calls


def test_backend_auto_passes_no_kernel_options(monkeypatch):
    calls = _spy_flex(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    n, b = _params()
    with torch.no_grad():
        for name in ("auto", "AUTO", "Auto"):
            ssa_attention_flex(q, k, v, n, b, causal=True, compile=False, backend=name)
    assert len(calls) == 3 and all("kernel_options" not in c for c in calls)


def test_explicit_backend_reaches_the_compiled_call(monkeypatch):
    """A valid explicit backend becomes {"BACKEND": NAME} on the compiled call only."""
    if "triton" not in flex.supported_backends():
        pytest.skip(f"torch {torch.__version__} has no BACKEND kernel option")
    calls = _spy_flex(monkeypatch)
    monkeypatch.setattr(flex, "_compiled_fn", lambda kind: flex.flex_attention)  # no real compile
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    n, b = _params()
    with torch.no_grad():
        ssa_attention_flex(q, k, v, n, b, causal=True, compile=True, backend="triton")
    assert calls[-1]["kernel_options"] == {"BACKEND": "TRITON"}


@pytest.mark.parametrize("backend,match", [
    ("cudnn", "unknown FlexAttention backend"),
    (None, "must be a string"),
    ("triton", "selects a compiled FlexAttention kernel"),  # eager flex cannot honour it
])
def test_backend_validation_errors(backend, match):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    n, b = _params()
    if backend == "triton" and "triton" not in flex.supported_backends():
        match = "not available in torch"
    with pytest.raises(ValueError, match=match), torch.no_grad():
        ssa_attention_flex(q, k, v, n, b, compile=False, backend=backend)


def test_backend_missing_from_installed_torch(monkeypatch):
    monkeypatch.delattr(flex._fa, "_Backend", raising=False)  # an older torch
    assert flex.supported_backends() == ("auto",)
    with pytest.raises(ValueError, match="not available in torch"):
        flex._kernel_options("flash")
    assert flex._kernel_options("auto") is None


def test_compile_gating_decisions_and_logs(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        use, reason = resolve_compile("auto", cpu, 32, True)
        assert resolve_compile("auto", cpu, 32, True) == (use, reason)  # second call: no new log
        assert not use and "CPU is inference-only" in reason
        use, reason = resolve_compile("auto", cuda, 8, True)
        assert not use and "head dim >= 16" in reason
        use, reason = resolve_compile("auto", cuda, 291, True)
        assert not use and "head dim <= 256" in reason
        assert resolve_compile("auto", cuda, 256, True) == (True, None)
    text = caplog.text
    assert "CPU is inference-only" in text and "head dim >= 16" in text
    assert text.count("CPU is inference-only") == 1  # logged once per reason, not per call
    assert resolve_compile("auto", cuda, 32, True) == (True, None)
    assert resolve_compile("auto", cpu, 32, False) == (True, None)  # CPU inference compiles
    assert resolve_compile(False, cuda, 32, True) == (False, "compile=False")
    with pytest.raises(ValueError, match="compile=True is not possible here: .*inference-only"):
        resolve_compile(True, cpu, 32, True)
    with pytest.raises(ValueError, match="compile must be"):
        resolve_compile("yes", cpu, 32, True)


def test_compiled_cpu_flex_needs_the_torch_it_ran_on(monkeypatch):
    """torch 2.9.1 (NeMo FW 25.11) aborts the process in compiled CPU FlexAttention: older
    torch runs it eager on CPU; CUDA is not gated by this."""
    assert flex._torch_version("2.9.1+cu128") == (2, 9) and flex._torch_version("2.13.0") == (2, 13)
    monkeypatch.setattr(flex, "_torch_version", lambda version=None: (2, 9))
    use, reason = resolve_compile("auto", torch.device("cpu"), 32, False)
    assert not use and "needs torch >= 2.11" in reason
    assert resolve_compile("auto", torch.device("cuda"), 32, True) == (True, None)
    with pytest.raises(ValueError, match="needs torch >= 2.11"):
        resolve_compile(True, torch.device("cpu"), 32, False)


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_compile_gating_avoids_the_cpu_microgemm_overrun(monkeypatch, caplog, lanes):
    """Issue 47: compiled CPU flex overruns its score tile at head dims that are a multiple of
    the ISA's float lanes and below 24, on ISAs narrower than its 16-key tile. Those run
    eager (logged); other head dims, CUDA and 16-lane ISAs keep compiling. The overrun
    itself is shown in tests/megatron/test_module_poison.py under an 8-lane ISA."""
    monkeypatch.setattr(flex, "_cpu_float_lanes", lambda: lanes)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for d in (8, 12, 16, 20, 24, 32, 48):
        broken = lanes < 16 and d % lanes == 0 and d < 24
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            use, reason = resolve_compile("auto", cpu, d, False)
        assert use is not broken, (lanes, d, reason)
        if broken:
            assert f"{lanes} float lanes" in reason and f"head dim {d}" in reason
            with pytest.raises(ValueError, match="compile=True is not possible here: .*reads past K"):
                resolve_compile(True, cpu, d, False)
        if d >= 16:  # CUDA flex is Triton-generated: no CPU micro-GEMM, never gated by this
            assert resolve_compile("auto", cuda, d, False) == (True, None)
    assert ("reads past K" in caplog.text) is (lanes < 16)


def test_cpu_float_lanes_reads_inductors_isa():
    assert flex._cpu_float_lanes() in (4, 8, 16)


def test_public_call_logs_its_eager_fallback(caplog):
    """n learnable on CPU: compile='auto' runs eager flex and says why."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    n, b = _params(requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = ssa_attention_flex(q, k, v, n, b, causal=True)  # compile="auto"
    assert "running eager FlexAttention" in caplog.text and "inference-only" in caplog.text
    assert torch.autograd.grad(out.sum(), n)[0].abs().item() > 0
    with pytest.raises(ValueError, match="compile=True is not possible"):
        ssa_attention_flex(q, k, v, n, b, causal=True, compile=True)


def test_compile_error_falls_back_with_log_under_auto_and_raises_under_true(monkeypatch, caplog):
    def broken(kind):
        def fn(*a, **kw):
            raise RuntimeError("simulated inductor failure")
        return fn

    monkeypatch.setattr(flex, "_compiled_fn", broken)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32)
    n, b = _params()
    ref = ssa_attention_naive(q, k, v, n, b, causal=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():
        out = ssa_attention_flex(q, k, v, n, b, causal=True, compile="auto")  # CPU inference: compiles
    assert rel_err(out, ref) < 2e-6
    assert "falling back to eager" in caplog.text and "simulated inductor failure" in caplog.text
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.no_grad():  # later calls: gated + logged
        ssa_attention_flex(q, k, v, n, b, causal=True, compile="auto")
    assert "running eager FlexAttention" in caplog.text
    flex._COMPILE_BROKEN.clear()
    with pytest.raises(RuntimeError, match="simulated"), torch.no_grad():
        ssa_attention_flex(q, k, v, n, b, causal=True, compile=True)


# ------------------------------------------------------------------------ validation


def _bad(**over):
    q, k, v = make_qkv(1, 4, 2, 3, 5, 16, torch.float32)
    n, b = _params()
    kw = dict(q=q, k=k, v=v, n=n, b=b, compile=False)
    kw.update(over)
    return kw


INVALID = [
    pytest.param(dict(dropout_p=0.1), ValueError, "no dropout", id="dropout"),
    pytest.param(dict(n=1.5), ValueError, "torch.Tensor", id="n-python-float"),
    pytest.param(dict(mask_mod=3), ValueError, "mask_mod must be callable", id="mask-mod"),
    pytest.param(dict(softmax_scale=-0.5), ValueError, "softmax_scale must be > 0", id="negative-scale"),
    pytest.param(dict(dn_mode="atomic", n=torch.tensor([1.0], requires_grad=True)), ValueError,
                 "unknown dn_mode", id="dn-mode"),
    pytest.param(dict(compile="sometimes"), ValueError, "compile must be", id="compile-value"),
    pytest.param(dict(q=torch.randn(1, 4, 3, 16, requires_grad=True)), NotImplementedError,
                 "no CPU backward", id="cpu-qkv-grad"),
    pytest.param(dict(k=torch.randn(1, 3, 5, 16), v=torch.randn(1, 3, 5, 16)), ValueError,
                 "multiple of kv heads", id="gqa"),
]


@pytest.mark.parametrize("over,exc,match", INVALID)
def test_input_validation(over, exc, match):
    kw = _bad(**over)
    with pytest.raises(exc, match=match):
        ssa_attention_flex(**kw)
