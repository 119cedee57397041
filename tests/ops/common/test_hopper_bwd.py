"""The attention backward's Gluon single pass (``ops.common.hopper_bwd``).

* CPU: the warp-specialised kernel compiles for sm_90 for every table row, causal and full
  (warpgroup MMAs, TMA copies, the bulk-tensor dq reduce, ``setmaxnreg``; SSA with its ``dn``
  partials), with few spill stores -- Gluon has no interpreter; ``gluon_bwd_config`` takes the
  table rows only where they apply; ``single_pass_pays`` chooses the single pass wherever the
  Gluon kernel can run; ``attention_bwd`` routes a non-deterministic call to it and a
  deterministic one to the two Triton kernels.
* GPU (sm_90), softmax and SSA at D64 (the pipelined consumers for SSA) and D128: dq, dk, dv
  and SSA's dn (from the forward's row means C; bit-identical run to run) within 2x the eager
  bf16 error of the fp32 reference, NaN-poisoned outputs, on odd lengths, GQA, causal and
  full, N = 1 and 17, Sq != Sk both ways, Megatron's ``[s, b, h, d]`` layout; the public op
  takes it when the backward may be non-deterministic and not when deterministic.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import nemo_ssa.ops.common.bwd as B  # noqa: E402
import nemo_ssa.ops.common.hopper_bwd as H  # noqa: E402
from nemo_ssa.ops.attention.naive import attention_naive  # noqa: E402
from nemo_ssa.ops.common import bwd_config, dispatch, target  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.testing import assert_within_2x_eager  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ON_SM90 = CUDA and not is_interpreter() and torch.cuda.get_device_capability() == (9, 0)

COMPILE = r"""
import os, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from nemo_ssa.ops.common import hopper_bwd as H

def desc(rows, d, dt="bf16"):
    lay = gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], gl.bfloat16 if dt == "bf16" else gl.float32)
    return f"tensordesc<{dt}[1,1,{rows},{d}],{lay!r}>"

fn = H._hopper_bwd_ws_kernel
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for (d, tr), cfg in sorted(H.GLUON_BWD.items()):
    bn = 16 * cfg.num_warps
    # SSA: with the dn partials (a learnable n) causal and full, and without them (n fixed)
    for causal, dn in ((True, True), (False, True)) + (((True, False),) if tr == "ssa" else ()):
        sig = {}
        for a in fn.arg_names:
            if a in ("q_desc", "do_desc"):
                sig[a] = desc(cfg.block_m, d)
            elif a in ("k_desc", "v_desc", "dk_desc", "dv_desc"):
                sig[a] = desc(bn, d)
            elif a == "dq_desc":
                sig[a] = desc(cfg.block_m, d, "fp32")
            elif a in ("M", "Delta", "CS", "NP", "BP"):
                sig[a] = "*fp32"
            elif a == "DN":
                sig[a] = "*fp64"
            elif a == "scale":
                sig[a] = "fp32"
            elif a in ("TRANSFORM", "DN_KV", "CAUSAL", "STAGES", "PIPELINE", "FOLD_RCP", "DS_SMEM", "num_warps"):
                sig[a] = "constexpr"
            else:
                sig[a] = "i32"
        # SSA with its dn partials (the pinned policy's learnable n): the heavier variant
        consts = dict(TRANSFORM=int(tr == "ssa"), DN_KV=dn and tr == "ssa", CAUSAL=causal, STAGES=cfg.stages,
                      PIPELINE=bool(cfg.pipeline), FOLD_RCP=cfg.fold_rcp if tr == "ssa" else 0,
                      DS_SMEM=bool(cfg.ds_smem), num_warps=cfg.num_warps)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("M", "Delta", "CS")}
        k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
        ptx = k.asm["ptx"]
        for what in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor", "setmaxnreg"):
            assert what in ptx, (d, tr, causal, what)
        if tr == "ssa":  # the forward's log2 (transforms.log2_fast mode 1) and the fast reciprocal
            assert "lg2.approx.ftz.f32" in ptx, (d, causal)
            # fold_rcp: 1/t comes out of the exp2 (P/t), so no MUFU rcp is left at all
            assert ("rcp.approx.ftz.f32" in ptx) != bool(cfg.fold_rcp), (d, causal, cfg.fold_rcp)
        assert k.metadata.shared <= 232448, k.metadata.shared  # sm_90's shared memory per block
        spills = -1
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                sass = subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True, text=True).stdout
            spills = sass.count("STL")
            # spill stores in the consumers' loop cost SSA at D128 a fifth of its time (93 stores:
            # 1.55x cuDNN; 10: 1.27x, docs/results/2026-11-26-gluon-ssa): keep them few
            assert spills <= 16, (d, tr, causal, spills)
        print("ok", d, tr, causal, dn, "spills", spills, flush=True)
