"""nemo_ssa.nemo.steps.data_step: the batch NeMo's trainer hands the model.

Under context parallel every rank must get its two load-balanced chunks of each sequence
(megatron's ``get_batch_on_this_cp_rank``, what NeMo's ``gpt_data_step`` does): the core
attention all-gathers K/V assuming exactly those chunks. Without the slice (the state on
2 x H100, 2026-11-25) each CP rank trained on the whole sequence under chunk positions and
the CP2 loss sat 0.05-0.09 above one GPU's.
"""

from __future__ import annotations

import pytest
import torch

from nemo_ssa.nemo import steps


def _batch(b=2, s=16):
    tokens = torch.arange(b * s).view(b, s)
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s).contiguous(), "token_count": torch.tensor([s])}


@pytest.fixture
def cp_world(monkeypatch):
    from megatron.core import parallel_state

    def set_cp(size, rank):
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda *a, **k: size)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda *a, **k: rank)
        monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", lambda *a, **k: True)
        monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda *a, **k: True)
    return set_cp


def test_one_cp_rank_gets_the_whole_batch(cp_world):
    cp_world(1, 0)
    out = steps.data_step(iter([_batch()]))
    ref = _batch()
    assert set(out) == {"tokens", "labels", "loss_mask", "position_ids"}
    for k in out:
        assert torch.equal(out[k].cpu(), ref[k])


@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (4, 3)])
def test_context_parallel_rank_gets_its_two_load_balanced_chunks(cp_world, cp, rank):
    cp_world(cp, rank)
    s = 16
    out = steps.data_step(iter([_batch(s=s)]))
    c = s // (2 * cp)
    cols = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    ref = _batch(s=s)
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        assert out[k].shape == (2, 2 * c), k
        assert torch.equal(out[k].cpu(), ref[k][:, cols]), k
