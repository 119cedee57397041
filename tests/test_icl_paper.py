"""nemo_ssa.study.icl_paper on CPU: the authors' samplers, token layout, loss positions,
curriculum and evaluation grids (docs/icl-paper-setup.md), the least-squares floor, the model
from our layer spec, and the CLI end to end: a finished run is reused, an interrupted one
resumes from its checkpoint to the same result bit for bit."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import replace

import pytest
import torch

from nemo_ssa.study import icl_paper as P


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- samplers
def test_linear_sampler_shapes_and_scales():
    x, y, ab = P.sample_linear(20000, 11, sigma_x=3.0, sigma=5.0, generator=_g(1))
    assert x.shape == y.shape == (20000, 11) and ab.shape == (20000, 2)
    assert abs(x.std().item() - 3.0) < 0.05 and abs(x.mean().item()) < 0.05
    assert (ab.std(0) - 5.0).abs().max() < 0.15 and ab.mean(0).abs().max() < 0.15
    assert abs(torch.corrcoef(ab.T)[0, 1].item()) < 0.05  # a and b independent
    assert torch.equal(y, ab[:, :1] * x + ab[:, 1:])  # one (a, b) per prompt, noiseless
    # sigma only scales the same draws
    x1, _, ab1 = P.sample_linear(5, 7, generator=_g(2))
    x2, _, ab2 = P.sample_linear(5, 7, sigma_x=2.0, sigma=3.0, generator=_g(2))
    assert torch.equal(x2, 2 * x1) and torch.equal(ab2, 3 * ab1)


def test_every_labels_are_plus_one_iff_all_positive_so_far():
    x = torch.tensor([[1.0, 2.0, -1.0, 3.0], [-1.0, 2.0, 3.0, 4.0], [0.5, 0.1, 0.2, 0.3], [2.0, 0.0, 1.0, 1.0]])
    assert P.every_labels(x).tolist() == [[1, 1, -1, -1], [-1, -1, -1, -1], [1, 1, 1, 1], [1, -1, -1, -1]]
    x, y = P.sample_every(300, 9, sigma_x=4.0, generator=_g(3))
    assert x.shape == y.shape == (300, 9) and set(y.unique().tolist()) <= {-1.0, 1.0}
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert row_y == [1.0 if all(v > 0 for v in row_x[:j + 1]) else -1.0 for j in range(9)]
    assert abs(x.std().item() - 4.0) < 0.3


def test_training_batches_follow_seed_step_and_curriculum():
    cfg = P.PAPER
    x, y = P.training_batch(cfg, 1, 0)
    assert x.shape == (64, 11) and y.shape == (64, 11)
    assert torch.equal(x, P.training_batch(cfg, 1, 0)[0])  # a function of (seed, step): every attention, every resume
    assert not torch.equal(x, P.training_batch(cfg, 2, 0)[0]) and not torch.equal(x, P.training_batch(cfg, 1, 1)[0])
    assert P.training_batch(cfg, 1, 30000)[0].shape == (64, 41)
    xe, ye = P.training_batch(replace(cfg, task="every"), 1, 2000)
    assert xe.shape == (64, 13) and torch.equal(ye, P.every_labels(xe))


def test_curriculum_is_11_to_41_by_2_every_2000_steps():
    cfg = P.PAPER
    assert [P.curriculum_points(cfg, s) for s in (0, 1999, 2000, 3999, 4000, 29999, 30000, 500000)] == \
        [11, 11, 13, 13, 15, 39, 41, 41]
    # the authors' Curriculum: the count used at a step, then update() after it (step_count % interval)
    points, count = cfg.points_start, 0
    for step in range(40000):
        assert P.curriculum_points(cfg, step) == points, step
        count += 1
        if count % cfg.points_interval == 0:
            points += cfg.points_inc
        points = min(points, cfg.points_end)


# ----------------------------------------------------------------------------- tokens, loss, model
def test_token_layout_interleaves_x_and_y_in_one_channel():
    tok = P.to_tokens(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[10.0, 20.0, 30.0]]))
    assert tok.shape == (1, 6, 1) and tok[0, :, 0].tolist() == [1, 10, 2, 20, 3, 30]


def test_losses_cover_every_point():
    pred, y = torch.randn(4, 7, generator=_g(4)), torch.randn(4, 7, generator=_g(5))
    assert torch.allclose(P.task_loss(pred, y, "linear"), ((pred - y) ** 2).mean())
    labels = P.every_labels(torch.randn(4, 7, generator=_g(6)))
    authors = torch.nn.BCELoss()(torch.sigmoid(pred), (labels + 1) / 2)  # tasks.py: cross_entropy
    assert torch.allclose(P.task_loss(pred, labels, "every"), authors, atol=1e-6)
    with pytest.raises(ValueError, match="supported: linear, every"):
        P.task_loss(pred, y, "polynomial")


@pytest.fixture(scope="module")
def smoke_model(megatron_cpu):
    from nemo_ssa.megatron.cpu import cpu_device_shims

    with cpu_device_shims():
        torch.manual_seed(0)
        yield {name: P.PaperModel(P.CPU_SMOKE, name) for name in ("softmax", "ssa")}


def test_model_is_our_block_with_learned_positions(smoke_model):
    from nemo_ssa.megatron.core_attention import SoftmaxCoreAttention, SSAReferenceCoreAttention

    cfg = P.CPU_SMOKE
    for name, cls in (("softmax", SoftmaxCoreAttention), ("ssa", SSAReferenceCoreAttention)):  # ssa: the CPU kernel
        m = smoke_model[name]
        assert sum(type(x) is cls for x in m.modules()) == cfg.layers, name
        assert m.wpe.weight.shape == (2 * cfg.n_positions, cfg.hidden) and m.rope is None
        assert m.block.layers[0].mlp.linear_fc1.bias is not None  # GPT-2 has biases
    with pytest.raises(ValueError, match="positions"):
        m(torch.zeros(1, 2 * cfg.n_positions + 2, 1))


def test_prediction_of_y_j_is_read_at_x_j(smoke_model):
    """Point j's prediction sees x_1, y_1, ..., x_j and nothing later: what the loss trains."""
    from nemo_ssa.megatron.cpu import cpu_device_shims

    x, y = torch.randn(3, 6, generator=_g(7)), torch.randn(3, 6, generator=_g(8))
    with cpu_device_shims(), torch.no_grad():
        m = smoke_model["softmax"]
        p = m(P.to_tokens(x, y))
        assert p.shape == (3, 6)
        y2 = y.clone()
        y2[:, 2] += 5.0
        p2 = m(P.to_tokens(x, y2))
        torch.testing.assert_close(p2[:, :3], p[:, :3], rtol=0, atol=1e-6)  # y_2 unseen up to point 2
        assert (p2[:, 3:] - p[:, 3:]).abs().min() > 0
        x2 = x.clone()
        x2[:, 2] += 5.0
        p3 = m(P.to_tokens(x2, y))
        torch.testing.assert_close(p3[:, :2], p[:, :2], rtol=0, atol=1e-6)
        assert (p3[:, 2] - p[:, 2]).abs().min() > 0  # x_2 is seen where y_2 is predicted


