"""Tiny sequence lengths (N = 1, 2, 3, 15, 17) through every public attention op: forward
and backward run and match the reference (``nemo_ssa.testing.tiny_shapes``: finite, and
within 2x the eager same-dtype error of the fp32 / fp64 reference).

A one-token document or prompt is ordinary, and Triton compiles a separate kernel for an
int equal to 1: on an H100 the softmax backward at N=1 (bf16, causal, D32) once made ptxas
segfault. GPU: bf16, D32 for every op, D64/D128 for the flash kernel, and the crash's
shape (``gpu_quick``). CPU: the Triton interpreter in fp32 on a subset (the interpreter
never specialises, so it checks the masks and arithmetic at these lengths, not the compiler).
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.testing.tiny_shapes import run_case  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
LENGTHS = (1, 2, 3, 15, 17) if CUDA else (1, 2, 17)


def _params():
    out = []
    dt = "bf16" if CUDA else "fp32"
    ops = ("flash", "varlen", "elsa", "nsa", "flex") if CUDA else ("flash", "varlen", "elsa", "nsa")
    for op in ops:
        for N in (LENGTHS if op != "varlen" else (0, 1, 2)):  # varlen N=0: the lengths 1,2,3,15,17 packed
            for tr in (("ssa",) if op == "flex" else ("ssa", "softmax")):
                for causal in ((True,) if op == "nsa" else (True, False)):
                    hq, hkv = 8, 4
                    marks = ()
                    if CUDA and op == "flash" and N == 1 and tr == "softmax" and causal:
                        marks = (pytest.mark.gpu_quick,)  # the shape ptxas crashed on
                    out.append(pytest.param(op, dt, 32, N, tr, causal, hq, hkv, marks=marks,
                                            id=f"{op}-{dt}-D32-N{N}-{tr}-{'causal' if causal else 'full'}-{hq}x{hkv}"))
    if CUDA:
        for D in (64, 128):
            for N in LENGTHS:
                for tr in ("ssa", "softmax"):
                    out.append(pytest.param("flash", dt, D, N, tr, True, 8, 4,
                                            id=f"flash-{dt}-D{D}-N{N}-{tr}-causal-8x4"))
        for N in LENGTHS:  # GQA 16: the selected branch's query-major forward and dq
            for tr in ("ssa", "softmax"):
                out.append(pytest.param("nsa", dt, 32, N, tr, True, 16, 1,
                                        id=f"nsa-{dt}-D32-N{N}-{tr}-causal-16x1"))
        for tr in ("ssa", "softmax"):  # MHA (GROUP == 1 is its own specialisation)
            out.append(pytest.param("flash", dt, 32, 1, tr, True, 4, 4, marks=(pytest.mark.gpu_quick,),
                                    id=f"flash-{dt}-D32-N1-{tr}-causal-4x4"))
    return out


@pytest.mark.parametrize("op,dt,D,N,tr,causal,hq,hkv", _params())
def test_tiny_lengths_run_and_match_reference(op, dt, D, N, tr, causal, hq, hkv):
    if not CUDA and not is_interpreter():
        pytest.skip("Triton kernels were built for GPU and there is no CUDA")
    status, why = run_case(op, dt, D, N, tr, causal, hq, hkv, DEV)
    assert status == "ok", f"{op} {dt} D{D} N{N} {tr} causal={causal} {hq}/{hkv}: {why}"


def test_the_check_fails_wrong_unwritten_and_misshaped_results():
    from nemo_ssa.testing.tiny_shapes import _check

    ref = torch.randn(2, 3, 5, dtype=torch.float64)
    eager = ref + 1e-3 * torch.randn_like(ref)
    assert _check([eager.clone()], [eager], [ref], ["o"]) == ""
    assert "rel err" in _check([ref + 1e-1 * torch.randn_like(ref)], [eager], [ref], ["o"])
    poisoned = eager.clone()
    poisoned[1, 2, 4] = float("nan")  # one element a kernel never wrote
    assert "non-finite" in _check([poisoned], [eager], [ref], ["o"])
    assert "shape" in _check([eager[:, :, :4]], [eager], [ref], ["o"])
