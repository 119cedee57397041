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
