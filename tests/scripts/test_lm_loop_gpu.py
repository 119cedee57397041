"""scripts/device/lm_loop_gpu.py (Megatron-LM's loop on GPUs, issue 42): its reading of megatron's
iteration lines, and its whole flow on a megatron-core the loop refuses (here 0.15.3: the
first launch fails with the entry's message, nothing else is started, the table says so).
The run on GPUs is docs/results/2026-11-27-stack."""

from __future__ import annotations

import os
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "device"))

import lm_loop_gpu  # noqa: E402

# two iteration lines as megatron-core 0.19.2 prints them (H200 log, 2026-11-27), one other line
LOG = """ [2026-11-27 19:13:08.227953] iteration        1/     200 | consumed samples:           32 | elapsed time per iteration (ms): 1803.0 | learning rate: 3.000000E-05 | global batch size:    32 | lm loss: 1.064265E+01 | loss scale: 1.0 | grad norm: 4.512 |
 validation loss at iteration 100 | lm loss value: 4.9E+00 |
 [2026-11-27 19:13:25.991337] iteration      100/     200 | consumed samples:         3200 | elapsed time per iteration (ms): 159.4 | learning rate: 3.768850E-04 | global batch size:    32 | lm loss: 4.581224E+00 | loss scale: 1.0 |
"""


def test_iteration_lines_become_steps_and_losses(tmp_path):
    assert lm_loop_gpu.losses_from_log(LOG) == [(1, 10.64265), (100, 4.581224)]
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(LOG)
    b.write_text(LOG.replace("iteration        1/", "iteration      101/").replace("iteration      100/",
                                                                                      "iteration      200/"))
    assert lm_loop_gpu.write_metrics(str(tmp_path / "run"), [str(a), str(b), str(tmp_path / "missing.log")]) == 4
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows == ["step,loss,segment", "1,10.64265,1", "100,4.581224,1", "101,10.64265,2", "200,4.581224,2"]


def test_a_refused_first_launch_stops_the_plan_and_says_so(tmp_path):
    out = tmp_path / "out"
    rc = lm_loop_gpu.main(["--site", "", "--out", str(out), "--scratch", str(tmp_path / "s"), "--steps", "8",
                           "--budget", "240"])
    assert rc == 1
    table = (out / "table.md").read_text()
    assert "| ssa_triton | 1 |" in table and "softmax-no1p" not in table.split("| gate")[0]
    assert table.count("| no run |") == 2
    with tarfile.open(out / "logs.tgz") as tar:
        log = tar.extractfile("ssa_triton.log").read().decode()
    assert "megatron-core>=0.19,<0.20" in log  # the entry's refusal, with the way to go instead
    assert not list(out.glob("*.log"))
