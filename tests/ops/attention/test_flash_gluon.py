"""The flash forward's Gluon Hopper kernel (``ops.attention.hopper``).

* CPU: the kernel compiles for sm_90 (wgmma, TMA copies, no local-memory spills) for every
  table row, causal and not -- Gluon has no interpreter, so this is what the CPU suite can
  check of it; ``gluon_fwd_config`` takes the kernel only where it applies and refuses
  every other call (dropout, packed sequences, the C statistic, other head dims, dtypes,
  log2 modes, layouts, short calls, other GPUs, ``NEMO_SSA_GLUON=0``, explicit Triton
  tiles); ``_flash_fwd`` routes an accepted call to it with its arguments.
* GPU (sm_90): ``o`` within 2x the eager bf16 error of the fp32 reference, NaN-poisoned
  outputs, ``M`` equal to the Triton kernel's (same empty rows), on odd lengths, GQA,
  causal and full, N = 1 and 17, Sq != Sk both ways, Megatron's ``[s, b, h, d]`` layout;
  gradients through the public op (Gluon forward, Triton backward) within 2x eager.
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

import nemo_ssa.ops.attention.flash as flash  # noqa: E402
import nemo_ssa.ops.attention.hopper as hopper  # noqa: E402
from nemo_ssa.ops.common import target  # noqa: E402
from nemo_ssa.ops.attention.naive import attention_naive  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.testing import assert_within_2x_eager  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ON_SM90 = CUDA and not is_interpreter() and torch.cuda.get_device_capability() == (9, 0)

COMPILE = r"""
import os, sys, re, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from nemo_ssa.ops.attention import hopper as H

def desc(rows, d):
    lay = gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], gl.bfloat16)
    return f"tensordesc<bf16[1,1,{rows},{d}],{lay!r}>"

fn = H._hopper_fwd_kernel
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for (d, tr), cfg in sorted(H.GLUON_FWD.items()):
    for causal in (True, False):
        sig = {}
        for a in fn.arg_names:
            if a in ("q_desc", "o_desc"):
                sig[a] = desc(cfg.block_m, d)
            elif a in ("k_desc", "v_desc"):
                sig[a] = desc(cfg.block_n, d)
            elif a in ("M", "CS", "NP", "BP"):
                sig[a] = "*fp32"
            elif a == "scale":
                sig[a] = "fp32"
            elif a in ("TRANSFORM", "CAUSAL", "STAGES", "SAVE_C", "num_warps"):
                sig[a] = "constexpr"
            else:
                sig[a] = "i32"
        # SSA with the row means C: the single-pass backward's forward (the heavier variant)
        consts = dict(TRANSFORM=int(tr == "ssa"), CAUSAL=causal, STAGES=cfg.stages, SAVE_C=tr == "ssa",
                      num_warps=cfg.num_warps)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("M", "CS", "NP", "BP")}
        k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps))
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, (d, tr)
        if tr == "ssa":
            assert "lg2.approx.ftz.f32" in ptx  # the backward's log2 (transforms.log2_fast mode 1)
        spills = -1
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                sass = subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True, text=True).stdout
            spills = sass.count("STL")
            assert spills == 0, (d, tr, causal, spills)
        print("ok", d, tr, causal, "spills", spills, flush=True)
