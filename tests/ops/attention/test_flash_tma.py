"""The Hopper path of the fused attention (``ops.common.tma``): tiles through tensor
descriptors (TMA) in the forward, dQ and dK/dV kernels.

* Same tiles, pointers vs descriptors: under the interpreter (CPU, fp32) the same outputs,
  row statistic and every gradient to fp32 rounding; on a GPU (sm_90+) both within 2x the eager bf16
  error of the fp32 reference. Odd lengths (rows past ``S`` read as 0, stores dropped),
  padded head dims (columns past ``D``), GQA, causal and full, N = 1, Sq != Sk, the
  Megatron ``[s, b, h, d]`` layout; outputs NaN-poisoned is implicit (fresh ``empty``
  outputs: an unwritten element would differ between the runs).
* ``use_tma`` refuses what the hardware cannot address (packed THD, a stride that is not a
  multiple of 16 bytes, a non-contiguous last dim, a misaligned pointer): those calls run
  the pointer kernels and still give the right answer.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nemo_ssa.ops.attention.flash import FwdConfig, flash_attention_fwd  # noqa: E402
from nemo_ssa.ops.attention.naive import attention_naive  # noqa: E402
from nemo_ssa.ops.common.bwd import attention_bwd  # noqa: E402
from nemo_ssa.ops.common.bwd_config import BwdConfig  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402
from nemo_ssa.ops.common.tma import tma_capable, tma_ready, use_tma  # noqa: E402
from nemo_ssa.testing import assert_within_2x_eager  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
ON_GPU = CUDA and not is_interpreter()
pytestmark = pytest.mark.skipif(CUDA and is_interpreter(), reason="TRITON_INTERPRET=1 with CUDA: run this file alone")

# (B, Hq, Hkv, Sq, Sk, D, causal, transform, megatron_layout)
CPU_CASES = [
    (2, 4, 2, 37, 37, 40, True, "ssa", True),
    (1, 3, 1, 19, 33, 32, False, "softmax", False),
    (1, 2, 2, 1, 1, 16, True, "ssa", True),
]
GPU_CASES = [
    (2, 8, 2, 1000, 1000, 64, True, "ssa", True),
    (1, 8, 8, 1000, 1000, 128, True, "softmax", False),
    (1, 4, 2, 300, 517, 80, True, "ssa", False),
    (2, 4, 4, 257, 257, 128, False, "ssa", True),
    (1, 4, 2, 1, 1, 64, True, "softmax", True),
]


def _configs():
    if not ON_GPU:
        return FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 1, 1, 16, 16, 1, 1)
    return FwdConfig(64, 64, 4, 3), BwdConfig(64, 64, 4, 2, 32, 64, 4, 2)


def _inputs(B, Hq, Hkv, Sq, Sk, D, megatron, dtype):
    def mk(S, H):
        if megatron:  # [s, b, h, d] memory, used as [b, h, s, d]
            return torch.randn(S, B, H, D, device=DEV).to(dtype).permute(1, 2, 0, 3)
        return torch.randn(B, H, S, D, device=DEV).to(dtype)
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


def _run(q, k, v, do, transform, causal, nb, fwd_cfg, bwd_cfg):
    o, M = flash_attention_fwd(q, k, v, transform=transform, causal=causal, config=fwd_cfg, **nb)
    dq, dk, dv, dn, db = attention_bwd(do, q, k, v, o, M, transform=transform, causal=causal, config=bwd_cfg,
                                       need_db=True, deterministic=True, **nb)
    return dict(o=o, M=M, dq=dq, dk=dk, dv=dv, dn=dn, db=db)


def _case_id(c):
    B, Hq, Hkv, Sq, Sk, D, causal, tr, meg = c
    return f"{tr}-B{B}-H{Hq}x{Hkv}-T{Sq}-TK{Sk}-D{D}-{'causal' if causal else 'full'}{'-sbhd' if meg else ''}"


@pytest.mark.parametrize("case", GPU_CASES if ON_GPU else CPU_CASES, ids=_case_id)
def test_tma_path_matches_pointer_path(case):
    if not ON_GPU and not is_interpreter():
        pytest.skip("Triton kernels were built for GPU and there is no CUDA")
    if ON_GPU and not tma_capable(torch.device(DEV)):
        pytest.skip("the GPU is older than sm_90 (no TMA)")
    B, Hq, Hkv, Sq, Sk, D, causal, tr, meg = case
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Sk, D, meg, dtype)
    nb = dict(n=torch.tensor([1.3], device=DEV), b=torch.tensor([0.7], device=DEV)) if tr == "ssa" else {}
    assert use_tma(1, False, q, k, v, do) == 1  # the case really takes the descriptor path
    fc, bc = _configs()
    ptr = _run(q, k, v, do, tr, causal, nb, fc, bc)
    tma = _run(q, k, v, do, tr, causal, nb, fc._replace(tma=1), bc._replace(tma_dq=1, tma_kv=1))
    names = ["o", "M", "dq", "dk", "dv"] + (["dn", "db"] if tr == "ssa" else [])
    if not ON_GPU:  # same tiles, same arithmetic; numpy may sum a transposed operand in another order
        for name in names:
            diff = (ptr[name].double() - tma[name].double()).abs().max().item()
            assert diff <= 1e-5 * max(1.0, ptr[name].abs().max().item()), (name, diff)
        return
    # GPU: both paths within 2x the eager bf16 error of the fp32 reference
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    nb32 = {key: t.float() for key, t in nb.items()}
    ref = attention_naive(*leaves, transform=tr, causal=causal, **nb32)
    g_ref = torch.autograd.grad(ref, leaves, do.float())
    eag_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    eag = attention_naive(*eag_leaves, transform=tr, causal=causal, upcast=False, **nb)
    g_eag = torch.autograd.grad(eag, eag_leaves, do)
    for path in (ptr, tma):
        assert_within_2x_eager(path["o"], eag, ref, "o")
        for name, e, r in zip(("dq", "dk", "dv"), g_eag, g_ref):
            assert_within_2x_eager(path[name], e, r, name)
    assert torch.equal(ptr["M"].isinf(), tma["M"].isinf())


def test_use_tma_refuses_layouts_the_hardware_cannot_address():
    dev = torch.device(DEV)
    if not tma_capable(dev):
        pytest.skip("no TMA on this device")
    q = torch.randn(2, 4, 37, 64, device=DEV).to(torch.bfloat16)
    assert use_tma(1, False, q) == 1
    assert use_tma(0, False, q) == 0  # the config says pointers
    assert use_tma(1, True, q) == 0  # packed THD
    odd = torch.randn(2, 4, 37, 36, device=DEV).to(torch.bfloat16)  # row stride 72 bytes
    assert not tma_ready(odd) and use_tma(1, False, q, odd) == 0
    assert not tma_ready(q.transpose(2, 3))  # last dim not contiguous
    flat = torch.randn(2 * 4 * 37 * 64 + 1, device=DEV).to(torch.bfloat16)
    assert not tma_ready(flat[1:].view(2, 4, 37, 64))  # pointer off by 2 bytes
    assert not tma_ready(q[0])  # not 4-D


@pytest.mark.skipif(ON_GPU, reason="CPU interpreter check (the GPU cases above cover the kernels)")
def test_ineligible_layout_with_a_tma_config_falls_back_and_stays_exact():
    if not is_interpreter():
        pytest.skip("needs the Triton interpreter")
    # head dim 24 in fp32 with a row stride of 28 elements (112 bytes: fine) but a
    # misaligned pointer: the TMA config must fall back to the pointer kernels
    base = torch.randn(2 * 3 * 9 * 28 + 1)
    q = base[1:].view(2, 3, 9, 28)[..., :24]
    k = torch.randn(2, 1, 9, 24)
    v = torch.randn(2, 1, 9, 24)
    do = torch.randn(2, 3, 9, 24)
    assert not tma_ready(q)
    fc, bc = _configs()
    ptr = _run(q, k, v, do, "softmax", True, {}, fc, bc)
    tma = _run(q, k, v, do, "softmax", True, {}, fc._replace(tma=1), bc._replace(tma_dq=1, tma_kv=1))
    for name in ("o", "M", "dq", "dk", "dv"):
        assert torch.equal(ptr[name], tma[name]), name  # the same (pointer) kernels ran twice
    ref = attention_naive(q.double(), k.double(), v.double(), transform="softmax", causal=True)
    assert (tma["o"].double() - ref).abs().max().item() < 1e-5


SINGLE_CASES = ([(2, 4, 2, 37, 37, 40, True, "ssa", True), (1, 3, 3, 19, 33, 32, False, "softmax", False)]
                if not ON_GPU else
                [(2, 8, 2, 1000, 1000, 64, True, "ssa", True), (1, 8, 8, 777, 777, 128, True, "softmax", False),
                 (1, 4, 2, 300, 517, 80, False, "ssa", False)])


@pytest.mark.parametrize("case", SINGLE_CASES, ids=_case_id)
def test_single_pass_tma_reduce_matches_pointer_atomics(case):
    """The single-pass backward adds dq with fp32 atomics: per element (pointers) or one bulk
    tensor reduce per tile (TMA). Same sums in another order: equal to fp32 rounding."""
    if not ON_GPU and not is_interpreter():
        pytest.skip("Triton kernels were built for GPU and there is no CUDA")
    if ON_GPU and not tma_capable(torch.device(DEV)):
        pytest.skip("the GPU is older than sm_90 (no TMA)")
    from nemo_ssa.ops.attention.flash import _flash_fwd

    B, Hq, Hkv, Sq, Sk, D, causal, tr, meg = case
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Sk, D, meg, dtype)
    n, b = (torch.tensor([1.3], device=DEV), torch.tensor([0.7], device=DEV)) if tr == "ssa" else (None, None)
    fc, bc = _configs()
    prec = "tf32" if ON_GPU else "ieee"
    o, M, C = _flash_fwd(q, k, v, n, b, None, None, None, tr, causal, D ** -0.5, 0.0, Sq, Sk, prec, ON_GPU,
                         config=fc, save_c=tr == "ssa")
    nb = dict(n=n, b=b) if tr == "ssa" else {}
    out = {}
    for tma in (0, 1):
        cfg = BwdConfig(0, 0, 0, 0, *bc[4:8], tma_kv=tma)
        out[tma] = attention_bwd(do, q, k, v, o, M, transform=tr, causal=causal, config=cfg, need_db=False,
                                 cstat=C, deterministic=False, input_precision=prec, fast_math=ON_GPU, **nb)
    for name, x, y in zip(("dq", "dk", "dv", "dn"), out[0], out[1]):
        if x is None:
            continue
        tol = (2e-2 if ON_GPU else 1e-5) * max(1.0, x.float().abs().max().item())
        diff = (x.double() - y.double()).abs().max().item()
        assert diff <= tol, (name, diff, tol)
        assert torch.isfinite(y).all(), name


def test_table_rows_that_ask_for_tma_fall_back_to_the_pointer_rows():
    """Where a call cannot take the TMA path (pre-Hopper GPU, packed, unaligned, short), a
    table row asking for it is replaced by the pointer kernels' own measured row -- the
    TMA row's tiles can spill without descriptors (D128 dK/dV 64x64: 16 spills)."""
    from nemo_ssa.ops.attention.flash import FWD_CONFIGS, pointer_fwd_config
    from nemo_ssa.ops.common import bwd_config as bc

    for d in (64, 128):
        f = FWD_CONFIGS[(d, True, "16bit")]
        assert f.tma == 1
        p = pointer_fwd_config(f, d)
        assert p.tma == 0 and p == bc_row(d, "fwd")
        b = bc.BWD_CONFIGS[(d, True, "16bit")]
        assert b.tma_dq == 1 and b.tma_kv == 1
        both = bc.pointer_bwd_config(bc.pointer_bwd_config(b, d, dq=True), d, dq=False)
        assert both == bc_row(d, "bwd")
    f32 = FWD_CONFIGS[(32, True, "16bit")]
    assert pointer_fwd_config(f32, 32) is f32  # no TMA asked: unchanged


