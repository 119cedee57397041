"""Process setup: the parallel layout read from a recipe's strategy."""

from types import SimpleNamespace

import pytest

from nemo_ssa.train.process import ParallelLayout, parallel_layout


def _recipe(tp=1, cp=1, sp=False, pp=1):
    strategy = SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
                               pipeline_model_parallel_size=pp)
    return SimpleNamespace(trainer=SimpleNamespace(strategy=strategy))


def test_data_parallel_fills_the_world():
    layout = parallel_layout(_recipe(tp=2, sp=True), world=8)
    assert layout == ParallelLayout(tp=2, cp=1, sp=True, pp=1, world=8)
    assert layout.dp == 4
    assert layout.describe() == "world 8 = DP4 x TP2+SP x CP1"


def test_unset_sizes_mean_one():
    assert parallel_layout(_recipe(tp=None, cp=None, pp=None), world=2) == ParallelLayout(world=2)


def test_layout_that_does_not_tile_the_world_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"world size 6 is not a multiple of .* = 4"):
        parallel_layout(_recipe(tp=2, cp=2), world=6)
