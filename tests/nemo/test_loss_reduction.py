"""nemo_ssa.nemo.loss_reduction: NeMo's training-loss reduction, the same loss, no host read."""

import math

import pytest
import torch

pytest.importorskip("nemo")

from nemo.lightning.megatron_parallel import MaskedTokenLossReduction  # noqa: E402

from nemo_ssa.nemo.loss_reduction import MaskedTokenLossReductionNoSync, install  # noqa: E402


@pytest.fixture
def one_rank(monkeypatch):
    from megatron.core import parallel_state

    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: reduced.append(t.clone()))
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda with_context_parallel=False: None)
    return reduced


def _micro_batches(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in tokens:
        per_token = torch.rand(max(n, 1), generator=g) * 10
        mask = torch.ones(max(n, 1)) if n else torch.zeros(1)
        if not n:
            per_token[0] = float("nan")  # an empty micro batch's sum can be NaN: NeMo drops it
        out.append(MaskedTokenLossReduction().forward({"loss_mask": mask}, per_token)[2])
    return out


@pytest.mark.parametrize("tokens", [[1024], [7, 300, 33], [5, 0, 12], [0, 9]])
def test_the_loss_is_nemos(one_rank, tokens):
    mbs = _micro_batches(tokens)
    want = MaskedTokenLossReduction().reduce(mbs)
    got = MaskedTokenLossReductionNoSync().reduce(mbs)
    if all(tokens):
        assert torch.equal(got, want)  # the same rows summed: bit for bit
    else:
        assert math.isclose(float(got), float(want), rel_tol=1e-6)
    assert torch.equal(one_rank[-1], one_rank[-2]) or not all(tokens)  # the same [sum, tokens] all-reduced


def test_it_reads_nothing_to_the_host(one_rank, monkeypatch):
    mbs = _micro_batches([5, 0, 12])
    with pytest.raises(RuntimeError, match="host read"):  # NeMo's own filter reads the device
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: (_ for _ in ()).throw(RuntimeError("host read")))
        MaskedTokenLossReduction().reduce(mbs)
    got = MaskedTokenLossReductionNoSync().reduce(mbs)
    monkeypatch.undo()
    assert math.isfinite(float(got))


def test_install_only_over_nemos_own_reduction():
    class Model:
        _training_loss_reduction = None

        @property
        def training_loss_reduction(self):
            if not self._training_loss_reduction:
                self._training_loss_reduction = MaskedTokenLossReduction()
            return self._training_loss_reduction

    m = Model()
    assert install(m) and type(m.training_loss_reduction) is MaskedTokenLossReductionNoSync
    assert install(m)  # idempotent

    class Custom(MaskedTokenLossReduction):
        pass

    c = Model()
    c._training_loss_reduction = Custom()
    assert not install(c) and type(c.training_loss_reduction) is Custom
    assert not install(object())


def test_the_recipe_reduces_without_the_read(tmp_path):
    from recipes import nemotron_114m

    recipe = nemotron_114m.pretrain_recipe(dir=str(tmp_path), attention="ssa")
    names = [c.__fn_or_cls__.__name__ for c in recipe.trainer.callbacks]
    assert names.count("SyncFreeLossReductionCallback") == 1
