"""The CI matrix on CPU: the suite's core also against the newest megatron-core that installs
on this Python (0.16.1 on 3.11) *and* numpy 2, in one subprocess whose PYTHONPATH starts with
the overlays scripts/env.sh installs (requirements/overlays/). The full suite runs on the
locked set (megatron-core 0.15.3, numpy 1.26.4).

The core: the layer spec built for every attention and the optimizer's weight-decay groups
through our path and NeMo's (tests/megatron/test_spec_model.py), two gloo ranks training
with the distributed optimizer, saving, stopping and resuming (tests/megatron/test_compat.py),
the op references (tests/ops/attention/test_naive.py), config checks (tests/test_policy.py), the
version guard (tests/test_versions.py), and the plain megatron-core path (the layer specs
Megatron-LM's --spec reads, scripts/train_megatron_core.py at one rank and TP2).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAYS = [os.path.join(sys.prefix, "overlays", name) for name in ("megatron-core-newest", "numpy2")]
CORE = ["tests/megatron/test_spec_model.py", "tests/megatron/test_compat.py", "tests/ops/attention/test_naive.py",
        "tests/test_policy.py", "tests/test_versions.py", "tests/scripts/test_train_megatron_core.py",
        "tests/megatron/test_layer_specs.py"]
INSIDE = "NEMO_SSA_STACK_MATRIX"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(INSIDE) == "1", reason="inside the matrix run")
def test_core_suite_on_the_newest_megatron_core_and_numpy2():
    missing = [p for p in OVERLAYS if not os.path.isdir(p)]
    if missing:
        msg = f"overlays missing: {missing}; run the tests through scripts/env.sh, which installs them"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(OVERLAYS + [REPO]), **{INSIDE: "1"})
    probe = subprocess.run([sys.executable, "-c", "import megatron.core, numpy; "
                            "print(megatron.core.__version__, numpy.__version__)"],
                           env=env, capture_output=True, text=True, cwd=REPO)
    mc, np_version = probe.stdout.split()[-2:]
    assert mc == "0.16.1" and np_version.startswith("2."), probe.stdout + probe.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CORE], env=env,
                          capture_output=True, text=True, cwd=REPO, timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"megatron-core {mc}, numpy {np_version}:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
