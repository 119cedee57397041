"""The run's seed reaches the weights on NeMo's path (``SeedCallback``, ``apply_seed``).

NeMo's strategy seeds Python, numpy, torch and megatron's CUDA RNG tracker with 1234 whatever
the recipe's seed (``init_parallel_ranks``' default, read here from the installed NeMo): before
the callback, every NeMo run started from the same weights and a seed changed only the data
order. Checked on CPU: the callback seeds the generators NeMo seeds, with the run's seed, the
way NeMo does; it does nothing at 1234 (those runs keep their bits); the recipe puts it first
(before the CUDA graph callback, which keeps the tracker's streams) and only for another seed.
The order of Lightning's hooks it relies on is checked in tests/megatron/test_cuda_graphs.py
(``test_lightning_calls_setup_after_nemo_seeded_and_before_the_model_is_built``).
"""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch

from nemo_ssa.nemo.callbacks import NEMO_DEFAULT_SEED, SeedCallback


def test_nemo_seeds_1234_whatever_the_recipe_says():
    from nemo.lightning import _strategy_lib, megatron_init
    from nemo.lightning.pytorch.strategies import utils

    assert inspect.signature(_strategy_lib.init_parallel_ranks).parameters["seed"].default == NEMO_DEFAULT_SEED
    # the strategy's call passes no seed
    call = [ln for ln in inspect.getsource(utils.setup_parallel_ranks).splitlines() if "init_parallel_ranks(" in ln]
    assert call and "seed" not in call[0]
    # and NeMo's seeding is the one seed_like_nemo repeats: pipeline offset, then the four generators
    src = inspect.getsource(megatron_init._set_random_seed)
    assert "100 * get_pipeline_model_parallel_rank()" in src and "model_parallel_cuda_manual_seed(seed)" in src


@pytest.fixture
def fake_megatron(monkeypatch):
    """CPU stand-ins for what needs a GPU or an initialised parallel state; records the tracker's seed."""
    from megatron.core import parallel_state, tensor_parallel

    seen = []
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda s, **k: seen.append(s))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return seen


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_callback_seeds_every_generator_with_the_runs_seed(fake_megatron, capsys):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    SeedCallback(7).setup(None, None, "fit")
    assert "[seed] weights seeded with 7" in capsys.readouterr().out
    got = _draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    assert got == _draws()
    assert fake_megatron == [7]


def test_callback_offsets_by_the_pipeline_rank_as_nemo_does(fake_megatron, monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 2)
    SeedCallback(7).setup(None, None, "fit")
    assert fake_megatron == [207] and torch.initial_seed() == 207


def test_callback_leaves_nemos_own_seed_alone(fake_megatron, capsys):
    torch.manual_seed(NEMO_DEFAULT_SEED)
    torch.rand(5)  # whatever ran since NeMo seeded stays as it is
    state = torch.get_rng_state()
    SeedCallback(NEMO_DEFAULT_SEED).setup(None, None, "fit")
    assert torch.equal(torch.get_rng_state(), state) and fake_megatron == []
    assert "[seed]" not in capsys.readouterr().out


def _callbacks(recipe):
    return [c.__fn_or_cls__.__name__ for c in recipe.trainer.callbacks or []]


def test_recipe_adds_the_callback_first_and_only_for_another_seed(tmp_path):
    import fiddle as fdl

    from recipes import nemotron_114m

    d = str(tmp_path)
    at_1234 = nemotron_114m.pretrain_recipe(dir=d, attention="ssa", max_steps=2)
    other = nemotron_114m.pretrain_recipe(dir=d, attention="ssa", max_steps=2, seed=1235)
    assert "SeedCallback" not in _callbacks(at_1234)
    assert _callbacks(other) == ["SeedCallback"] + _callbacks(at_1234)
    assert other.trainer.callbacks[0].seed == 1235
    assert fdl.build(other.trainer.callbacks[0]).seed == 1235


def test_recipe_seeds_before_the_cuda_graph_callback_keeps_the_streams(tmp_path):
    from recipes import nemotron_114m

    r = nemotron_114m.pretrain_recipe(dir=str(tmp_path), attention="ssa", max_steps=2, seed=1235,
                                      cuda_graphs="local")
    names = _callbacks(r)
    assert names.index("SeedCallback") < names.index("CudaGraphRNGCallback")