"""


@pytest.mark.slow
def test_gluon_forward_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == 2 * len(hopper.GLUON_FWD)


def _big(d=128, dtype=torch.bfloat16, h=1, s=4096, device="cpu"):
    """``h * s * s >= MIN_SCORES`` (2^24 at s = 4096)."""
    return torch.zeros(1, h, s, d, dtype=dtype, device=device)


def _cfg(q, k=None, v=None, o=None, **kw):
    k = q if k is None else k
    args = dict(transform="softmax", varlen=False, dropout=False, save_c=False, fast_log2=1, explicit_config=False)
    args.update(kw)
    return hopper.gluon_fwd_config(q, k, q if v is None else v, q if o is None else o, **args)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_GLUON", raising=False)
    with target.stand_in(target.H100):
        yield


def test_gluon_config_takes_the_table_rows(sm90):
    for (d, tr), cfg in hopper.GLUON_FWD.items():
        q = _big(d)
        assert _cfg(q, transform=tr, save_c=tr == "ssa") == cfg
        assert (_cfg(q, transform=tr) == cfg) is not cfg.c_only
    assert _cfg(_big(128, torch.float16)) is not None
    assert _cfg(_big(128), transform="ssa") is not None
    assert _cfg(_big(128), transform="ssa", save_c=True) is not None  # it writes C too
    # GQA: k, v with fewer heads and a shorter Sk, as long as the call has enough scores
    q, k = _big(128, h=8, s=2048), _big(128, h=2, s=1024)
    assert _cfg(q, k, k, q) is not None


def test_gluon_config_refuses_what_it_does_not_cover(sm90, monkeypatch):
    q = _big(128)
    assert _cfg(q, dropout=True) is None
    assert _cfg(q, varlen=True) is None
    assert _cfg(q, explicit_config=True) is None  # an explicit Triton FwdConfig / autotuning
    assert _cfg(q, transform="ssa", fast_log2=0) is None  # the backward would recompute another log2
    assert _cfg(q, transform="ssa", fast_log2=3) is None
    assert _cfg(q, transform="softmax", fast_log2=0) is not None  # softmax has no log2
    assert _cfg(_big(64), transform="ssa") is None  # measured no faster without C: the Triton kernel stays
    assert _cfg(_big(64), transform="ssa", save_c=True) is not None  # with C it is faster
    assert _cfg(_big(64), transform="softmax") is None
    assert _cfg(_big(32)) is None and _cfg(_big(256)) is None and _cfg(_big(80)) is None
    assert _cfg(_big(128, torch.float32)) is None
    assert _cfg(_big(128, s=1024)) is None  # below MIN_SCORES: launch cost dominates
    assert _cfg(q, o=q.transpose(2, 3).contiguous().transpose(2, 3)) is None  # o's last dim not contiguous
    assert _cfg(q, k=_big(128, torch.float16)) is None  # mixed dtypes
    monkeypatch.setenv("NEMO_SSA_GLUON", "0")
    assert _cfg(q) is None
    monkeypatch.delenv("NEMO_SSA_GLUON")
    for other in (target.Target("cuda", (8, 0), 108), target.Target("cuda", (10, 0), 148), target.Target("rocm", (9, 4))):
        with target.stand_in(other):
            assert _cfg(q) is None, other
    with target.stand_in(target.Target("cpu")):
        assert _cfg(q) is None


def test_sm90_check_is_exact_capability(monkeypatch):
    from nemo_ssa.ops.common.tma import tma_capable, wgmma_capable

    assert not wgmma_capable(torch.device("cpu"))
    for cap, wgmma, tma in (((9, 0), True, True), ((10, 0), False, True), ((8, 9), False, False),
                            ((12, 0), False, True)):
        with target.stand_in(target.Target("cuda", cap, 100)):
            assert wgmma_capable(torch.device("cpu")) is wgmma and tma_capable(torch.device("cpu")) is tma, cap
    assert not target.Target("rocm", (9, 0)).wgmma and not target.Target("interpreter").wgmma
    assert target.Target("interpreter").tma and not target.Target("interpreter").fast_math


def test_flash_fwd_routes_an_accepted_call_to_the_gluon_kernel(monkeypatch):
    got = {}

    def fake_cfg(q, k, v, o, **kw):
        got["cfg_kw"] = kw
        return hopper.GLUON_FWD[(128, "ssa")]

    def fake_fwd(q, k, v, o, M, n_ptr, b_ptr, **kw):
        got["fwd"] = (o, M, n_ptr, b_ptr, kw)
        o.zero_()
        M.zero_()

    def no_triton(*a, **kw):
        raise AssertionError("the Triton kernel ran")

    monkeypatch.setattr(flash, "gluon_fwd_config", fake_cfg)
    monkeypatch.setattr(flash, "gluon_fwd", fake_fwd)
    monkeypatch.setattr(flash, "launch_kw", no_triton)
    dev = "cuda" if CUDA and not is_interpreter() else "cpu"
    q = torch.randn(1, 2, 5, 128, device=dev)
    n, b = torch.tensor([1.5], device=dev), torch.tensor([0.8], device=dev)
    o, M = flash.flash_attention_fwd(q, q, q, transform="ssa", n=n, b=b, causal=True, softmax_scale=0.25)
    o_, M_, n_ptr, b_ptr, kw = got["fwd"]
    assert o_ is o and M_ is M and n_ptr is n and b_ptr is b
    assert kw["transform_id"] == 1 and kw["causal"] is True and kw["scale"] == 0.25
    assert got["cfg_kw"]["transform"] == "ssa" and got["cfg_kw"]["dropout"] is False
    assert got["cfg_kw"]["explicit_config"] is False and got["cfg_kw"]["save_c"] is False


# -------------------------------------------------------------------------------------
# GPU (sm_90)
# -------------------------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, causal, transform, megatron_layout)
GPU_CASES = [
    (2, 4, 2, 1000, 1000, 128, True, "ssa", True),
    (1, 4, 1, 777, 777, 128, True, "softmax", False),
    (1, 2, 2, 300, 1000, 128, False, "ssa", False),
    (1, 2, 2, 1000, 300, 64, True, "softmax", True),
    (1, 3, 1, 300, 1000, 64, True, "softmax", False),
    (1, 2, 1, 1, 1, 128, True, "ssa", False),
    (1, 2, 1, 17, 17, 64, True, "softmax", True),
    (1, 2, 2, 2, 3, 128, False, "softmax", False),
    (1, 2, 2, 15, 15, 128, True, "ssa", True),
    (1, 4, 2, 1000, 1000, 64, True, "ssa", True),  # D64: the table row that writes C
    (1, 2, 1, 17, 33, 64, False, "ssa", False),
]


def _case_id(c):
    B, Hq, Hkv, Sq, Sk, D, causal, tr, meg = c
    return f"{tr}-B{B}-H{Hq}x{Hkv}-T{Sq}-TK{Sk}-D{D}-{'causal' if causal else 'full'}{'-sbhd' if meg else ''}"


def _inputs(B, Hq, Hkv, Sq, Sk, D, megatron, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(S, H):
        if megatron:  # [s, b, h, d] memory, used as [b, h, s, d]
            return torch.randn(S, B, H, D, device="cuda", generator=g).to(dtype).permute(1, 2, 0, 3)
        return torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype)
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


@pytest.mark.gpu
@pytest.mark.gpu_quick
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gluon_forward_matches_reference(case):
    _check_forward(case, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[2], GPU_CASES[6]], ids=_case_id)
def test_gluon_forward_matches_reference_fp16(case):
    _check_forward(case, torch.float16)


def _check_forward(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, causal, tr, meg = case
    q, k, v, _ = _inputs(B, Hq, Hkv, Sq, Sk, D, meg, seed=Sq * 31 + D, dtype=dtype)
    nb = dict(n=torch.tensor([1.5], device="cuda"), b=torch.tensor([0.8], device="cuda")) if tr == "ssa" else {}
    cfg = hopper.GLUON_FWD.get((D, tr), hopper.GLUON_FWD[(128, "softmax")])
    o = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails
    M = torch.full((B, Hq, Sq), float("nan"), device="cuda")
    C = torch.full_like(M, float("nan")) if tr == "ssa" else None
    scale = D ** -0.5
    hopper.gluon_fwd(q, k, v, o, M, nb.get("n", M), nb.get("b", M), transform_id=int(tr == "ssa"), causal=causal,
                     scale=scale, config=cfg, cstat=C)
    ref = attention_naive(q.float(), k.float(), v.float(), transform=tr, causal=causal,
                          **{key: t.float() for key, t in nb.items()})
    eag = attention_naive(q, k, v, transform=tr, causal=causal, upcast=False, **nb)
    assert not o.isnan().any()
    assert_within_2x_eager(o, eag, ref, "o")
    _, M_t, C_t = flash._flash_fwd(q, k, v, nb.get("n"), nb.get("b"), None, None, None, tr, causal, scale, 0.0,
                                   Sq, Sk, "ieee", True, flash.FwdConfig(64, 64, 4, 2), save_c=tr == "ssa")
    assert torch.equal(M.isinf(), M_t.isinf())  # the same rows without a visible key
    fin = M_t.isfinite()
    assert (M[fin] - M_t[fin]).abs().max().item() <= 1e-4 if fin.any() else True
    if tr == "ssa":  # the row means C = E_p[smag]: the Triton kernel's to fp32 rounding, 0 on empty rows
        assert not C.isnan().any()
        assert (C - C_t).abs().max().item() <= 1e-4 * max(1.0, C_t.abs().max().item())
        assert (C[~fin] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("tr,D", [("softmax", 128), ("ssa", 128)])
def test_public_op_takes_the_gluon_forward_and_its_gradients_hold(tr, D, monkeypatch):
    calls = []
    real = flash.gluon_fwd

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(flash, "gluon_fwd", spy)
    B, H, S = 1, 4, 2048  # 2^24 scores: the table path (MIN_SCORES)
    q, k, v, do = _inputs(B, H, H, S, S, D, True, seed=D)
    nb = dict(n=torch.tensor([1.5], device="cuda", requires_grad=True),
              b=torch.tensor([0.8], device="cuda")) if tr == "ssa" else {}
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    fn = flash.ssa_attention_triton if tr == "ssa" else flash.softmax_attention_triton
    out = fn(*leaves, nb["n"], nb["b"], causal=True) if tr == "ssa" else fn(*leaves, causal=True)
    assert calls, "the call did not take the Gluon forward"
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = attention_naive(*ref_leaves, transform=tr, causal=True, **{key: t.detach().float() for key, t in nb.items()})
    g_ref = torch.autograd.grad(ref, ref_leaves, do.float())
    eag_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    eag = attention_naive(*eag_leaves, transform=tr, causal=True, upcast=False,
                          **{key: t.detach() for key, t in nb.items()})
    g_eag = torch.autograd.grad(eag, eag_leaves, do)
    assert_within_2x_eager(out, eag, ref, "o")
    for name, g, e, r in zip(("dq", "dk", "dv"), grads, g_eag, g_ref):
        assert_within_2x_eager(g, e, r, name)
