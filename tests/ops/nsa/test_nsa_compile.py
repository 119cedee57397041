"""Every NSA kernel compiles for sm_90 (H100/H200) -- on a CPU-only machine.

The interpreter (tests/ops/nsa/test_nsa.py) checks the math but accepts code the compiler
rejects (tile shapes below 16, scalar/tensor type mixes in branches, early returns);
this ahead-of-time compile through Triton's bundled ptxas catches those before the
GPU run. Runs in a subprocess because TRITON_INTERPRET is fixed when a kernel is
decorated. Marked slow (~1 min on 2 cores).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from nemo_ssa.ops.nsa import range_attn as R, select as S, selected_attn as A, gate as GT

FLOATS = {"scale"}
def compile(fn, ptrs, consts, num_warps=4, num_stages=2):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in FLOATS else "i32") for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    print("ok", fn.__name__, consts, flush=True)
    return k.asm["ptx"].count("cp.async.bulk.tensor")  # TMA copies in the PTX

for dt, D, T in (("fp32", 32, 0), ("bf16", 128, 1)):
    prec = "ieee" if dt == "fp32" else "tf32"
    bm, bn = (64, 64) if D <= 64 else (64, 32)
    F = 1 if T == 1 else 0  # SSA: PTX lg2.approx, the CUDA default (_common.fast_log2)
    P = {n: "*" + dt for n in ["Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "KC"]}
    P.update({n: "*fp32" for n in ["LSE", "NP", "BP", "DELTA", "DNB", "IMP", "LSE_PART", "OACC",
                                   "DQACC", "DKACC", "DVACC"]})
    P.update({n: "*i32" for n in ["ITEMS", "TQ", "TS", "IDX"]})
    for W in (True, False):
        c = dict(TRANSFORM=T, HAS_WINDOW=W, PREC=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D, TMA=0, FAST_LOG2=F)
        for k in (R._range_fwd_kernel, R._range_bwd_kernel_dq, R._range_bwd_kernel_dkv):
            compile(k, P, c)
        if dt == "bf16":  # SPLIT > 1: dK/dV go to fp32 partials
            compile(R._range_bwd_kernel_dkv, {**P, "DK": "*fp32", "DV": "*fp32"}, c)
            # the Hopper path: K/V (forward, dQ) and Q/dO (dK/dV) through tensor descriptors
            kd, qd = f"tensordesc<{dt}[1,1,{bn},{D}]>", f"tensordesc<{dt}[1,1,{bm},{D}]>"
            ct = dict(c, TMA=1)
            for k in (R._range_fwd_kernel, R._range_bwd_kernel_dq):
                tma_ops = compile(k, {**P, "K": kd, "V": kd}, ct)
                assert tma_ops >= 2, (k.__name__, tma_ops)
            tma_ops = compile(R._range_bwd_kernel_dkv, {**P, "Q": qd, "DO": qd, "DK": "*fp32", "DV": "*fp32"}, ct)
            assert tma_ops >= 2, tma_ops
    compile(S._importance_kernel, P, dict(TRANSFORM=T, PREC=prec, BLOCK_M=64, BLOCK_C=32, BLOCK_S=16, BLOCK_D=D,
                                          HEADS_INNER=False, W_PREC=prec, FAST_LOG2=F, STEP=0))
    # the default order: heads summed per chunk, the overlap product split hi/lo (16-bit) or IEEE
    compile(S._importance_kernel, P, dict(TRANSFORM=T, PREC=prec, BLOCK_M=64, BLOCK_C=64, BLOCK_S=128, BLOCK_D=D,
                                          HEADS_INNER=True, W_PREC="split" if dt == "bf16" else "ieee",
                                          FAST_LOG2=F, STEP=0))
    # the banded order (IMPORTANCE_BANDED): two 16-wide window products per chunk
    compile(S._importance_kernel, P, dict(TRANSFORM=T, PREC=prec, BLOCK_M=64, BLOCK_C=64, BLOCK_S=128, BLOCK_D=D,
                                          HEADS_INNER=True, W_PREC="split" if dt == "bf16" else "ieee",
                                          FAST_LOG2=F, STEP=16))
    compile(A._sel_fwd_qmajor_kernel, P, dict(TRANSFORM=T, PREC=prec, BLOCK_G=16, BLOCK_S=64, BLOCK_D=D, FAST_LOG2=F,
                                             TMA=0), num_warps=1)
    kd = f"tensordesc<{dt}[1,1,64,{D}]>"  # the Hopper default: K/V blocks through descriptors, pipelined
    tma_ops = compile(A._sel_fwd_qmajor_kernel, {**P, "K": kd, "V": kd},
                      dict(TRANSFORM=T, PREC=prec, BLOCK_G=16, BLOCK_S=64, BLOCK_D=D, FAST_LOG2=F, TMA=1), num_warps=1)
    assert tma_ops >= 2, tma_ops
    bq = 64 if D <= 64 else 32
    for PASS in (0, 1):
        compile(A._sel_fwd_kernel, P, dict(PASS=PASS, TRANSFORM=T, PREC=prec, BLOCK_Q=bq, BLOCK_S=64, BLOCK_D=D,
                                           FAST_LOG2=F))
    compile(A._sel_bwd_kernel, P, dict(TRANSFORM=T, PREC=prec, BLOCK_Q=bq, BLOCK_S=64, BLOCK_D=D, FAST_LOG2=F))
compile(S._topn_kernel, {"IMP": "*fp32", "IDX": "*i32"}, dict(TOPN=16, BLOCK_M=8, BLOCK_S=1024))
for dt in ("bf16", "fp32"):
    P = {n: "*" + dt for n in ["OC", "OS", "OW", "G", "O", "DO", "DOC", "DOS", "DOW", "DG"]}
    compile(GT._gate_fwd_kernel, P, dict(BLOCK_R=128, BLOCK_D=32))
    compile(GT._gate_bwd_kernel, P, dict(BLOCK_R=32, BLOCK_D=128))
print("ALL OK")
"""


@pytest.mark.slow
def test_nsa_kernels_compile_for_sm90(tmp_path):
    try:
        import triton.backends.nvidia  # noqa: F401
    except Exception:  # pragma: no cover
        pytest.skip("triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "ALL OK" in r.stdout, (r.stdout[-3000:] + r.stderr[-3000:])
