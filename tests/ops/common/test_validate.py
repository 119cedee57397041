"""``ops.common.validate``: every attention op refuses the same bad input the same way.

One table of bad inputs runs against every op that runs on CPU (the reference, SDPA,
the fused flash kernel and ELSA in the Triton interpreter, FlexAttention's eager
forward, the NSA layer's torch path); each case must raise the same exception type from
every op it applies to, with a message naming what is supported. A second table checks
the capability limits (what one op implements and another does not), and a third that
edge inputs every op must accept (0-d ``n``, integer and float scales) are accepted by
all of them with the reference's result.
"""

import math
import os

import pytest
import torch

from nemo_ssa.ops.common.validate import ArgumentTypeError, UnsupportedError
from nemo_ssa.ops.elsa.scan import elsa_attention
from nemo_ssa.ops.nsa import NSAConfig, nsa_attention
from nemo_ssa.ops.softmax.sdpa import softmax_attention_sdpa
from nemo_ssa.ops.attention.flash import flash_attention, flash_attention_varlen
from nemo_ssa.ops.attention.flex import ssa_attention_flex
from nemo_ssa.ops.attention.naive import attention_naive

B, HQ, HKV, S, D = 1, 4, 2, 16, 16
# the Triton ops run on CPU only under the interpreter; on a GPU machine every op gets CUDA inputs
DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
NSA_CFG = NSAConfig(block_len=4, stride=2, select_block=8, top_n=4, window=8, compress="mean")
ALL_KW = ("transform", "causal", "softmax_scale", "dropout_p", "keep_mask")


def _nsa(q, k, v, n, b, **kw):
    gates = torch.zeros(B, HQ, S, 3, dtype=q.dtype if isinstance(q, torch.Tensor) else torch.float32, device=DEVICE)
    return nsa_attention(q, k, v, gates, NSA_CFG, n=n, b=b, impl="torch", **kw)


def _sdpa(q, k, v, n, b, *, transform, **kw):
    return softmax_attention_sdpa(q, k, v, n=n, b=b, **kw)


def _flex(q, k, v, n, b, **kw):
    return ssa_attention_flex(q, k, v, n, b, compile=False, **kw)


def _keywords(fn):
    return lambda q, k, v, n, b, **kw: fn(q, k, v, n=n, b=b, **kw)


# name -> (function(q, k, v, n, b, **kw), keywords it takes, transforms it runs)
OPS = {
    "reference": (_keywords(attention_naive), ALL_KW, ("ssa", "softmax")),
    "sdpa": (_sdpa, ALL_KW, ("softmax",)),
    "flash": (_keywords(flash_attention), ALL_KW, ("ssa", "softmax")),
    "elsa": (_keywords(elsa_attention), ALL_KW, ("ssa", "softmax")),
    "flex": (_flex, ("causal", "softmax_scale", "dropout_p", "keep_mask"), ("ssa",)),
    "nsa": (_nsa, ("transform", "softmax_scale"), ("ssa", "softmax")),
}


def _inputs(transform="ssa"):
    g = torch.Generator().manual_seed(0)  # every op of one test sees the same inputs
    q = torch.randn(B, HQ, S, D, generator=g)
    k, v = torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g)
    n, b = (torch.tensor([1.3]), torch.tensor([0.7])) if transform == "ssa" else (None, None)
    return _to_device(dict(q=q, k=k, v=v, n=n, b=b))


def _to_device(kw):
    """The tables' tensors are built on the CPU at collection: move them to the device under
    test (meta stays meta), so each case fails on the property it names, not on devices."""
    return {key: (t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t)
            for key, t in kw.items()}


def _call(op, case):
    """Run ``op`` on the base inputs with ``case``'s overrides; None when they do not apply."""
    fn, takes, transforms = OPS[op]
    case = _to_device(case)
    transform = case.pop("transform", "ssa")
    args = _inputs("softmax" if transform == "softmax" else "ssa")
    for name in ("q", "k", "v", "n", "b"):
        if name in case:
            args[name] = case.pop(name)
    if any(key not in takes for key in case):
        return None
    if "transform" in takes:
        case["transform"] = transform
    elif transform != "ssa":
        return None
    if transform not in transforms and len(transforms) == 1:  # an op of one transform
        return None

    def call():
        with torch.no_grad():
            return fn(args["q"], args["k"], args["v"], args["n"], args["b"], **case)

    return call