# ----------------------------------------------------------------------------- evaluation grids
def test_linear_grid_cells_positions_and_draws():
    cfg = P.PAPER
    assert len(cfg.sigma_x) * len(cfg.sigma) == 100 and cfg.sigma_x == cfg.sigma == tuple(float(s) for s in range(1, 11))
    assert list(range(cfg.eval_from, cfg.eval_points)) == [3, 4, 5, 6, 7, 8]
    x1, y1 = P.linear_eval_prompts(cfg, 1, 1.0, 2.0)
    assert x1.shape == y1.shape == (100 * 64, 9)
    x3, y3 = P.linear_eval_prompts(cfg, 1, 3.0, 2.0)
    assert torch.equal(x3, 3 * x1)  # the same unit draws for every sigma_x
    ab = P.linear_eval_functions(cfg, 1, 2.0)
    assert torch.equal(y3.view(100, 64, 9), ab[:, :1, None] * x3.view(100, 64, 9) + ab[:, 1:, None])
    assert torch.equal(x1.view(100, 64, 9)[0], x1.view(100, 64, 9)[99])  # every function on the same 64 prompts
    assert not torch.equal(P.linear_eval_functions(cfg, 1, 1.0) * 2, ab)  # unit draws differ per sigma
    assert not torch.equal(P.linear_eval_prompts(cfg, 2, 1.0, 2.0)[0], x1)  # per seed
    xo, yo = P.linear_eval_prompts(cfg, 1, 3.0, 2.0, outlier=True)
    assert (xo[:, 5] == 20000.0).all() and torch.equal(xo[:, :5], x3[:, :5]) and torch.equal(xo[:, 6:], x3[:, 6:])
    assert torch.equal(yo.view(100, 64, 9), ab[:, :1, None] * xo.view(100, 64, 9) + ab[:, 1:, None])


