"""The attention backward's Gluon single pass (``ops.common.hopper_bwd``).

* CPU: the warp-specialised kernel compiles for sm_90 for every table row, causal and full
  (warpgroup MMAs, TMA copies, the bulk-tensor dq reduce, ``setmaxnreg``) -- Gluon has no
  interpreter; ``gluon_bwd_config`` takes it only where it applies; ``single_pass_pays``
  chooses the single pass for softmax at D128 only where the Gluon kernel can run;
  ``attention_bwd`` routes a non-deterministic call to it and a deterministic one to the two
  Triton kernels.
* GPU (sm_90): dq, dk, dv within 2x the eager bf16 error of the fp32 reference, NaN-poisoned
  outputs, on odd lengths, GQA, causal and full, N = 1 and 17, Sq != Sk both ways,
  Megatron's ``[s, b, h, d]`` layout; the public op takes it when the backward may be
  non-deterministic and not when deterministic.
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
from nemo_ssa.ops.common import bwd_config  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.testing import assert_within_2x_eager  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ON_SM90 = CUDA and not is_interpreter() and torch.cuda.get_device_capability() == (9, 0)

COMPILE = r"""
import os
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
for (d, tr), cfg in sorted(H.GLUON_BWD.items()):
    bn = 16 * cfg.num_warps
    for causal in (True, False):
        sig = {}
        for a in fn.arg_names:
            if a in ("q_desc", "do_desc"):
                sig[a] = desc(cfg.block_m, d)
            elif a in ("k_desc", "v_desc", "dk_desc", "dv_desc"):
                sig[a] = desc(bn, d)
            elif a == "dq_desc":
                sig[a] = desc(cfg.block_m, d, "fp32")
            elif a in ("M", "Delta"):
                sig[a] = "*fp32"
            elif a == "scale":
                sig[a] = "fp32"
            elif a in ("CAUSAL", "STAGES", "num_warps"):
                sig[a] = "constexpr"
            else:
                sig[a] = "i32"
        consts = dict(CAUSAL=causal, STAGES=cfg.stages, num_warps=cfg.num_warps)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("M", "Delta")}
        k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
        ptx = k.asm["ptx"]
        for what in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor", "setmaxnreg"):
            assert what in ptx, (d, tr, causal, what)
        assert k.metadata.shared <= 232448, k.metadata.shared  # sm_90's shared memory per block
        print("ok", d, tr, causal, flush=True)
