"""Every attention's module path gives one answer: bit-identical across global seeds,
thread counts and NaN-poisoned memory, and equal to its reference module.

Issue 47: ``SSAFlexCoreAttention`` on CPU returned NaN or errors of ~1.6 on AVX2 machines
because compiled CPU FlexAttention read past K into whatever memory followed it; the op
test passed (other memory layout) and so did the suite on AVX-512 machines. Here every
module runs with its inputs inside NaN-filled storages and after the allocator's free
blocks were filled with NaN (``nemo_ssa.testing.poison``), so a read of memory the
module did not write shows up as a NaN or a bit difference on any machine. The flex case
is also run under an 8-lane vector ISA in a subprocess (``ATEN_CPU_CAPABILITY=avx2``),
where the upstream overrun lives, with a canary that says when torch has fixed it.
"""

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.core.transformer.enums import AttnMaskType

from nemo_ssa.config.attentions import ATTENTIONS
from nemo_ssa.megatron import core_attention as ca
from nemo_ssa.testing.poison import assert_bit_identical, nan_surrounded, poisoned_runs
from test_core_attention import B, HN, NG, NP, build

CORE = sorted(n for n, a in ATTENTIONS.items() if a.module_path[0] == ca.__name__)
NSA = sorted(n for n, a in ATTENTIONS.items() if a.family == "nsa")


def _reference_cls(name):
    return ca.SSAReferenceCoreAttention if ATTENTIONS[name].transform == "ssa" else ca.SoftmaxCoreAttention


def _qkv(sq, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, B, NP, HN, generator=g)
    k = torch.randn(sq, B, NG, HN, generator=g)
    v = torch.randn(sq, B, NG, HN, generator=g)
    return q, k, v


def test_every_attention_is_covered():
    assert set(CORE) | set(NSA) == set(ATTENTIONS), "a new attention needs its module path checked here"


# sq 8 and 24 end a key block 8 keys into a 16-key tile (the flex overrun's trigger); 13 is odd
@pytest.mark.parametrize("sq", [8, 13, 24], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
@pytest.mark.parametrize("name", CORE)
def test_core_attention_module_is_deterministic_under_poison(name, mask, sq):
    cls = getattr(ca, ATTENTIONS[name].module_path[1])
    if cls.supported_mask_types is not None and mask not in cls.supported_mask_types:
        pytest.skip(f"{name} does not take {mask.name}")
    if sq == 24 and name not in ("ssa_flex", "softmax", "ssa_reference"):
        pytest.skip("the 24-key case targets the flex template's tiles; the Triton paths run S8/S13")
    q, k, v = _qkv(sq, seed=6)
    qp, kp, vp = (nan_surrounded(t) for t in (q, k, v))

    def run():
        with torch.no_grad():
            return build(cls, mask=mask, attention_dropout=0.0).eval()(qp, kp, vp, None)

    out = assert_bit_identical(poisoned_runs(run), f"{name} S{sq} {mask.name}")
    with torch.no_grad():
        want = build(_reference_cls(name), mask=mask).eval()(q, k, v, None)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NSA)
def test_nsa_module_is_deterministic_under_poison(megatron_cpu, name):
    from test_nsa_attention import build as build_nsa, hidden, randomize_phi

    mod = build_nsa(transform=ATTENTIONS[name].transform).eval()
    randomize_phi(mod)
    x = nan_surrounded(hidden())

    def run():
        with torch.no_grad():
            return mod(x, None)[0]

    assert_bit_identical(poisoned_runs(run), name)


_AVX2_PROBE = textwrap.dedent("""
    import math, sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from torch.nn.attention.flex_attention import flex_attention
    from nemo_ssa.ops.attention.flex import ssa_attention_flex, _cpu_float_lanes
    from nemo_ssa.ops.attention.naive import attention_naive
    from nemo_ssa.testing.poison import nan_surrounded, poisoned_runs, assert_bit_identical
    assert _cpu_float_lanes() == 8, _cpu_float_lanes()

    # canary: torch's compiled CPU flex itself at the trigger (D16, 8 keys), K inside NaN
    g = torch.Generator().manual_seed(0)
    q, k, v = (nan_surrounded(torch.randn(1, 2, 8, 16, generator=g)) for _ in range(3))
    with torch.no_grad():
        raw = torch.compile(flex_attention, dynamic=False, fullgraph=True)(q, k, v)
    want = attention_naive(q, k, v, transform="softmax")
    print("CANARY", "overrun" if not torch.allclose(raw, want, atol=1e-5, rtol=1e-4) else "fixed")

    # ours: the guarded op at the trigger (eager) and at D32 (compiled), all poisoned
    n, b = torch.tensor([1.5]), torch.tensor([0.8])
    for d, sk in ((16, 8), (16, 24), (32, 8)):
        g = torch.Generator().manual_seed(d + sk)
        q = nan_surrounded(torch.randn(2, 4, sk, d, generator=g))
        k, v = (nan_surrounded(torch.randn(2, 2, sk, d, generator=g)) for _ in range(2))
        for causal in (True, False):
            def run():
                with torch.no_grad():
                    return ssa_attention_flex(q, k, v, n, b, causal=causal)
            out = assert_bit_identical(poisoned_runs(run, seeds=(0, 1)), f"flex D{{d}} S{{sk}}")
            ref = attention_naive(q, k, v, transform="ssa", n=n, b=b, causal=causal)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    print("OPS OK")
""")


def _avx2_capable() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        return " avx2" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.skipif(not _avx2_capable(), reason="needs an x86-64 CPU with AVX2 to force inductor's 8-lane ISA")
def test_flex_on_an_8_lane_isa_is_guarded_and_the_upstream_overrun_is_watched(tmp_path):
    """Under ``ATEN_CPU_CAPABILITY=avx2`` (8 float lanes, like the machine of issue 47):
    our flex op is right and bit-identical under poison, eager at head dim 16 and compiled at
    32; torch's own compiled flex still overruns at head dim 16 (when a torch release fixes
    it, this fails: narrow ``flex._cpu_microgemm_overrun`` to the torch versions that need it)."""
    script = tmp_path / "probe.py"
    script.write_text(_AVX2_PROBE.format(tests=os.path.dirname(os.path.dirname(__file__))))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and "OPS OK" in r.stdout, tail
    assert "CANARY overrun" in r.stdout, (
        f"torch {torch.__version__}'s compiled CPU FlexAttention no longer overruns at head dim 16 on an "
        f"8-lane ISA: narrow or drop the guard in nemo_ssa/ops/attention/flex.py\n{tail}")
