"""ops/common/alloc.py: kernel outputs, NaN-poisoned on request."""

import torch

from nemo_ssa.ops.common import alloc


def test_poisoned_outputs_are_nan(monkeypatch):
    monkeypatch.setattr(alloc, "POISON_OUTPUTS", True)
    t = torch.zeros(3, 5).t()  # a transposed view: empty_like keeps its memory order
    like = alloc.new_output_like(t)
    assert like.shape == t.shape and like.stride() == t.stride() and like.isnan().all()
    assert alloc.new_output_like(t, dtype=torch.float64).dtype == torch.float64
    out = alloc.new_output((2, 4), torch.float32, "cpu")
    assert out.shape == (2, 4) and out.isnan().all()
    c = alloc.new_cstat(torch.zeros(2, 3, 7))
    assert c.shape == (2, 3, 7) and c.isnan().all()


def test_unpoisoned_outputs_are_plain_empty(monkeypatch):
    monkeypatch.setattr(alloc, "POISON_OUTPUTS", False)
    calls = []
    real = torch.Tensor.fill_
    monkeypatch.setattr(torch.Tensor, "fill_", lambda self, v: calls.append(v) or real(self, v))
    alloc.new_output_like(torch.zeros(4))
    alloc.new_output((4,), torch.float16, "cpu")
    assert calls == []
