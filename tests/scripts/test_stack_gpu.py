"""scripts/device/stack_gpu.py (the GPU stack check of issue 42) end to end on CPU: two stacks (both
the installed one here), the plain megatron-core entry at a tiny shape, the DP2 save + load
stage, the gates and the table. On GPUs it is the command of docs/results/2026-11-27-stack."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "device"))

import stack_gpu  # noqa: E402

pytestmark = pytest.mark.slow


def test_core_entry_runs_both_stacks_the_resume_and_the_gates(tmp_path, monkeypatch):
    monkeypatch.setattr(stack_gpu, "CORE_SHAPE", ["--fused-mlp", "auto", "--lr", "3e-3"])
    out = tmp_path / "out"
    rc = stack_gpu.main(["--entry", "core", "--stack", "a=", "--stack", "b=", "--steps", "60", "--attentions", "ssa",
                         "--out", str(out), "--scratch", str(tmp_path / "scratch")])
    table = (out / "table.md").read_text()
    assert rc == 0, table
    assert "| b ssa vs a | PASS |" in table
    assert "| b-dp2-resume (stopped + resumed) vs b ssa on one GPU | PASS |" in table
    metrics = (out / "b-dp2-resume-metrics.csv").read_text().splitlines()
    assert metrics[0] == "step,loss,segment" and len(metrics) == 61
    assert metrics[30].endswith(",1") and metrics[31].endswith(",2")  # saved at 30, resumed at 31
