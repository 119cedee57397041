"""ops/common/bwd.py: the two backward paths' shared argument builder fits the kernels.

The numerics of ``attention_bwd`` are tested against references in tests/ops/attention/test_flash.py
and tests/ops/attention/test_flash_single_pass.py; here, that each builder names exactly the kernel's
runtime parameters (bound by ``launch.bind_kw``), tensors first, in both paths.
"""

import inspect

import torch

from nemo_ssa.ops.common import bwd
from nemo_ssa.ops.common.bwd_kernels import attn_bwd_kernel_dkv, attn_bwd_kernel_dq
from nemo_ssa.ops.common.launch import bind_kw


def _runtime_params(kernel):
    """Names of the non-constexpr parameters (JITFunction and InterpretedFunction both wrap ``fn``)."""
    sig = inspect.signature(kernel.fn)
    return [p.name for p in sig.parameters.values() if "constexpr" not in str(p.annotation)]


def _call(varlen=False):
    M = torch.zeros(2, 4, 8)
    return bwd._BwdCall(varlen=varlen, is_ssa=True, bz=2, hq=4, hkv=2, sq=8, sk=8, d=16, block_d=16, scale=0.25,
                        dropout_p=0.0, rng=None, rng_strides=(0, 0, 0), n_ptr=M, b_ptr=M, cu_q=None, cu_k=None,
                        ms=M.stride(), meta={})


def test_dq_args_fill_the_dq_kernel():
    q = torch.zeros(2, 4, 8, 16)
    k = torch.zeros(2, 2, 8, 16)
    M = torch.zeros(2, 4, 8)
    args, meta = bind_kw(attn_bwd_kernel_dq, *bwd._dq_args(_call(), q, k, k, q, q, q, M, M, M, M), {}, absent=M)
    names = _runtime_params(attn_bwd_kernel_dq)
    assert len(args) == len(names)
    assert all(isinstance(a, torch.Tensor) for a in args[:15]) and names[14] == "DBP"
    assert not any(isinstance(a, torch.Tensor) for a in args[15:])
    assert meta == dict(VARLEN=False, HAS_DROPOUT=False, DPARAMS=True)
    i = names.index("s_dqz")
    assert args[i:i + 4] == q.stride() and args[names.index("RNG")] is M and args[names.index("CU_K")] is M
    _, meta = bind_kw(attn_bwd_kernel_dq, *bwd._dq_args(_call(), q, k, k, q, q, q, M, M, None, M), {}, absent=M)
    assert meta["DPARAMS"] is False


def test_dkv_args_fill_the_dkv_kernel_in_both_paths():
    q = torch.zeros(2, 4, 8, 16)
    k = torch.zeros(2, 2, 8, 16)
    M = torch.zeros(2, 4, 8)
    names = _runtime_params(attn_bwd_kernel_dkv)
    two, two_meta = bind_kw(attn_bwd_kernel_dkv, *bwd._dkv_args(_call(), q, k, k, q, k, k, M, M), {}, absent=M)
    dqa, dnk = torch.zeros(2, 4, 8, 16), torch.zeros(9)
    single, single_meta = bind_kw(attn_bwd_kernel_dkv, *bwd._dkv_args(
        _call(), q, k, k, q, k, k, M, M, dqa=dqa, cstat=M, dnk=dnk, dn_strides=(4, 2, 1)), {}, absent=M)
    for args in (two, single):
        assert len(args) == len(names)
        assert all(isinstance(a, torch.Tensor) for a in args[:16]) and names[15] == "DNK"
        assert not any(isinstance(a, torch.Tensor) for a in args[16:])
    i_dqa, i_az = names.index("DQA"), names.index("s_az")
    assert two[i_dqa] is M and two[i_az:i_az + 4] == (0, 0, 0, 0)
    assert single[i_dqa] is dqa and single[i_az:i_az + 4] == dqa.stride()
    i_ns = names.index("s_nz")
    assert two[i_ns:i_ns + 3] == (0, 0, 0) and single[i_ns:i_ns + 3] == (4, 2, 1)
    assert single[names.index("DNK")] is dnk and two[names.index("DNK")] is M
    assert two_meta == dict(VARLEN=False, HAS_DROPOUT=False, ATOMIC_DQ=False, DN_KV=False)
    assert single_meta == dict(VARLEN=False, HAS_DROPOUT=False, ATOMIC_DQ=True, DN_KV=True)