# (overrides, exception type, regex every op's message must match); ids name the rule
BAD = [
    # the fused op used to run softmax_scale=True as a scale of 1.0; the reference refused it
    pytest.param(dict(softmax_scale=True), ArgumentTypeError, r"softmax_scale must be None or a Python number > 0",
                 id="drift-scale-bool"),
    pytest.param(dict(softmax_scale=torch.tensor(0.5)), ArgumentTypeError, "softmax_scale must be None or a Python",
                 id="scale-tensor"),
    pytest.param(dict(softmax_scale="0.5"), ArgumentTypeError, "softmax_scale must be None or a Python", id="scale-str"),
    pytest.param(dict(softmax_scale=-1.0), ValueError, r"supported: a Python number, softmax_scale > 0",
                 id="scale-negative"),
    pytest.param(dict(softmax_scale=0.0), ValueError, r"softmax_scale > 0", id="scale-zero"),
    pytest.param(dict(softmax_scale=math.inf), ValueError, r"softmax_scale > 0", id="scale-inf"),
    pytest.param(dict(softmax_scale=math.nan), ValueError, r"softmax_scale > 0", id="scale-nan"),
    pytest.param(dict(q=None), ArgumentTypeError, r"`q` must be a torch.Tensor", id="q-none"),
    pytest.param(dict(q=torch.randn(HQ, S, D)), ValueError, r"`q` must be 4-D \[B, H, S, D\]", id="q-3d"),
    pytest.param(dict(k=torch.randn(B, 3, S, D), v=torch.randn(B, 3, S, D)), ValueError,
                 r"query heads \(4\) must be a multiple of kv heads \(3\)", id="gqa-ratio"),
    pytest.param(dict(v=torch.randn(B, HKV, S - 1, D)), ValueError, "k and v must have the same shape",
                 id="kv-shape"),
    pytest.param(dict(k=torch.randn(B, HKV, S, 32), v=torch.randn(B, HKV, S, 32)), ValueError,
                 "must share the head dim", id="head-dim-mismatch"),
    pytest.param(dict(k=torch.randn(2, HKV, S, D), v=torch.randn(2, HKV, S, D)), ValueError,
                 "must share the batch size", id="batch-mismatch"),
    pytest.param(dict(v=torch.randn(B, HKV, S, D, dtype=torch.float64)), ValueError, "q, k, v must share a dtype",
                 id="dtype-mix"),
    pytest.param(dict(q=torch.ones(B, HQ, S, D, dtype=torch.int32), k=torch.ones(B, HKV, S, D, dtype=torch.int32),
                      v=torch.ones(B, HKV, S, D, dtype=torch.int32)), ValueError, "supported dtypes: ", id="dtype-int"),
    # the reference used to return an empty result for B = 0 while the kernels refused it
    pytest.param(dict(q=torch.randn(0, HQ, S, D), k=torch.randn(0, HKV, S, D), v=torch.randn(0, HKV, S, D)),
                 ValueError, "every dim must be >= 1", id="empty-batch"),
    pytest.param(dict(transform="sigmoid"), ValueError, r"unknown transform 'sigmoid'; supported: one of",
                 id="transform-name"),
    pytest.param(dict(n=None), ValueError, r"transform='ssa' needs `n` \(a tensor of shape \[1\] or 0-d\)",
                 id="n-missing"),
    pytest.param(dict(b=0.7), ArgumentTypeError, r"`b` must be a torch.Tensor \(shape \[1\] or 0-d\)",
                 id="b-python-float"),
    pytest.param(dict(n=torch.ones(2)), ValueError, r"`n` must have shape \[1\] or be 0-d", id="n-shape"),
    pytest.param(dict(n=torch.ones(1, dtype=torch.int64)), ValueError, "`n` must be a floating tensor", id="n-int"),
    pytest.param(dict(n=torch.tensor(1.3, device="meta")), ValueError, r"supported: `n` on q's device",
                 id="n-other-device"),
    pytest.param(dict(transform="softmax", n=torch.ones(1)), ValueError, "supported only with transform='ssa'",
                 id="softmax-with-n"),
    pytest.param(dict(causal="no"), ArgumentTypeError, r"causal must be a bool \(True or False\)", id="causal-str"),
    pytest.param(dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)", id="dropout-one"),
    pytest.param(dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)", id="dropout-negative"),
    pytest.param(dict(dropout_p="0.1"), ArgumentTypeError, r"dropout_p must be a Python number in \[0, 1\)",
                 id="dropout-str"),
    pytest.param(dict(dropout_p=False), ArgumentTypeError, r"dropout_p must be a Python number in \[0, 1\)",
                 id="dropout-bool"),
]


@pytest.mark.parametrize("case,exc,match", BAD)
def test_bad_input_same_refusal_from_every_op(case, exc, match):
    ran = []
    for op in OPS:
        call = _call(op, case)
        if call is None:
            continue
        with pytest.raises(exc, match=match) as info:
            call()
        assert type(info.value) is exc, f"{op}: {type(info.value).__name__}, expected {exc.__name__}"
        ran.append(op)
    assert len(ran) >= 2, f"case reaches only {ran}"


