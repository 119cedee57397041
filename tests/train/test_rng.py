"""RNG snapshot/restore (nemo_ssa.train.rng)."""

import random

import numpy as np
import pytest
import torch

from nemo_ssa.train.rng import preserved_rng, restore_rng, snapshot_rng


def draw():
    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(),
            torch.randn(2, generator=None).tolist())


def seed_all(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def test_snapshot_restore_covers_python_numpy_torch():
    seed_all(0)
    draw()
    snap = snapshot_rng()
    first = draw()
    restore_rng(snap)
    again = draw()
    assert again == first
    assert draw() != first  # without another restore the streams move on


@pytest.mark.parametrize("which", [0, 1, 2])
def test_each_generator_is_restored(which):
    """Restoring covers each library separately (a draw from only one of them)."""
    fns = [random.random, lambda: np.random.rand(), lambda: torch.rand(1).item()]
    seed_all(1)
    snap = snapshot_rng()
    a = fns[which]()
    restore_rng(snap)
    assert fns[which]() == a


def test_preserved_rng_restores():
    seed_all(2)
    expected = draw()
    seed_all(2)
    with preserved_rng():
        inside = draw()
        torch.randn(100)
    assert draw() == expected
    assert inside == expected  # the block starts from the same state too


def test_preserved_rng_restores_on_exception():
    seed_all(3)
    expected = draw()
    seed_all(3)
    with pytest.raises(RuntimeError):
        with preserved_rng():
            draw()
            raise RuntimeError("boom")
    assert draw() == expected


def test_preserved_rng_disabled_does_not_restore():
    seed_all(4)
    expected = draw()
    seed_all(4)
    with preserved_rng(False):
        draw()
    after = draw()
    assert after != expected
    # the disabled block behaves as if it were not there: the streams simply moved on
    seed_all(4)
    draw()
    assert draw() == after


@pytest.fixture
def generator_tracker(monkeypatch):
    """megatron's tracker holding generators, as the cudagraphable variant megatron's CUDA graphs
    need does (nemo_ssa/megatron/cuda_graphs.py), on CPU generators; globals restored after."""
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    mrandom.initialize_rng_tracker()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(5)})
    return tracker


def test_generator_states_of_megatrons_tracker_are_restored_in_place(generator_tracker):
    g = generator_tracker.get_states()["model-parallel-rng"]
    torch.rand(2, generator=g)
    snap = snapshot_rng()
    first = torch.rand(4, generator=g)  # a draw advances the generator object itself
    restore_rng(snap)
    after = generator_tracker.get_states()["model-parallel-rng"]
    assert after is g  # the object a captured graph holds stays the tracker's
    assert torch.equal(torch.rand(4, generator=g), first)
    with preserved_rng():
        torch.rand(100, generator=g)
    assert not torch.equal(torch.rand(4, generator=g), first)  # the stream went on from where it was


def test_checkpointed_tracker_states_are_tensors_and_restore_into_either_tracker(generator_tracker):
    from nemo_ssa.train.checkpoint_io import _rng_from_obj, _rng_to_obj

    g = generator_tracker.get_states()["model-parallel-rng"]
    obj = _rng_to_obj(snapshot_rng())
    assert torch.is_tensor(obj["megatron_tracker"]["model-parallel-rng"])  # a generator does not pickle
    first = torch.rand(4, generator=g)
    restore_rng(_rng_from_obj(obj))
    assert torch.equal(torch.rand(4, generator=g), first)
    # into a tracker of byte tensors (a run without graphs resuming this checkpoint)
    generator_tracker.set_states({"model-parallel-rng": torch.Generator().get_state()})
    restore_rng(_rng_from_obj(obj))
    state = generator_tracker.get_states()["model-parallel-rng"]
    assert torch.is_tensor(state) and torch.equal(state, obj["megatron_tracker"]["model-parallel-rng"])