"""


def _single(transform, d, **kw):
    return dispatch.backward_schedule(transform, d, **kw).path == dispatch.SINGLE


@pytest.mark.slow
def test_gluon_backward_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == sum(3 if tr == "ssa" else 2 for _, tr in H.GLUON_BWD)


def _big(d=128, dtype=torch.bfloat16, h=1, s=4096, device="cpu"):
    return torch.zeros(1, h, s, d, dtype=dtype, device=device)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_GLUON", raising=False)
    with target.stand_in(target.H100):
        yield


def _cfg(q, k=None, do=None, o=None, transform="softmax", **kw):
    k = q if k is None else k
    args = dict(varlen=False, dropout=False)
    args.update(kw)
    return H.gluon_bwd_config(transform, q, k, k, q if do is None else do, q if o is None else o, **args)


def test_gluon_bwd_config_takes_the_table_rows(sm90, monkeypatch):
    q = _big()
    for d, tr in H.GLUON_BWD:
        assert _cfg(_big(d), transform=tr) == H.GLUON_BWD[(d, tr)]
    assert _cfg(q) == H.GLUON_BWD[(128, "softmax")]
    assert _cfg(_big(128, torch.float16)) is not None
    assert _cfg(q, transform="ssa", fast_log2=0) is None  # the forward's z came from another log2
    assert _cfg(q, transform="ssa", fast_log2=3) is None
    assert _cfg(q, transform="softmax", fast_log2=0) is not None  # softmax has no log2
    assert _cfg(_big(32)) is None and _cfg(_big(96)) is None and _cfg(_big(256)) is None
    assert _cfg(q, dropout=True) is None and _cfg(q, varlen=True) is None
    assert _cfg(_big(128, torch.float32)) is None
    assert _cfg(_big(128, s=1024)) is None  # below MIN_SCORES
    assert _cfg(q, do=q.transpose(2, 3).contiguous().transpose(2, 3)) is None  # dO's last dim strided
    assert _cfg(q, o=_big(128, torch.float16)) is not None  # (o's dtype is the forward's business)
    assert _cfg(q, do=_big(128, torch.float16)) is None
    monkeypatch.setenv("NEMO_SSA_GLUON", "0")
    assert _cfg(q) is None
    monkeypatch.delenv("NEMO_SSA_GLUON")
    with target.stand_in(target.Target("cuda", (10, 0), 148)):  # Blackwell: no wgmma
        assert _cfg(q) is None


def test_single_pass_pays_where_the_gluon_kernel_runs():
    for tr in ("softmax", "ssa"):
        assert bwd_config.single_pass_pays(tr, 128, gluon=True)
    assert not bwd_config.single_pass_pays("softmax", 128)
    assert not bwd_config.single_pass_pays("ssa", 128)
    assert not bwd_config.single_pass_pays("softmax", 64)
    assert bwd_config.single_pass_pays("ssa", 32) and bwd_config.single_pass_pays("ssa", 64, tma=True)


def test_deterministic_mode_keeps_the_two_kernels(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_BWD", raising=False)
    assert _single("softmax", 128, gluon=True)
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert not _single("softmax", 128, gluon=True)
    finally:
        torch.use_deterministic_algorithms(prev)
    monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
    assert not _single("softmax", 128, gluon=True)


@pytest.mark.skipif(CUDA and not is_interpreter(), reason="CPU routing check (the GPU cases cover the kernel)")
def test_attention_bwd_routes_non_deterministic_calls_to_the_gluon_kernel(monkeypatch):
    got = []
    monkeypatch.setattr(B, "gluon_bwd_config", lambda *a, **kw: H.GLUON_BWD[(128, "softmax")])
    monkeypatch.setattr(B, "launch_gluon_bwd", lambda *a, **kw: got.append(kw))
    q = torch.randn(1, 2, 9, 128)
    o, do = torch.randn_like(q), torch.randn_like(q)
    M = torch.zeros(1, 2, 9)
    B.attention_bwd(do, q, q, q, o, M, transform="softmax", causal=True, deterministic=False)
    assert len(got) == 1 and got[0]["causal"] is True and got[0]["config"] == H.GLUON_BWD[(128, "softmax")]
    B.attention_bwd(do, q, q, q, o, M, transform="softmax", causal=True, deterministic=True)
    assert len(got) == 1  # deterministic: the two Triton kernels


# -------------------------------------------------------------------------------------
# GPU (sm_90)
# -------------------------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, causal, megatron_layout); D = 128
GPU_CASES = [
    (2, 4, 2, 1000, 1000, True, True),
    (1, 4, 1, 777, 777, True, False),
    (1, 2, 2, 300, 1000, False, False),
    (1, 2, 2, 300, 1000, True, True),
    (1, 2, 2, 1000, 300, True, False),
    (1, 2, 1, 1, 1, True, False),
    (1, 2, 1, 17, 17, True, True),
    (1, 3, 3, 2048, 2048, True, False),
]


def _case_id(c):
    B_, Hq, Hkv, Sq, Sk, causal, meg = c
    return f"B{B_}-H{Hq}x{Hkv}-T{Sq}-TK{Sk}-{'causal' if causal else 'full'}{'-sbhd' if meg else ''}"


def _inputs(B_, Hq, Hkv, Sq, Sk, megatron, seed, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(S, H_):
        if megatron:  # [s, b, h, d] memory, used as [b, h, s, d]
            return torch.randn(S, B_, H_, D, device="cuda", generator=g).to(torch.bfloat16).permute(1, 2, 0, 3)
        return torch.randn(B_, H_, S, D, device="cuda", generator=g).to(torch.bfloat16)
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


def _nb(transform, seed, grad=False):
    """SSA's (n, b): n drawn around the policy's 1.5, b around 0.8; {} for softmax."""
    if transform != "ssa":
        return {}
    g = torch.Generator().manual_seed(seed)
    n, b = 1.0 + torch.rand((), generator=g).item(), 0.5 + 0.6 * torch.rand((), generator=g).item()
    return dict(n=torch.tensor([n], device="cuda", requires_grad=grad), b=torch.tensor([b], device="cuda"))


def _reference(q, k, v, do, causal, transform="softmax", nb=None):
    """fp32 and same-dtype eager gradients ``(dq, dk, dv[, dn])`` of the naive attention."""
    nb = nb or {}
    out = []
    for upcast in (True, False):
        leaves = [t.detach().float().requires_grad_(True) if upcast else t.detach().requires_grad_(True)
                  for t in (q, k, v)]
        n = nb.get("n")
        if n is not None:
            n = n.detach().float().requires_grad_(True)
            leaves.append(n)
        kw = dict(n=n, b=nb["b"].float()) if nb else {}
        o = attention_naive(*leaves[:3], transform=transform, causal=causal, upcast=upcast, **kw)
        out.append(torch.autograd.grad(o, leaves, do.float() if upcast else do))
    return out[0], out[1]


@pytest.mark.gpu
@pytest.mark.gpu_quick
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("transform", ["softmax", "ssa"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gluon_backward_matches_reference(case, transform, D, monkeypatch):
    from nemo_ssa.ops.attention import flash as fl
    from nemo_ssa.testing import assert_scalar_grad_close, ssa_scalar_grad_terms

    B_, Hq, Hkv, Sq, Sk, causal, meg = case
    q, k, v, do = _inputs(B_, Hq, Hkv, Sq, Sk, meg, seed=Sq * 7 + Hq + D, D=D)
    nb = _nb(transform, Sq + Hq)
    ssa = transform == "ssa"
    # the forward writes C (SSA's dn partials need it), as the public op's does for a learnable n
    o, M, C = fl._flash_fwd(q, k, v, nb.get("n"), nb.get("b"), None, None, None, transform, causal, D ** -0.5,
                            0.0, Sq, Sk, "ieee", True, save_c=ssa)
    monkeypatch.setattr(H, "MIN_SCORES", 0)  # the small cases take the kernel too
    calls = []
    real = B.launch_gluon_bwd

    def spy(*a, **kw):
        calls.append(kw)
        for t in a[4:6]:  # dk, dv: poisoned, so an unwritten element fails
            t.fill_(float("nan"))
        if kw.get("dn_part") is not None:
            kw["dn_part"].fill_(float("nan"))
        return real(*a, **kw)

    monkeypatch.setattr(B, "launch_gluon_bwd", spy)
    dq, dk, dv, dn, _ = B.attention_bwd(do, q, k, v, o, M, transform=transform, causal=causal, need_db=False,
                                        cstat=C, deterministic=False, **nb)
    assert calls, "the call did not take the Gluon backward"
    assert (calls[0]["cstat"] is not None) == ssa and calls[0]["config"] == H.GLUON_BWD[(D, transform)]
    g_ref, g_eag = _reference(q, k, v, do, causal, transform, nb)
    for name, g, e, r in zip(("dq", "dk", "dv"), (dq, dk, dv), g_eag, g_ref):
        assert not g.isnan().any(), name
        assert_within_2x_eager(g, e, r, name)
    if ssa:
        tn, _ = ssa_scalar_grad_terms(q.float(), k.float(), v.float(), nb["n"], nb["b"], do.float(), causal=causal)
        assert_scalar_grad_close("dn", dn, g_ref[3], tn, torch.bfloat16, eager=g_eag[3])
        again = B.attention_bwd(do, q, k, v, o, M, transform=transform, causal=causal, need_db=False, cstat=C,
                                deterministic=False, **nb)[3]
        assert torch.equal(dn, again)  # fixed-order partials: bit-identical run to run
    else:
        assert dn is None


# SSA variants of the kernel outside the table (measured, kept as options): the reciprocal
# folded into the exp2 or not, dS^T for dK from registers or from shared memory, at both widths
_SSA_VARIANTS = [(64, H.GluonBwdConfig(64, 8, 3, 168, pipeline=1)),
                 (64, H.GluonBwdConfig(64, 8, 3, 168, pipeline=1, fold_rcp=1)),
                 (64, H.GluonBwdConfig(64, 8, 3, 168, pipeline=1, ds_smem=1)),
                 (64, H.GluonBwdConfig(64, 8, 2, 168, fold_rcp=1)),
                 (128, H.GluonBwdConfig(64, 8, 2, 168, fold_rcp=1))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("D,cfg", _SSA_VARIANTS, ids=lambda x: str(x) if isinstance(x, int) else
                         f"pp{x.pipeline}-fold{x.fold_rcp}-ds{x.ds_smem}")
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3], GPU_CASES[6]], ids=_case_id)
def test_gluon_backward_ssa_variants(case, D, cfg, monkeypatch):
    from nemo_ssa.ops.attention import flash as fl
    from nemo_ssa.testing import assert_scalar_grad_close, ssa_scalar_grad_terms

    B_, Hq, Hkv, Sq, Sk, causal, meg = case
    q, k, v, do = _inputs(B_, Hq, Hkv, Sq, Sk, meg, seed=Sq * 5 + D, D=D)
    nb = _nb("ssa", Sq + D)
    o, M, C = fl._flash_fwd(q, k, v, nb["n"], nb["b"], None, None, None, "ssa", causal, D ** -0.5, 0.0, Sq, Sk,
                            "ieee", True, save_c=True)
    monkeypatch.setattr(H, "MIN_SCORES", 0)
    monkeypatch.setitem(H.GLUON_BWD, (D, "ssa"), cfg)
    calls = []
    real = B.launch_gluon_bwd

    def spy(*a, **kw):
        calls.append(kw)
        for t in a[4:6]:
            t.fill_(float("nan"))
        return real(*a, **kw)

    monkeypatch.setattr(B, "launch_gluon_bwd", spy)
    dq, dk, dv, dn, _ = B.attention_bwd(do, q, k, v, o, M, transform="ssa", causal=causal, need_db=False, cstat=C,
                                        deterministic=False, **nb)
    assert calls and calls[0]["config"] == cfg
    g_ref, g_eag = _reference(q, k, v, do, causal, "ssa", nb)
    for name, g, e, r in zip(("dq", "dk", "dv"), (dq, dk, dv), g_eag, g_ref):
        assert not g.isnan().any(), name
        assert_within_2x_eager(g, e, r, name)
    tn, _ = ssa_scalar_grad_terms(q.float(), k.float(), v.float(), nb["n"], nb["b"], do.float(), causal=causal)
    assert_scalar_grad_close("dn", dn, g_ref[3], tn, torch.bfloat16, eager=g_eag[3])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_backward_ssa_with_fixed_n(D, monkeypatch):
    """SSA with n fixed (no dn wanted): the kernel's variant without C and without dn partials."""
    from nemo_ssa.ops.attention.flash import ssa_attention_triton

    calls = []
    real = B.launch_gluon_bwd
    monkeypatch.setattr(B, "launch_gluon_bwd", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    q, k, v, do = _inputs(1, 4, 2, 2048, 2048, False, seed=11, D=D)
    nb = _nb("ssa", 7)  # n, b without gradients
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    grads = torch.autograd.grad(ssa_attention_triton(*leaves, nb["n"], nb["b"], causal=True), leaves, do)
    assert len(calls) == 1 and calls[0]["cstat"] is None and calls[0]["transform_id"] == 1
    g_ref, g_eag = _reference(q, k, v, do, True, "ssa", nb)
    for name, g, e, r in zip(("dq", "dk", "dv"), grads, g_eag, g_ref):
        assert_within_2x_eager(g, e, r, name)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("transform", ["softmax", "ssa"])
@pytest.mark.parametrize("D", [64, 128])
def test_public_op_takes_the_gluon_backward_unless_deterministic(transform, D, monkeypatch):
    from nemo_ssa.ops.attention.flash import softmax_attention_triton, ssa_attention_triton
    from nemo_ssa.testing import assert_scalar_grad_close, ssa_scalar_grad_terms

    calls = []
    real = B.launch_gluon_bwd
    monkeypatch.setattr(B, "launch_gluon_bwd", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    q, k, v, do = _inputs(1, 4, 2, 2048, 2048, True, seed=3, D=D)  # 2^24 scores: the table path
    nb = _nb(transform, 5, grad=True)  # the pinned policy: n learnable, b fixed
    g_ref, g_eag = _reference(q, k, v, do, True, transform, nb)
    for det, want in ((None, 1), (True, 0)):
        calls.clear()
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        if transform == "ssa":
            n = nb["n"].detach().requires_grad_(True)
            out = ssa_attention_triton(*leaves, n, nb["b"], causal=True, deterministic=det)
            leaves.append(n)
        else:
            out = softmax_attention_triton(*leaves, causal=True, deterministic=det)
        grads = torch.autograd.grad(out, leaves, do)
        assert len(calls) == want, det
        for name, g, e, r in zip(("dq", "dk", "dv"), grads, g_eag, g_ref):
            assert_within_2x_eager(g, e, r, name)
        if transform == "ssa":
            assert calls[0]["cstat"] is not None if want else True  # the forward wrote C
            tn, _ = ssa_scalar_grad_terms(q.float(), k.float(), v.float(), nb["n"].detach(), nb["b"], do.float(),
                                          causal=True)
            assert_scalar_grad_close("dn", grads[3], g_ref[3], tn, torch.bfloat16, eager=g_eag[3])


def test_gluon_runs_only_on_the_triton_it_was_built_for():
    """Gluon's API moves between Triton releases: on any Triton but 3.6 the Triton kernels run
    (NeMo FW 25.11 ships 3.5.1, whose Gluon imports but has other signatures)."""
    import triton

    from nemo_ssa.ops.common import gluon_math as G

    assert G.triton_version("3.5.1") == (3, 5) and G.triton_version("3.6.0+git4d1f") == (3, 6)
    assert G.GLUON_TRITON == (3, 6)
    if G.triton_version(triton.__version__) != G.GLUON_TRITON:
        assert not G.HAVE_GLUON and not H.HAVE_GLUON