# (overrides, ops that implement it, regex of the refusal by the others)
CAPABILITY = [
    pytest.param(dict(keep_mask=torch.ones(S, S, dtype=torch.bool).tril()), ("reference", "sdpa", "flex"),
                 r"does not support keep_mask \(supported masks: causal or none\)", id="keep-mask"),
    pytest.param(dict(dropout_p=0.25), ("reference", "sdpa", "flash"), r"has no dropout .*supported: dropout_p=0.0",
                 id="dropout"),
    pytest.param(dict(q=torch.randn(B, HQ, S, D, dtype=torch.float64), k=torch.randn(B, HKV, S, D, dtype=torch.float64),
                      v=torch.randn(B, HKV, S, D, dtype=torch.float64)), ("reference", "sdpa", "flex", "nsa"),
                 "supported dtypes: float16, bfloat16, float32", id="fp64"),
    pytest.param(dict(q=torch.randn(B, HQ, S, 8), k=torch.randn(B, HKV, S, 8), v=torch.randn(B, HKV, S, 8)),
                 ("reference", "sdpa", "flex", "nsa"), r"supported head dims: 16 <= D <= 256", id="head-dim-8"),
]


@pytest.mark.parametrize("case,supported,match", CAPABILITY)
@pytest.mark.parametrize("transform", ["ssa", "softmax"])
def test_capability_refused_with_unsupported_error(case, supported, match, transform):
    for op in OPS:
        call = _call(op, dict(case, transform=transform))
        if call is None:
            continue
        if op in supported:
            torch.manual_seed(0)
            assert call().shape[:3] == (B, HQ, S), op
        else:
            with pytest.raises(UnsupportedError, match=match):
                call()


def test_refusals_stay_value_errors():
    """Every refusal is also a ValueError: callers (the fuzzer, config checks) catch one type."""
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)
    assert issubclass(UnsupportedError, NotImplementedError) and issubclass(UnsupportedError, ValueError)


GOOD = [
    pytest.param(dict(n=torch.tensor(1.3), b=torch.tensor(0.7)), id="n-b-0d"),
    pytest.param(dict(softmax_scale=0.3), id="scale-float"),
    pytest.param(dict(softmax_scale=1), id="scale-int"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(dropout_p=0), id="dropout-int-0"),
]


@pytest.mark.parametrize("case", GOOD)
def test_edge_input_accepted_by_every_op(case):
    ref = _call("reference", case)()
    ran = []
    for op in OPS:
        call = _call(op, case)
        if call is None:
            continue
        o = call()
        assert o.shape == ref.shape and torch.isfinite(o).all(), op
        if op != "nsa":  # NSA is another attention; it only has to accept the input
            torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-5, msg=lambda m: f"{op}: {m}")
        ran.append(op)
    assert len(ran) >= 4, ran


def test_drift_bool_softmax_scale_refused_by_flash():
    """The fused op used to run ``softmax_scale=True`` (a bool is an int) as a scale of 1."""
    args = _inputs()
    with pytest.raises(ValueError, match="not a bool"):
        flash_attention(args["q"], args["k"], args["v"], n=args["n"], b=args["b"], softmax_scale=True)


def test_drift_zero_dim_n_on_another_device_refused_by_reference():
    """The reference used to accept a 0-d CPU ``n`` beside q on another device (the
    kernels refused it). ``meta`` stands in for CUDA on a CPU-only machine."""
    q = torch.randn(B, HQ, S, D, device="meta")
    k = v = torch.randn(B, HKV, S, D, device="meta")
    with pytest.raises(ValueError, match=r"`n` is on cpu, q on meta; supported: `n` on q's device"):
        attention_naive(q, k, v, transform="ssa", n=torch.tensor(1.3), b=torch.tensor(0.7, device="meta"))
    o = attention_naive(q, k, v, transform="ssa", n=torch.tensor(1.3, device="meta"),
                        b=torch.tensor(0.7, device="meta"))
    assert o.device.type == "meta" and o.shape == q.shape


@pytest.mark.parametrize("case,exc,match", [
    pytest.param(dict(cu_seqlens_q=torch.tensor([0.0, 16.0])), ValueError, "1-D int32/int64 tensor", id="cu-float"),
    pytest.param(dict(cu_seqlens_q=[0, 16]), ArgumentTypeError, "1-D int32/int64 tensor", id="cu-list"),
    pytest.param(dict(cu_seqlens_k=torch.tensor([0, 8, 16], dtype=torch.int32)), ValueError, "num_seqs \\+ 1",
                 id="cu-len-mismatch"),
    pytest.param(dict(max_seqlen_q=0), ValueError, "must be positive ints", id="max-seqlen-0"),
    pytest.param(dict(q=torch.randn(1, S, HQ, D)), ValueError, r"`q` must be 3-D \[T, H, D\] \(packed\)",
                 id="q-4d"),
    pytest.param(dict(softmax_scale=True), ArgumentTypeError, "softmax_scale must be None or a Python",
                 id="drift-scale-bool"),
])
def test_varlen_refusals(case, exc, match):
    cu = torch.tensor([0, S], dtype=torch.int32)
    kw = dict(q=torch.randn(S, HQ, D), k=torch.randn(S, HKV, D), v=torch.randn(S, HKV, D), cu_seqlens_q=cu,
              cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S, transform="softmax")
    kw.update(case)
    with pytest.raises(exc, match=match) as info:
        flash_attention_varlen(**_to_device(kw))
    assert type(info.value) is exc
