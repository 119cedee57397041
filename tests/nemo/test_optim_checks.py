"""SSAMegatronOptimizerModule reads the sync-free step's gradient checks where a run must not go
on without them: before a checkpoint is written and at the end of training."""

import pytest
import torch

from nemo_ssa.megatron import sync_free
from nemo_ssa.nemo.optim import SSAMegatronOptimizerModule


@pytest.fixture
def guard():
    sync_free.GUARD.reset()
    sync_free.GUARD.flag = torch.zeros(())
    yield sync_free.GUARD
    sync_free.GUARD.reset()


def _bad_step(guard, iteration):
    guard.iteration = iteration
    guard.record_buckets([torch.tensor(1.0), torch.tensor(float("nan"))])
    guard.end_step()


@pytest.mark.parametrize("hook", ["on_save_checkpoint", "on_train_end"])
def test_hooks_wait_for_the_checks_in_flight(guard, hook):
    mod = object.__new__(SSAMegatronOptimizerModule)
    _bad_step(guard, 12)
    args = (None, None, {}) if hook == "on_save_checkpoint" else (None, None)
    with pytest.raises(RuntimeError, match=r"iteration 12: .*bucket #1"):
        getattr(mod, hook)(*args)


def test_hooks_pass_when_the_steps_were_good(guard):
    mod = object.__new__(SSAMegatronOptimizerModule)
    guard.record_buckets([torch.tensor(2.0)])
    guard.end_step()
    mod.on_save_checkpoint(None, None, {})
    mod.on_train_end(None, None)


def test_the_step_count_follows_the_trainer(guard):
    mod = object.__new__(SSAMegatronOptimizerModule)
    mod._optimizers = None
    trainer = type("T", (), {"global_step": 77})()
    mod.on_train_batch_start(trainer, type("M", (), {"device": torch.device("cpu"), "log": print})(), None, 0)
    assert guard.iteration == 77
