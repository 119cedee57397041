"""Fault injection for the resume tests: stall a run at a named point so a test can kill it there."""

from __future__ import annotations

import os
import time


def fault_injection(point: str, step: int) -> None:
    """Test hook: ``NEMO_SSA_FAULT=<point>:<step>:<seconds>`` sleeps there (a test then kills
    the process mid-save, or a rank after a step: points ``after_save``, ``step_end``).
    Never set in normal runs."""
    spec = os.environ.get("NEMO_SSA_FAULT")
    if not spec:
        return
    want, want_step, seconds = spec.split(":")
    if want == point and int(want_step) == step:
        print(f"[cpu] fault injection: sleeping {seconds}s at {point} of step {step}", flush=True)
        time.sleep(float(seconds))