def test_least_squares_floor_is_exact_from_two_points():
    cfg = replace(P.PAPER, sigma_x=(1.0, 10.0), sigma=(1.0, 10.0))
    for outlier in (False, True):
        x, y = P.linear_eval_prompts(cfg, 1, 10.0, 10.0, outlier=outlier)
        err = (P.least_squares_affine(x, y) - y.double()).abs()
        scale = y.abs().max().item()
        assert err[:, 2:].max() < 1e-6 * scale  # float32 y: rounding only
        assert err[:, 1].max() > 1e-2 * y[:, 1].abs().max()  # one point does not fix (a, b)
        assert torch.equal(P.least_squares_affine(x, y)[:, 0], torch.zeros(x.shape[0], dtype=torch.float64))
    grid = P.evaluate_linear(P.least_squares_affine, cfg, 1)
    assert len(grid) == 2 and len(grid[0]) == 2 and max(max(r) for r in grid) < 1e-6
    assert P.evaluate_linear(lambda x, y: torch.zeros_like(y), cfg, 1)[1][1] > 50  # predicting 0 is not free


def test_outlier_after_grid_scores_only_the_points_after_the_outlier():
    """A model that misses only the outlier's own y: the every-point outlier grid charges it
    (a·20000)² / 6, the after-outlier grid nothing; one that misses a point after it is charged."""
    cfg = replace(P.PAPER, sigma_x=(1.0, 3.0), sigma=(2.0,))
    pos = cfg.outlier_position

    def miss(at):
        def predict(x, y):
            p = y.clone()
            p[:, at] = 0.0
            return p
        return predict

    at_outlier = P.evaluate_linear(miss(pos), cfg, 1, outlier=True)
    assert min(v for row in at_outlier for v in row) > 1e6
    assert P.evaluate_linear(miss(pos), cfg, 1, outlier=True, after_outlier=True) == [[0.0], [0.0]]
    after = P.evaluate_linear(miss(pos + 1), cfg, 1, outlier=True, after_outlier=True)
    x, y = P.linear_eval_prompts(cfg, 1, 3.0, 2.0, outlier=True)
    expected = y.double()[:, pos + 1].pow(2).sum() / (y.shape[0] * (cfg.eval_points - pos - 1))
    assert after[1][0] == pytest.approx(float(expected), rel=1e-12) and after[1][0] > 0
    with pytest.raises(ValueError, match="needs outlier=True"):
        P.evaluate_linear(miss(pos), cfg, 1, after_outlier=True)


def test_every_grid_cells_and_draws():
    cfg = replace(P.PAPER, task="every")
    assert cfg.every_lengths == tuple(range(10, 201, 10)) and cfg.every_sigma == tuple(float(s) for s in range(1, 30))
    x10, y10 = P.every_eval_prompts(cfg, 1, 10, 1.0)
    x200, y200 = P.every_eval_prompts(cfg, 1, 200, 7.0)
    assert x10.shape == (64, 10) and x200.shape == (64, 200)
    assert torch.equal(x200[:, :10], 7 * x10) and torch.equal(y200[:, :10], y10)  # prefixes; labels across sigma
    perfect = P.evaluate_every(lambda x, y: y * 3.0, P.CPU_SMOKE, 1)
    assert perfect["prompt_error"] == [[0.0, 0.0], [0.0, 0.0]]
    wrong_late = P.evaluate_every(lambda x, y: torch.cat((y[:, :3], -y[:, 3:4], y[:, 4:]), 1), P.CPU_SMOKE, 1)
    assert wrong_late["prompt_error"][0] == [1.0, 1.0] and wrong_late["position_error"][0] == [0.2, 0.2]
    wrong_early = P.evaluate_every(lambda x, y: torch.cat((-y[:, :3], y[:, 3:]), 1), P.CPU_SMOKE, 1)
    assert wrong_early["prompt_error"] == [[0.0, 0.0], [0.0, 0.0]]  # points 0-2 are not scored