"""


@pytest.mark.slow
def test_gluon_backward_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == 2 * len(H.GLUON_BWD)


def _big(d=128, dtype=torch.bfloat16, h=1, s=4096, device="cpu"):
    return torch.zeros(1, h, s, d, dtype=dtype, device=device)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(H, "wgmma_capable", lambda device: True)
    monkeypatch.delenv("NEMO_SSA_GLUON", raising=False)


def _cfg(q, k=None, do=None, o=None, transform="softmax", **kw):
    k = q if k is None else k
    args = dict(varlen=False, dropout=False)
    args.update(kw)
    return H.gluon_bwd_config(transform, q, k, k, q if do is None else do, q if o is None else o, **args)


def test_gluon_bwd_config_takes_softmax_d128_only(sm90, monkeypatch):
    q = _big()
    assert _cfg(q) == H.GLUON_BWD[(128, "softmax")]
    assert _cfg(_big(128, torch.float16)) is not None
    assert _cfg(q, transform="ssa") is None  # needs the forward's C and the dn partials
    assert _cfg(_big(64)) is None  # measured no faster than the Triton kernels
    assert _cfg(q, dropout=True) is None and _cfg(q, varlen=True) is None
    assert _cfg(_big(128, torch.float32)) is None
    assert _cfg(_big(128, s=1024)) is None  # below MIN_SCORES
    assert _cfg(q, do=q.transpose(2, 3).contiguous().transpose(2, 3)) is None  # dO's last dim strided
    assert _cfg(q, o=_big(128, torch.float16)) is not None  # (o's dtype is the forward's business)
    assert _cfg(q, do=_big(128, torch.float16)) is None
    monkeypatch.setenv("NEMO_SSA_GLUON", "0")
    assert _cfg(q) is None
    monkeypatch.delenv("NEMO_SSA_GLUON")
    monkeypatch.setattr(H, "wgmma_capable", lambda device: False)
    assert _cfg(q) is None


def test_single_pass_pays_for_softmax_d128_only_with_the_gluon_kernel():
    assert bwd_config.single_pass_pays("softmax", 128, gluon=True)
    assert not bwd_config.single_pass_pays("softmax", 128)
    assert not bwd_config.single_pass_pays("softmax", 64, gluon=True)
    assert not bwd_config.single_pass_pays("softmax", 96, gluon=True)
    assert not bwd_config.single_pass_pays("ssa", 128, gluon=True)


def test_deterministic_mode_keeps_the_two_kernels(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_BWD", raising=False)
    assert bwd_config.use_single_pass("softmax", 128, gluon=True)
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert not bwd_config.use_single_pass("softmax", 128, gluon=True)
    finally:
        torch.use_deterministic_algorithms(prev)
    monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
    assert not bwd_config.use_single_pass("softmax", 128, gluon=True)


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


def _reference(q, k, v, do, causal):
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    g_ref = torch.autograd.grad(attention_naive(*leaves, transform="softmax", causal=causal), leaves, do.float())
    eag = [t.detach().requires_grad_(True) for t in (q, k, v)]
    g_eag = torch.autograd.grad(attention_naive(*eag, transform="softmax", causal=causal, upcast=False), eag, do)
    return g_ref, g_eag


@pytest.mark.gpu
@pytest.mark.gpu_quick
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gluon_backward_matches_reference(case, monkeypatch):
    from nemo_ssa.ops.attention.flash import flash_attention_fwd

    B_, Hq, Hkv, Sq, Sk, causal, meg = case
    q, k, v, do = _inputs(B_, Hq, Hkv, Sq, Sk, meg, seed=Sq * 7 + Hq)
    o, M = flash_attention_fwd(q, k, v, transform="softmax", causal=causal)
    monkeypatch.setattr(H, "MIN_SCORES", 0)  # the small cases take the kernel too
    calls = []
    real = B.launch_gluon_bwd

    def spy(*a, **kw):
        calls.append(kw)
        for t in a[4:6]:  # dk, dv: poisoned, so an unwritten element fails
            t.fill_(float("nan"))
        return real(*a, **kw)

    monkeypatch.setattr(B, "launch_gluon_bwd", spy)
    dq, dk, dv, _, _ = B.attention_bwd(do, q, k, v, o, M, transform="softmax", causal=causal, deterministic=False)
    assert calls, "the call did not take the Gluon backward"
    g_ref, g_eag = _reference(q, k, v, do, causal)
    for name, g, e, r in zip(("dq", "dk", "dv"), (dq, dk, dv), g_eag, g_ref):
        assert not g.isnan().any(), name
        assert_within_2x_eager(g, e, r, name)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
def test_public_op_takes_the_gluon_backward_unless_deterministic(monkeypatch):
    from nemo_ssa.ops.attention.flash import softmax_attention_triton

    calls = []
    real = B.launch_gluon_bwd
    monkeypatch.setattr(B, "launch_gluon_bwd", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    q, k, v, do = _inputs(1, 4, 2, 2048, 2048, True, seed=3)  # 2^24 scores: the table path
    g_ref, g_eag = _reference(q, k, v, do, True)
    for det, want in ((None, 1), (True, 0)):
        calls.clear()
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = softmax_attention_triton(*leaves, causal=True, deterministic=det)
        grads = torch.autograd.grad(out, leaves, do)
        assert len(calls) == want, det
        for name, g, e, r in zip(("dq", "dk", "dv"), grads, g_eag, g_ref):
            assert_within_2x_eager(g, e, r, name)
