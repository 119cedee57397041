"""nemo_ssa.study.icl_train on CPU (the smoke configuration: it runs, it does not learn in 40
steps): the block is built from our layer spec with the requested core attention, every
attention sees the same prompts for a seed, evaluation covers every shift with least
squares beside, and the table has one row per shift and example count."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_ssa.study import icl_train


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, megatron_cpu):
    out = tmp_path_factory.mktemp("icl")
    assert icl_train.main(["--cpu-smoke", "--seeds", "1", "--attentions", "softmax,ssa_reference",
                           "--steps", "6", "--out", str(out)]) == 0
    return json.loads((out / "icl.json").read_text()), (out / "icl.md").read_text()


def test_model_uses_the_requested_core_attention(megatron_cpu):
    from nemo_ssa.megatron.core_attention import SoftmaxCoreAttention, SSAReferenceCoreAttention
    from nemo_ssa.megatron.cpu import cpu_device_shims

    with cpu_device_shims():
        for name, cls in (("softmax", SoftmaxCoreAttention), ("ssa_reference", SSAReferenceCoreAttention)):
            m = icl_train.ICLModel(icl_train.CPU_SMOKE, name)
            cores = [x for x in m.modules() if type(x) is cls]
            assert len(cores) == icl_train.CPU_SMOKE.layers, name
            out = m(torch.zeros(2, 2 * icl_train.CPU_SMOKE.k, icl_train.CPU_SMOKE.d + 1))
            assert out.shape == (2, icl_train.CPU_SMOKE.k)


def test_smoke_run_evaluates_every_shift(smoke):
    data, md = smoke
    res = data["results"]
    assert {r["attention"] for r in res} == {"softmax", "ssa_reference"}
    k, d = data["config"]["k"], data["config"]["d"]
    for r in res:
        assert set(r["eval"]) == set(icl_train.SHIFTS)
        for curves in r["eval"].values():
            assert len(curves["model"]) == k and all(v == v for v in curves["model"])  # finite, not NaN
            assert max(curves["least_squares"][d:]) < 1e-9  # noiseless: the floor is exact from d on
    # same prompts per seed: the least-squares curves agree across attentions
    assert res[0]["eval"]["x x4"]["least_squares"] == res[1]["eval"]["x x4"]["least_squares"]
    table, verdicts = md.split("## Seed-paired verdicts")
    assert table.count("| x x8 |") == len(sorted({1, d // 2, d, k - 1} - {0}))
    assert verdicts.count("one seed: no verdict") == 2 * len(icl_train.SHIFTS)  # at d and k - 1


def test_finished_runs_are_reused_and_a_changed_config_retrains(smoke, tmp_path, monkeypatch, megatron_cpu):
    out = tmp_path / "icl"
    calls = []
    real = icl_train.train_one

    def counting(cfg, attention, seed, log_every=0, **kw):
        calls.append((attention, seed, cfg.steps))
        return real(cfg, attention, seed, log_every, **kw)

    monkeypatch.setattr(icl_train, "train_one", counting)
    args = ["--cpu-smoke", "--seeds", "1", "--attentions", "softmax", "--steps", "3", "--out", str(out)]
    assert icl_train.main(args) == 0 and calls == [("softmax", 1, 3)]
    first = json.loads((out / "icl.json").read_text())["results"][0]["train_loss"]
    assert icl_train.main(args) == 0 and calls == [("softmax", 1, 3)]  # reused, nothing trained
    assert json.loads((out / "icl.json").read_text())["results"][0]["train_loss"] == first
    assert icl_train.main(args[:-3] + ["4", "--out", str(out)]) == 0  # another schedule: trained again
    assert calls[-1] == ("softmax", 1, 4)


def _synthetic(offset, seeds=(1, 2, 3, 4)):
    """ICL results whose 'b' curve sits ``offset`` below 'a' in every condition."""
    import random

    cfg = icl_train.CPU_SMOKE
    out = []
    for s in seeds:
        rng = random.Random(s)
        base = [1.0 - 0.05 * i + rng.gauss(0, 0.01) for i in range(cfg.k)]
        for name, off in (("a", 0.0), ("b", -offset)):
            ev = {sh: {"model": [v + off + random.Random(s * 31 + len(name)).gauss(0, 0.002) for v in base],
                       "least_squares": [0.0] * cfg.k} for sh in icl_train.SHIFTS}
            out.append({"attention": name, "seed": s, "eval": ev})
    return cfg, out


def test_verdicts_find_a_planted_difference_and_not_an_absent_one():
    cfg, res = _synthetic(0.2)
    text = icl_train.verdict_table(res, cfg, ["a", "b"])
    rows = [r for r in text.splitlines() if r.startswith("| in-distribution")]
    assert rows and all("b lower by 0.200" in r for r in rows)
    cfg, res = _synthetic(0.0)
    text = icl_train.verdict_table(res, cfg, ["a", "b"])
    assert "lower by" not in text and text.count("no difference beyond the seed spread") == 2 * len(icl_train.SHIFTS)


def test_a_run_stopped_and_resumed_is_the_uninterrupted_run(tmp_path, megatron_cpu, capsys):
    """--stop-after-steps / --budget-s: the run checkpoints, the command exits 3, and the same
    command finishes it -- the same losses and evaluation, bit for bit on CPU, as one call."""
    common = ["--cpu-smoke", "--seeds", "1", "--attentions", "ssa_reference", "--steps", "6"]
    assert icl_train.main(common + ["--out", str(tmp_path / "whole")]) == 0
    cut = tmp_path / "cut"
    assert icl_train.main(common + ["--out", str(cut), "--stop-after-steps", "4"]) == 3
    ck = torch.load(icl_train.ckpt_path(str(cut), "ssa_reference", 1), weights_only=True)
    assert ck["step"] == 4 and len(ck["losses"]) == 4 and not (cut / "icl.json").exists()
    capsys.readouterr()
    assert icl_train.main(common + ["--out", str(cut)]) == 0
    assert "resumed at step 4/6" in capsys.readouterr().out  # not retrained from scratch (which would also match)
    whole = json.loads((tmp_path / "whole" / "icl.json").read_text())["results"][0]
    resumed = json.loads((cut / "icl.json").read_text())["results"][0]
    assert resumed["train_loss"] == whole["train_loss"] and resumed["eval"] == whole["eval"]
    assert not (cut / "ckpt" / "ssa_reference-s1.pt").exists()  # a finished run leaves no checkpoint


def test_a_checkpoint_of_another_configuration_is_not_resumed(tmp_path, megatron_cpu, capsys):
    common = ["--cpu-smoke", "--seeds", "1", "--attentions", "softmax", "--out", str(tmp_path)]
    assert icl_train.main(common + ["--steps", "6", "--stop-after-steps", "3"]) == 3
    assert icl_train.main(common + ["--steps", "5"]) == 0
    assert "another configuration's checkpoint; starting afresh" in capsys.readouterr().out


def test_cuda_graphs_are_refused_on_a_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        icl_train.main(["--cpu-smoke", "--cuda-graphs", "--out", str(tmp_path)])
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err
    cfg = icl_train.ICLConfig(**{**icl_train.asdict(icl_train.CPU_SMOKE), "cuda_graphs": True})
    with pytest.raises(ValueError, match="needs a CUDA device"):
        icl_train.train_one(cfg, "softmax", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["softmax", "ssa"])
def test_the_graphed_step_trains_as_the_eager_one_on_cuda(attention):
    """--cuda-graphs: the step is captured after the warm-up and replayed (the result says so),
    and the losses follow the eager run's: the same prompts and update rule (AdamW capturable
    keeps its step count on the device, so the bias corrections round differently)."""
    # the smoke model at width 64: head dim 16, the Triton kernels' smallest (the smoke's 8 is below it)
    base = {**icl_train.asdict(icl_train.CPU_SMOKE), "hidden": 64}
    eager = icl_train.train_one(icl_train.ICLConfig(**{**base, "steps": 12}), attention, 1)
    graphed = icl_train.train_one(icl_train.ICLConfig(**{**base, "steps": 12, "cuda_graphs": True}), attention, 1)
    assert graphed["cuda_graph"] == {"captured": True, "failed": None}
    assert "cuda_graph" not in eager
    a, b = torch.tensor(eager["train_loss"]), torch.tensor(graphed["train_loss"])
    assert torch.isfinite(b).all() and len(b) == 12
    assert torch.equal(a[:1], b[:1])  # before any update: the same model on the same prompts
    assert torch.allclose(a, b, rtol=2e-2), (a, b)  # bf16 weights: a rounding apart, not a different run
    assert b[icl_train.GRAPH_WARMUP + 1:].unique().numel() > 1  # replays see new prompts, not one frozen batch
