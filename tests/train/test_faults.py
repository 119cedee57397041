"""Fault injection: ``NEMO_SSA_FAULT=<point>:<step>:<seconds>`` stalls only at that point and step."""

from nemo_ssa.train import faults


def test_stalls_only_at_the_named_point_and_step(monkeypatch, capsys):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv("NEMO_SSA_FAULT", "after_save:4:120")
    faults.fault_injection("after_save", 3)
    faults.fault_injection("step_end", 4)
    assert slept == []
    faults.fault_injection("after_save", 4)
    assert slept == [120.0]
    assert "sleeping 120s at after_save of step 4" in capsys.readouterr().out


def test_unset_does_nothing(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_FAULT", raising=False)
    monkeypatch.setattr(faults.time, "sleep", lambda s: (_ for _ in ()).throw(AssertionError("slept")))
    faults.fault_injection("after_save", 4)
