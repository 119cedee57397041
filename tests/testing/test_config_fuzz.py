"""Config-level fuzz: random launcher configurations are either accepted
(and the documented rules find nothing unsupported) or refused in one line naming what is
supported -- never a crash, never a silent acceptance. Negative controls show each failure
kind is caught."""

import pytest

from nemo_ssa.testing import config_fuzz


def test_300_cases_accepted_or_refused_never_failed():
    counts, failures = config_fuzz.run(300, seed=1)
    assert failures == [], failures[:5]
    assert counts["accepted"] > 10 and counts["refused"] > 100  # both outcomes are exercised


@pytest.mark.parametrize("fake, want", [
    (lambda cfg, cuda: {"attention": "x", "dp": 1}, "accepted an unsupported configuration"),
    (lambda cfg, cuda: (_ for _ in ()).throw(RuntimeError("boom")), "crash RuntimeError"),
    (lambda cfg, cuda: (_ for _ in ()).throw(ValueError("bad")), "without the supported set"),
])
def test_negative_controls(monkeypatch, fake, want):
    monkeypatch.setattr(config_fuzz, "check_run_config", fake)
    counts, failures = config_fuzz.run(60, seed=1)
    assert counts["failed"] > 0 and any(want in d for _, d in failures)


def test_explicit_zero_parallel_size_is_refused():
    # the fuzz found it: tensor_parallel=0 was read as 1 (``or 1``) and accepted
    from nemo_ssa.config.check import check_run_config

    cfg = {"attention": {"name": "softmax"}, "policy": "pinned", "seed": 1,
           "train": {"tensor_parallel": 0, "precision": "32"}, "model": {}}
    with pytest.raises(ValueError, match="tensor_parallel"):
        check_run_config(cfg, cuda=False)



@pytest.mark.parametrize("every, want", [(45, 45), (10, 10), (None, 45), (46, 45), (1000, 45)])
def test_val_check_interval_beyond_max_steps_is_clamped_and_said(every, want):
    # seen on 4 GPUs: val_check_interval=1000 with max_steps=45 reached Lightning's fit loop and
    # died there on every rank ("must be less than or equal to the number of the training batches")
    from nemo_ssa.config.check import held_out_every

    got, note = held_out_every(45, every)
    assert got == want
    assert (note is not None) == (every is not None and every > 45)
    if note:
        assert f"val_check_interval={every}" in note and "step 45" in note


def test_val_check_interval_below_one_is_refused():
    from nemo_ssa.config.check import check_run_config, held_out_every

    cfg = {"attention": {"name": "softmax"}, "policy": "pinned", "seed": 1, "model": {},
           "train": {"max_steps": 45, "val_check_interval": 0, "precision": "32"}}
    with pytest.raises(ValueError, match="val_check_interval"):
        check_run_config(cfg, cuda=False)
    with pytest.raises(ValueError, match="val_check_interval"):
        held_out_every(45, 0)
