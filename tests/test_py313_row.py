"""CI's row on a newer stack: Python 3.13, torch 2.11, megatron-core 0.19.2 (issue 42).

megatron-core >= 0.17 needs Python >= 3.12 and the CI machine has 3.11, so scripts/env.sh builds
a Debian trixie root with Python 3.13 when .ci/run asks (NEMO_SSA_PY313=1; scripts/py313_root.sh, requirements/
py313-mcore019.txt) and this test runs the suite's megatron-core 0.19 part inside it: the repo
bind-mounted at /repo in a private mount namespace (``unshare --mount``; nothing outlives the
call), ``chroot``, pytest on the files below. What they cover there, on the installed 0.19.2:
the layer specs into a GPTModel, the plain megatron-core entry training on CPU and its
checkpoint save + resume, and Megatron-LM's loop from the wheel up to ``pretrain`` (argument
list, GPTModelBuilder with our block spec, GPTDataset over a corpus, forward step and loss).
Without the root the test skips (a developer machine), under ``CI`` it fails.

Left out, with the reason: TP2 of the plain entry (``test_tensor_parallel_reproduces_one_rank``)
hangs on 0.19.2 on CPU (gloo; seen 2026-11-27, not diagnosed; TP on 0.19 has not run on GPUs
either).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.environ.get("NEMO_SSA_PY313_ROOT") or os.path.join(sys.prefix, "py313-root")

FILES = [
    "tests/megatron/test_layer_specs.py",
    "tests/megatron/test_lm_pretrain.py",
    "tests/scripts/test_train_megatron_core.py",
]
DESELECT = ["tests/scripts/test_train_megatron_core.py::test_tensor_parallel_reproduces_one_rank"]

pytestmark = pytest.mark.slow


def test_the_megatron_core_0_19_part_of_the_suite_passes_on_python_3_13():
    if not os.path.isfile(os.path.join(ROOT, ".ready")):
        msg = (f"no Python 3.13 root at {ROOT}: NEMO_SSA_PY313=1 bash scripts/env.sh ... builds it "
               "(.ci/run does; scripts/py313_root.sh)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.fail("the Python 3.13 row needs root privileges and unshare (mount namespace + chroot)")
    inner = ("cd /repo && /opt/v/bin/python -m pytest -q -p no:cacheprovider -rs "
             + " ".join(FILES) + " " + " ".join(f"--deselect {d}" for d in DESELECT))
    script = (f"mount --bind /proc {ROOT}/proc && mount --bind /dev {ROOT}/dev && "
              f"mount --bind {REPO} {ROOT}/repo && "
              f"chroot {ROOT} /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 "
              f"NEMO_SSA_TEST_SEED_BASE={os.environ.get('NEMO_SSA_TEST_SEED_BASE', '')} /bin/sh -c '{inner}'")
    r = subprocess.run(["unshare", "--mount", "/bin/sh", "-c", script], capture_output=True, text=True,
                       timeout=900)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    summary = [ln for ln in r.stdout.splitlines() if " passed" in ln]
    assert summary and "failed" not in summary[-1] and "error" not in summary[-1], tail
    # the row proves something only if its megatron-0.19 tests ran, not skipped
    passed = int(summary[-1].split(" passed")[0].split()[-1])
    assert passed >= 20, tail