def test_unknown_and_unrunnable_attentions_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="known: .*softmax.*ssa_reference"):
        P.main(["--cpu-smoke", "--attentions", "softmax,sofmax", "--out", str(tmp_path)])
    from nemo_ssa.ops.common import target

    monkeypatch.setattr(target, "target", lambda device: target.Target("cpu"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        P.check_attentions(["ssa_triton"], cuda=False)
    assert P.check_attentions(["softmax", "ssa", "softmax"], cuda=False) == ["softmax", "ssa"]


# ----------------------------------------------------------------------------- the CLI
def _read_csv(path):
    with open(path) as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def linear_smoke(tmp_path_factory, megatron_cpu):
    out = tmp_path_factory.mktemp("icl_paper_linear")
    assert P.main(["--cpu-smoke", "--task", "linear", "--attentions", "softmax,ssa", "--seeds", "2", "--steps", "6",
                   "--out", str(out)]) == 0
    return out


def test_cli_smoke_writes_runs_summary_and_heatmaps(linear_smoke):
    out, cfg = linear_smoke, P.CPU_SMOKE
    runs = {n: json.loads((out / "runs" / f"linear-{n}.json").read_text())["result"]
            for n in ("softmax-s1", "ssa-s1", "softmax-s2", "ssa-s2")}
    for r in runs.values():
        ev = r["eval"]
        assert ev["positions"] == [3, 4, 5, 6, 7, 8] and r["loss_curve"][-1][0] == 6
        for kind in ("clean", "outlier"):
            assert len(ev[kind]["model"]) == len(cfg.sigma_x) and len(ev[kind]["model"][0]) == len(cfg.sigma)
            assert all(v == v for row in ev[kind]["model"] for v in row)
            assert max(max(row) for row in ev["clean"]["least_squares"]) < 1e-6
    # the same prompts for every attention of a seed (and other prompts for another seed)
    assert runs["softmax-s1"]["eval"]["outlier"]["least_squares"] == runs["ssa-s1"]["eval"]["outlier"]["least_squares"]
    assert runs["softmax-s1"]["eval"]["clean"]["least_squares"] != runs["softmax-s2"]["eval"]["clean"]["least_squares"]
    assert not list((out / "ckpt").iterdir())  # finished runs leave no checkpoint
    md = (out / "icl_paper.md").read_text()
    assert "| softmax | clean |" in md and "| ssa | outlier |" in md and "softmax − ssa, clean" in md
    assert "| ssa | outlier_after |" in md and "softmax − ssa, outlier_after" in md
    assert all(len(r["eval"]["outlier_after"]["model"]) == len(cfg.sigma_x) for r in runs.values())
    summary = json.loads((out / "icl_paper.json").read_text())
    assert len(summary["results"]) == 4 and summary["config"]["task"] == "linear"
    for name in ("linear-softmax-clean", "linear-ssa-outlier", "linear-softmax-minus-ssa-clean",
                 "linear-softmax-minus-ssa-clean-sd", "linear-ssa-minus-least-squares-clean", "linear-least-squares-clean"):
        rows = _read_csv(out / "heatmaps" / f"{name}.csv")
        assert len(rows) == 1 + len(cfg.sigma_x) and all(len(r) == 1 + len(cfg.sigma) for r in rows), name
        assert (out / "heatmaps" / f"{name}.png").stat().st_size > 0
        assert f"(heatmaps/{name}.csv)" in md
    diff = _read_csv(out / "heatmaps" / "linear-softmax-minus-ssa-clean.csv")
    mean = sum(runs[f"softmax-s{s}"]["eval"]["clean"]["model"][0][0] - runs[f"ssa-s{s}"]["eval"]["clean"]["model"][0][0]
               for s in (1, 2)) / 2
    assert float(diff[1][1]) == pytest.approx(mean, rel=1e-5, abs=1e-9)


def test_cli_reuses_finished_runs(linear_smoke, monkeypatch, capsys):
    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(P, "train_run", no_training)
    before = (linear_smoke / "runs" / "linear-ssa-s2.json").read_text()
    assert P.main(["--cpu-smoke", "--task", "linear", "--attentions", "softmax,ssa", "--seeds", "2", "--steps", "6",
                   "--out", str(linear_smoke)]) == 0
    assert capsys.readouterr().out.count(": reused ") == 4
    assert (linear_smoke / "runs" / "linear-ssa-s2.json").read_text() == before


def test_tf32_runs_from_a_gpu_are_summarised_on_a_cpu(linear_smoke, tmp_path, monkeypatch):
    """--summary-only trains nothing, so runs a GPU trained under --tf32 are summarised here under
    their own identity; fp32 runs in the same directory are not mixed in."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")

    def no_training(*a, **k):
        raise AssertionError("--summary-only trained a run")

    monkeypatch.setattr(P, "train_run", no_training)
    monkeypatch.setattr(P, "train_runs", no_training)
    (tmp_path / "runs").mkdir()
    tf32 = replace(P.CPU_SMOKE, task="linear", steps=6, tf32=True)
    for name in ("softmax-s1", "ssa-s1", "softmax-s2"):
        saved = json.loads((linear_smoke / "runs" / f"linear-{name}.json").read_text())
        if name != "softmax-s2":  # this one stays an fp32 run: not part of the TF32 summary
            saved["config"] = tf32.identity()
        if name == "ssa-s1":  # a run evaluated before the after-outlier grid: summarised without it
            del saved["result"]["eval"]["outlier_after"]
        (tmp_path / "runs" / f"linear-{name}.json").write_text(json.dumps(saved))
    args = ["--cpu-smoke", "--task", "linear", "--attentions", "softmax,ssa", "--seeds", "2", "--steps", "6",
            "--tf32", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="need CUDA"):
        P.main(args)
    assert P.main(args + ["--summary-only"]) == P.EXIT_UNFINISHED
    md = (tmp_path / "icl_paper.md").read_text()
    assert "TF32" in md and "Finished runs: 2 (softmax, ssa; seeds [1])" in md
    assert "| ssa | outlier |" in md and "| ssa | outlier_after |" not in md and "not in these runs" in md
    assert json.loads((tmp_path / "icl_paper.json").read_text())["config"]["tf32"] is True


def test_variants_parse_and_refuse_by_name():
    v = P.parse_variant("ssa_nb=ssa policy=free learnable_b=true attention.options.n_min=1.0")
    assert (v.label, v.attention, v.policy, dict(v.options)) == ("ssa_nb", "ssa", "free",
                                                                 {"learnable_b": True, "n_min": 1.0})
    assert P.parse_variant("ssa_n2=ssa policy=free n=2").options == (("n", 2.0),)
    for spec, want in [("ssa", "LABEL=ATTENTION"), ("a b=ssa", "LABEL=ATTENTION"),
                       ("softmax=ssa", "an attention's name"), ("x=nope", "unknown attention"),
                       ("x=ssa policy=free speed=3", "not KEY=VALUE"), ("x=ssa policy=free n=big", "not true/false"),
                       ("x=ssa learnable_b=true", "need policy=free")]:
        with pytest.raises(ValueError, match=want):
            P.parse_variant(spec)
    with pytest.raises(ValueError, match="takes no"):  # the spec would drop them with a warning
        P.parse_variant("x=softmax policy=free learnable_b=true")


def test_a_variant_trains_under_its_own_options_and_identity(tmp_path, megatron_cpu, monkeypatch):
    """The paper's "trainable b, n >= 1" beside the pinned ssa: b learns, n stays >= n_min, the
    run's identity carries the definition (another definition retrains), the summary names it."""
    spec = "ssa_nb=ssa policy=free learnable_b=true n_min=1.4"
    base = ["--cpu-smoke", "--task", "linear", "--seeds", "1", "--steps", "6", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="not in --attentions"):
        P.main(base + ["--attentions", "ssa", "--variant", spec])
    assert P.main(base + ["--attentions", "ssa,ssa_nb", "--variant", spec]) == 0
    plain = json.loads((tmp_path / "runs" / "linear-ssa-s1.json").read_text())
    nb = json.loads((tmp_path / "runs" / "linear-ssa_nb-s1.json").read_text())
    assert "variant" not in plain["config"]
    assert nb["config"]["variant"] == {"attention": "ssa", "policy": "free",
                                       "options": {"learnable_b": True, "n_min": 1.4}}
    sp, sn = plain["result"]["ssa_scalars"], nb["result"]["ssa_scalars"]
    assert len(sp["n"]) == len(sn["n"]) == P.CPU_SMOKE.layers
    assert all(b == pytest.approx(0.8) for b in sp["b"])  # pinned: b fixed
    assert any(abs(b - 0.8) > 1e-6 for b in sn["b"])      # learnable b moved
    assert min(sn["n"]) >= 1.4 - 1e-6
    md = (tmp_path / "icl_paper.md").read_text()
    assert "`ssa_nb` = `ssa` under policy=free, learnable_b=True n_min=1.4" in md
    assert "| ssa_nb | 1 |" in md and "softmax" not in md.split("Finished runs")[1].split("\n")[0]

    trained = []
    real = P.train_runs
    monkeypatch.setattr(P, "train_runs", lambda cfg, jobs, **k: trained.extend(jobs) or real(cfg, jobs, **k))
    monkeypatch.setattr(P, "train_run", lambda cfg, a, s, **k: trained.append((a, s)) or None)
    P.main(base + ["--attentions", "ssa,ssa_nb", "--variant", "ssa_nb=ssa policy=free learnable_b=true n_min=1.2"])
    assert trained == [("ssa_nb", 1)]  # the plain run is reused, the redefined variant is not


def test_cli_every_task(tmp_path, megatron_cpu):
    assert P.main(["--cpu-smoke", "--task", "every", "--attentions", "softmax", "--seeds", "1", "--steps", "4",
                   "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "runs" / "every-softmax-s1.json").read_text())["result"]
    cfg = P.CPU_SMOKE
    assert r["eval"]["lengths"] == list(cfg.every_lengths) and r["eval"]["sigma"] == list(cfg.every_sigma)
    assert len(r["eval"]["prompt_error"]) == len(cfg.every_lengths)
    assert all(0.0 <= v <= 1.0 for row in r["eval"]["prompt_error"] for v in row)
    assert r["eval"]["cross_probe"]["labels"] == [1.0, -1.0, -1.0, -1.0]
    assert len(_read_csv(tmp_path / "heatmaps" / "every-softmax.csv")) == 1 + len(cfg.every_lengths)
    assert "| softmax |" in (tmp_path / "icl_paper.md").read_text()


def test_resume_after_interruption_matches_an_uninterrupted_run_bitwise(tmp_path, megatron_cpu, monkeypatch):
    """On CPU the whole state is the weights, Adam's moments, the step and the loss window
    (batches are a function of (seed, step), no dropout), so a resumed run equals an
    uninterrupted one, bit for bit."""
    monkeypatch.setattr(P, "CURVE_POINTS", 4)  # windows of 2 steps: the stops at 3 and 6 split one
    common = ["--cpu-smoke", "--task", "linear", "--attentions", "softmax", "--seeds", "1", "--steps", "8"]
    assert P.main(common + ["--out", str(tmp_path / "whole")]) == 0
    split = tmp_path / "split"
    assert P.main(common + ["--stop-after-steps", "3", "--out", str(split)]) == P.EXIT_UNFINISHED
    ckpt = split / "ckpt" / "linear-softmax-s1.pt"
    assert ckpt.is_file() and torch.load(ckpt, weights_only=True)["step"] == 3
    assert not (split / "runs" / "linear-softmax-s1.json").exists()
    assert "Unfinished or missing: linear-softmax-s1" in (split / "icl_paper.md").read_text()
    assert P.main(common + ["--stop-after-steps", "3", "--out", str(split)]) == P.EXIT_UNFINISHED
    assert torch.load(ckpt, weights_only=True)["step"] == 6
    assert P.main(common + ["--out", str(split)]) == 0 and not ckpt.exists()
    whole, parts = (json.loads((d / "runs" / "linear-softmax-s1.json").read_text()) for d in (tmp_path / "whole", split))
    for r in (whole["result"], parts["result"]):
        r.pop("train_seconds"), r.pop("eval_seconds")
    assert whole == parts and [p[0] for p in whole["result"]["loss_curve"]] == [2, 4, 6, 8]


def test_a_checkpoint_of_another_configuration_is_not_resumed(tmp_path, megatron_cpu, capsys):
    common = ["--cpu-smoke", "--task", "linear", "--attentions", "softmax", "--seeds", "1", "--out", str(tmp_path)]
    assert P.main(common + ["--steps", "8", "--stop-after-steps", "2"]) == P.EXIT_UNFINISHED
    assert P.main(common + ["--steps", "9", "--stop-after-steps", "1"]) == P.EXIT_UNFINISHED
    assert "another configuration's checkpoint; starting afresh" in capsys.readouterr().out
    assert torch.load(tmp_path / "ckpt" / "linear-softmax-s1.pt", weights_only=True)["step"] == 1


# ----------------------------------------------------------------------------- speed options
def _results(out):
    runs = {}
    for path in sorted((out / "runs").glob("*.json")):
        r = json.loads(path.read_text())["result"]
        r.pop("train_seconds"), r.pop("eval_seconds")
        runs[path.name] = r
    return runs


def test_concurrent_runs_equal_one_at_a_time_bitwise_and_resume(linear_smoke, tmp_path, megatron_cpu):
    """--concurrent trains the runs of a call in turns in one process: each run is what it is
    alone, bit for bit, also when the call stops them and a later one resumes them."""
    common = ["--cpu-smoke", "--task", "linear", "--attentions", "softmax,ssa", "--seeds", "2", "--steps", "6",
              "--concurrent", "3", "--out", str(tmp_path)]
    assert P.main(common + ["--stop-after-steps", "4"]) == P.EXIT_UNFINISHED
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["linear-softmax-s1.pt", "linear-softmax-s2.pt", "linear-ssa-s1.pt", "linear-ssa-s2.pt"]
    assert torch.load(tmp_path / "ckpt" / "linear-ssa-s2.pt", weights_only=True)["step"] == 4
    assert P.main(common) == 0
    alone = _results(linear_smoke)
    assert len(alone) == 4 and _results(tmp_path) == alone
    assert not list((tmp_path / "ckpt").iterdir())


def _smoke_trainer(attention="softmax", seed=1, **kw):
    return P._Trainer(P.CPU_SMOKE, attention, seed, ckpt_path=None, dev=torch.device("cpu"), log=kw.pop("log", print), **kw)


def test_graph_steps_replay_the_eager_step_with_each_prompt_length(megatron_cpu, monkeypatch):
    """The CUDA-graph bookkeeping, driven on CPU with a stand-in graph that replays the eager
    step on the static buffer: GRAPH_WARMUP eager steps at each new prompt length, then one
    capture, then replays fed that step's batch; the weights and the loss curve come out as
    in the eager loop, bit for bit."""
    from nemo_ssa.megatron.cpu import cpu_device_shims

    cfg = P.CPU_SMOKE  # points 5, 7, 9: a new length every 5 steps
    steps = 14
    captures = []

    class StandIn:
        def __init__(self, tr):
            self.tr = tr

        def replay(self):
            self.tr._eager_step(self.tr.static_xy[0], self.tr.static_xy[1])

    def capture(tr, points):
        captures.append((tr.step, points))
        tr.graph, tr.static_xy = StandIn(tr), torch.full((2, cfg.batch, points), float("nan"))

    monkeypatch.setattr(P, "GRAPH_WARMUP", 2)
    monkeypatch.setattr(P._Trainer, "_capture", capture)
    with cpu_device_shims():
        eager, graphed = _smoke_trainer(), _smoke_trainer()
        graphed.graphs = True  # on a CPU only the stand-in can replay
        for _ in range(steps):
            eager.advance()
            graphed.advance()
        assert captures == [(2, 5), (7, 7), (12, 9)]  # after 2 eager steps at each length
        for (n, a), (_, b) in zip(eager.model.named_parameters(), graphed.model.named_parameters()):
            assert torch.equal(a, b), n
        eager._read_curve(), graphed._read_curve()
        assert graphed.curve == eager.curve and torch.equal(graphed.acc, eager.acc)


def test_a_failed_graph_capture_falls_back_to_the_eager_step(megatron_cpu):
    from nemo_ssa.megatron.cpu import cpu_device_shims

    logs = []
    with cpu_device_shims():
        eager, graphed = _smoke_trainer("ssa"), _smoke_trainer("ssa", log=logs.append)
        graphed.graphs = True  # capture fails on a CPU: the run must go on eagerly, unchanged
        for _ in range(P.GRAPH_WARMUP + 3):
            eager.advance()
            graphed.advance()
        assert not graphed.graphs and graphed.graph is None
        assert len(logs) == 1 and "CUDA graph capture failed" in logs[0]
        for (n, a), (_, b) in zip(eager.model.named_parameters(), graphed.model.named_parameters()):
            assert torch.equal(a, b), n


def test_cuda_only_options_are_refused_on_a_cpu_and_tf32_is_part_of_the_identity(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusals")
    for flag in ("--cuda-graphs", "--tf32"):
        with pytest.raises(ValueError, match="need CUDA"):
            P.main(["--cpu-smoke", "--attentions", "softmax", flag, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="concurrent"):
        P.main(["--cpu-smoke", "--attentions", "softmax", "--concurrent", "0", "--out", str(tmp_path)])
    assert "tf32" not in P.PAPER.identity()  # fp32 runs keep the identity they had before the option
    assert replace(P.PAPER, tf32=True).identity() == {**P.PAPER.identity(), "tf32": True}


def test_bench_times_steps_and_writes_nothing(tmp_path, megatron_cpu, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    try:
        assert P.main(["--cpu-smoke", "--attentions", "softmax,ssa", "--seeds", "1", "--bench-steps", "2",
                       "--bench-at", "0,10", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    lines = [m for m in capsys.readouterr().out.splitlines() if m.startswith("[icl_paper] bench")]
    assert len(lines) == 2 and "(5 points, graphs off)" in lines[0] and "(9 points, graphs off)" in lines[1]
    assert "steps/s per run" in lines[0] and "ms per run-step" in lines[0]
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="must fit"):
        P.bench(P.CPU_SMOKE, [("softmax", 1)], steps=10, at=[15])
    rows = P.bench(P.CPU_SMOKE, [("softmax", 1)], steps=3, at=[0])
    assert rows[0]["runs"] == 1 and rows[0]["steps"] == 3 and rows[0]["graphs"] == [False]
    assert rows[0]["steps_per_s_all"] > 0 and rows[0]["host_ms_per_step"] > 0


def test_least_squares_shares_pseudo_inverses_between_equal_prompts_bit_for_bit():
    """Computed once per distinct x, the floor equals the per-prompt pseudo-inverse exactly."""
    def per_prompt(x, y):
        x, y = x.double(), y.double()
        pred = torch.zeros_like(y)
        design = torch.stack((x, torch.ones_like(x)), dim=-1)
        for i in range(1, x.shape[1]):
            pred[:, i] = (design[:, i:i + 1] @ (torch.linalg.pinv(design[:, :i]) @ y[:, :i, None]))[:, 0, 0]
        return pred

    cfg = replace(P.PAPER, functions=7, eval_prompts=5)
    for outlier in (False, True):
        x, y = P.linear_eval_prompts(cfg, 2, 3.0, 4.0, outlier=outlier)  # 7 functions on the same 5 prompts
        assert torch.equal(P.least_squares_affine(x, y), per_prompt(x, y))
    x, y = torch.randn(40, 6, generator=_g(9)), torch.randn(40, 6, generator=_g(10))  # all distinct
    assert torch.equal(P.least_squares_affine(x, y), per_prompt(x, y))


def test_deterministic_is_its_own_configuration_and_turns_torchs_switch_on(tmp_path, megatron_cpu, monkeypatch):
    """--deterministic: torch's deterministic algorithms for the process (under which the fused
    attention backward takes its two-kernel schedule, not the single pass with fp32 atomics), a
    configuration of its own (a default-mode run is not reused for it), and each run's result
    says which kernels the process chose."""
    assert "deterministic" not in P.PAPER.identity()  # default runs keep the identity they had
    assert replace(P.PAPER, deterministic=True).identity() == {**P.PAPER.identity(), "deterministic": True}
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, **kw: calls.append((on, kw)))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    common = ["--cpu-smoke", "--task", "linear", "--attentions", "softmax", "--seeds", "1", "--steps", "2"]
    assert P.main(common + ["--out", str(tmp_path)]) == 0
    assert calls == []  # the default leaves torch's setting alone
    assert P.main(common + ["--deterministic", "--out", str(tmp_path)]) == 0
    assert calls == [(True, {"warn_only": True})] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    run = json.loads((tmp_path / "runs" / "linear-softmax-s1.json").read_text())
    assert run["config"]["deterministic"] is True  # retrained, not the default run reused
    assert isinstance(run["result"]["kernels"], list)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_deterministic_ssa_run_repeats_to_the_last_bit_on_cuda(tmp_path, megatron_cpu):
    """The bit-exact rerun --deterministic promises, on the kernel it changes: two fresh ssa runs
    (head dim 16, the Triton kernels' smallest) give the same loss curve and grid, and the process
    noted the two-kernel backward for them. Prompts of 60 points (120 tokens: four of the fp32
    single-pass backward's 32-key blocks) so the default's atomics would have >= 3 addends per
    dQ row: at <= 64 tokens two addends commute and even the default repeats (the retrained
    pinned runs left their twins exactly where prompts reached 66 tokens)."""
    from nemo_ssa.ops.common import dispatch

    cfg = replace(P.CPU_SMOKE, hidden=32, heads=2, steps=12, n_positions=64, points_start=60, points_end=60,
                  deterministic=True)
    curves = []
    try:
        for i in range(2):
            r = P.train_run(cfg, "ssa", 1, ckpt_path=str(tmp_path / f"run{i}.pt"))
            curves.append((r["loss_curve"], r["eval"]["clean"]["model"]))
    finally:
        torch.use_deterministic_algorithms(False)
    assert curves[0] == curves[1]
    bwd = [c for c in dispatch.chosen() if c["op"] == "attention.bwd"]
    assert bwd and all(c["path"] == dispatch.TWO_KERNEL for c in bwd), bwd