def test_one_backward_op_serves_flash_and_elsa(monkeypatch):
    """``nemo_ssa::attention_bwd`` is the registered backward of both forward schedules (the
    flash custom op's autograd and ELSA's), with a consistent schema and fake impl; it
    returns exactly ``attention_bwd``'s gradients (zeros standing in for no dn/db)."""
    import pytest

    from nemo_ssa.ops.common.launch import is_interpreter

    if not (is_interpreter() or torch.cuda.is_available()):
        pytest.skip("Triton kernels need the interpreter or CUDA")
    dev = "cpu" if is_interpreter() else "cuda"
    from nemo_ssa.ops.elsa import elsa_attention
    from nemo_ssa.ops.attention.flash import flash_attention_fwd

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 16, device=dev) for _ in range(3))
    n, b = torch.tensor([1.3], device=dev), torch.tensor([0.8], device=dev)
    o, M = flash_attention_fwd(q, k, v, transform="ssa", n=n, b=b, causal=True, softmax_scale=0.25)
    do = torch.randn_like(o)
    args = (do, q, k, v, o, M, n, b, None, None, None, "ssa", True, 0.25, 0.0, 17, 17, "ieee", False, True,
            True, None, True)
    torch.library.opcheck(torch.ops.nemo_ssa.attention_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    got = torch.ops.nemo_ssa.attention_bwd(*args)
    want = bwd.attention_bwd(do, q, k, v, o, M, transform="ssa", n=n, b=b, causal=True, scale=0.25,
                             input_precision="ieee", fast_math=False, deterministic=True)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    # both schedules' backward passes through the one op
    calls = []
    real = torch.ops.nemo_ssa.attention_bwd

    class Spy:
        def __call__(self, *a):
            calls.append(a[11])
            return real(*a)

    import nemo_ssa.ops.elsa.backward as eb

    monkeypatch.setattr(eb.torch.ops.nemo_ssa, "attention_bwd", Spy(), raising=False)
    qg = q.clone().requires_grad_()
    elsa_attention(qg, k, v, transform="softmax", causal=True).sum().backward()
    assert calls == ["softmax"]


def test_attention_bwd_checks_a_callers_shapes_and_the_flash_backward_takes_the_same_path(monkeypatch):
    """``attention_bwd`` refuses a caller's mismatched ``do``/``o``, ``M`` and ``k``/``v``
    before anything runs; the flash forward's own backward skips those checks (its tensors
    are the forward's) and reaches the same code with the same arguments."""
    import pytest

    q = torch.zeros(2, 4, 8, 16)
    k = torch.zeros(2, 2, 8, 16)
    M = torch.zeros(2, 4, 8)
    ran = []
    monkeypatch.setattr(bwd, "attention_bwd_trusted", lambda *a: ran.append(a) or "ran")
    kw = dict(transform="softmax", causal=True)
    for bad, match in [((q[:, :, :4], q, k, k, q, M), "must have q's shape"),
                       ((q, q, k, k, q[:, :2], M), "must have q's shape"),
                       ((q, q, k, k, q, M.double()), "M must be fp32"),
                       ((q, q, k, k, q, M[:, :2]), "M must be fp32"),
                       ((q, q, k, k[:, :1], q, M), "bad k/v shapes"),
                       ((q, q, k[..., :8], k[..., :8], q, M), "bad k/v shapes")]:
        with pytest.raises(ValueError, match=match):
            bwd.attention_bwd(*bad, **kw)
    assert ran == []
    assert bwd.attention_bwd(q, q, k, k, q, M, **kw) == "ran"
    (args,) = ran
    assert args[:7] == (q, q, k, k, q, M, "softmax") and args[9] is True and args[-1] is None
