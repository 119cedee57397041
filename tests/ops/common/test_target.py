"""ops.common.target: one place answers what a device can run, and only it asks the device.

- The facts of each kind of device (fast math, TMA, wgmma, whether kernels run).
- ``stand_in`` answers for every device while it is active, nests, and restores.
- The probes the kernels' choices use (``tma_capable``, ``wgmma_capable``, the fast-math
  default, the op's device check) follow the stand-in: a CPU machine sees the H100 rows.
- No other module under ``nemo_ssa/ops`` queries the device's capability, properties or SM
  count (a second probe would be a second answer).
"""

import os
import re
from pathlib import Path

import pytest
import torch

from nemo_ssa.ops.common import target as T
from nemo_ssa.ops.common.launch import is_interpreter
from nemo_ssa.ops.common.tma import tma_capable, wgmma_capable

OPS = Path(__file__).resolve().parents[3] / "nemo_ssa" / "ops"
CPU = torch.device("cpu")


@pytest.mark.parametrize("t,kernels,fast,tma,wgmma", [
    (T.Target("cuda", (9, 0), 132), True, True, True, True),
    (T.Target("cuda", (10, 0), 148), True, True, True, False),
    (T.Target("cuda", (8, 0), 108), True, True, False, False),
    (T.Target("rocm", (9, 4)), True, False, False, False),
    (T.Target("interpreter"), True, False, True, False),
    (T.Target("cpu"), False, False, False, False),
    (T.Target("unsupported"), False, False, False, False),
])
def test_each_device_kind_answers_its_facts(t, kernels, fast, tma, wgmma):
    assert (t.runs_kernels, t.fast_math, t.tma, t.wgmma) == (kernels, fast, tma, wgmma)


def test_this_process_answers_for_cpu_tensors():
    want = "interpreter" if is_interpreter() else "cpu"
    assert T.backend(CPU) == want and T.target(CPU) == T.Target(want)
    assert not T.use_fast_math(CPU) and not wgmma_capable(CPU)


def test_stand_in_answers_for_every_device_nests_and_restores():
    before = T.target(CPU)
    with T.stand_in(T.H100):
        assert T.target(CPU) is T.H100 and T.backend(CPU) == "cuda"
        assert T.use_fast_math(CPU) and tma_capable(CPU) and wgmma_capable(CPU)
        blackwell = T.Target("cuda", (10, 0), 148)
        with T.stand_in(blackwell):
            assert T.target(CPU) is blackwell and tma_capable(CPU) and not wgmma_capable(CPU)
        assert T.target(CPU) is T.H100
    assert T.target(CPU) == before
    with pytest.raises(RuntimeError):
        with T.stand_in(T.H100):
            raise RuntimeError("restored on the way out")
    assert T.target(CPU) == before


def test_the_ops_device_check_follows_the_target():
    from nemo_ssa.ops.common.validate import UnsupportedError
    from nemo_ssa.ops.attention.flash import flash_attention

    q = torch.randn(1, 2, 8, 16)
    with T.stand_in(T.Target("cpu")):  # a CPU without the interpreter: refused, naming what runs
        with pytest.raises(UnsupportedError, match="supported devices: cuda"):
            flash_attention(q, q, q, transform="softmax")
    with T.stand_in(T.Target("unsupported")):
        with pytest.raises(UnsupportedError, match="built for TRITON_INTERPRET=1"):
            flash_attention(q, q, q, transform="softmax")


def test_no_other_ops_module_queries_the_device():
    probe = re.compile(r"get_device_capability|get_device_properties|multi_processor_count")
    hits = [f"{p.relative_to(OPS)}:{i}" for p in sorted(OPS.rglob("*.py")) if p.name != "target.py"
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if probe.search(line) and not line.lstrip().startswith("#")]
    assert hits == [], f"device queries outside ops/common/target.py: {hits}"
    # and the negative control: target.py itself does query it
    assert probe.search((OPS / "common" / "target.py").read_text())