def bc_row(d, which):
    """The pointer rows as measured before the Hopper path (docs/results/2026-11-22-tuning)."""
    from nemo_ssa.ops.attention.flash import FwdConfig
    from nemo_ssa.ops.common.bwd_config import BwdConfig

    return {("fwd", 64): FwdConfig(64, 128, 4, 3), ("fwd", 128): FwdConfig(64, 64, 4, 3),
            ("bwd", 64): BwdConfig(64, 128, 4, 2, 64, 64, 4, 2),
            ("bwd", 128): BwdConfig(64, 64, 4, 2, 32, 64, 4, 2)}[(which, d)]


def test_short_and_packed_calls_keep_the_pointer_kernels():
    from nemo_ssa.ops.common.tma import MIN_SCORES

    q = torch.randn(1, 2, 8, 64, device=DEV).to(torch.bfloat16)
    if not tma_capable(q.device):
        pytest.skip("no TMA on this device")
    assert use_tma(1, False, q) == 1  # an explicit config: honoured whatever the size
    assert use_tma(1, False, q, scores=MIN_SCORES - 1) == 0  # a table config on a short call
    assert use_tma(1, False, q, scores=MIN_SCORES) == 1
    assert use_tma(1, True, q, scores=MIN_SCORES) == 0


def test_nemo_ssa_tma_0_turns_the_path_off(monkeypatch):
    q = torch.randn(1, 2, 8, 64, device=DEV).to(torch.bfloat16)
    if not tma_capable(q.device):
        pytest.skip("no TMA on this device")
    assert use_tma(1, False, q) == 1
    monkeypatch.setenv("NEMO_SSA_TMA", "0")
    assert use_tma(1, False, q) == 0


