"""The run identity ``reuse_if_complete`` compares (nemo_ssa.cli.pretrain._identity): an option
added after runs were recorded, at its neutral default, must not change the identity of a run
that finished before it existed -- the learning-rate sweep resumes across sessions from run
directories returned by earlier device calls, and retraining them would cost the device time
they took. At any other value it is part of the identity."""

from __future__ import annotations

import copy

from nemo_ssa.cli.pretrain import _NEUTRAL_DEFAULTS, _identity

# the shape of a recorded run's config.yaml (docs/results/2026-11-27-lr-sweep, logs/site-runs.tgz)
RECORDED = {
    "attention": {"name": "ssa", "options": {"n": None, "b": None}},
    "train": {"lr": 0.0012, "max_steps": 1000, "limit_val_batches": 8},
    "data": {"source": "site-packages", "vocab_size": 50257, "max_bytes": None, "dir": None, "prefix": None,
             "tokenizer_dir": None},
    "model": {"recipe": "nemotron_114m", "vocab_size": None, "fused_cross_entropy": "auto", "fused_mlp": "auto",
              "fused_layernorm": False, "init_on_cpu": False},
    "seed": 1234, "run_dir": "/tmp/sweep/ssa-lr0.0012-s1234", "resume": False, "reuse_if_complete": True,
}


def test_a_new_option_at_its_neutral_default_keeps_a_recorded_runs_identity():
    assert ("data", "tokenizer_from") in _NEUTRAL_DEFAULTS  # added 2026-11-28, after the sweep's first runs
    # megatron's CUDA graphs: a run records what auto decided, and none is how runs ran before the option
    assert _NEUTRAL_DEFAULTS[("model", "cuda_graphs")] == "none"
    before = _identity(RECORDED)
    for (group, key), neutral in _NEUTRAL_DEFAULTS.items():
        now = copy.deepcopy(RECORDED)
        now[group][key] = neutral
        assert _identity(now) == before, (group, key)
        now[group][key] = "/somewhere/tokenizer.json" if key == "tokenizer_from" else "local"
        assert _identity(now) != before, (group, key)


def test_what_determines_the_result_changes_the_identity_and_how_it_was_launched_does_not():
    before = _identity(RECORDED)
    lr = copy.deepcopy(RECORDED)
    lr["train"]["lr"] = 0.0024
    assert _identity(lr) != before
    resumed = dict(RECORDED, resume=True, reuse_if_complete=False)
    assert _identity(resumed) == before