@pytest.mark.skipif(not ON_GPU, reason="the tables' TMA rows apply on a GPU")
@pytest.mark.parametrize("D,tr", [(64, "ssa"), (64, "softmax"), (128, "ssa"), (128, "softmax")])
def test_default_tables_take_the_tma_path_within_2x_eager(D, tr):
    """flash_attention with the default tables at a size above ``MIN_SCORES``: the TMA rows
    run (SSA D64: the single pass with the dq tile reduce), fwd and grads within 2x eager."""
    from nemo_ssa.ops.attention.flash import flash_attention, fwd_config
    from nemo_ssa.ops.common.tma import MIN_SCORES

    if not tma_capable(torch.device(DEV)):
        pytest.skip("the GPU is older than sm_90 (no TMA)")
    B, H, N = 1, 4, 2048
    assert B * H * N * N >= MIN_SCORES and fwd_config(D, True, torch.bfloat16).tma == 1
    q, k, v, do = _inputs(B, H, H, N, N, D, True, torch.bfloat16)
    assert use_tma(1, False, q, k, v, do, scores=B * H * N * N) == 1
    nb = dict(n=torch.tensor([1.3], device=DEV, requires_grad=True),
              b=torch.tensor([0.7], device=DEV)) if tr == "ssa" else {}
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    o = flash_attention(*leaves, transform=tr, causal=True, **nb)
    g = torch.autograd.grad(o, leaves, do)
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = attention_naive(*ref_leaves, transform=tr, causal=True, **{k_: t.detach().float() for k_, t in nb.items()})
    g_ref = torch.autograd.grad(ref, ref_leaves, do.float())
    eag_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    eag = attention_naive(*eag_leaves, transform=tr, causal=True, upcast=False,
                          **{k_: t.detach() for k_, t in nb.items()})
    g_eag = torch.autograd.grad(eag, eag_leaves, do)
    assert_within_2x_eager(o, eag, ref, "o")
    for name, x, e, r in zip(("dq", "dk", "dv"), g, g_eag, g_ref):
        assert_within_2x_eager(x, e, r, name)
