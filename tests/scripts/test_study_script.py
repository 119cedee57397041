"""The study (``nemo_ssa.cli.study``, run by scripts/study.py) with a stand-in launcher (no training): every (attention, seed) run in
seed-major order with its own run directory, finished runs handed to pretrain's reuse,
unfinished ones resumed, progress and time left printed; the summary's table and verdicts
from the runs' metrics.csv (a planted difference is detected, an absent one is not)."""

from __future__ import annotations

import csv
import json
import math
import os
import random

import pytest

from nemo_ssa.cli import study


def _write_run(run_dir, seed, offset, steps=200, finished=True):
    os.makedirs(run_dir, exist_ok=True)
    rng = random.Random(seed * 7 + int(offset * 1000))
    band = random.Random(seed).gauss(0, 0.03)  # the seed's own data order: shared by both attentions
    with open(os.path.join(run_dir, "metrics.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "segment"])
        for s in range(1, steps + 1):
            w.writerow([s, f"{3 + 5 * math.exp(-s / 40) + band + (offset if s > 50 else 0) + rng.gauss(0, 0.005):.5f}", 1])
    if finished:
        with open(os.path.join(run_dir, "complete.json"), "w") as f:
            json.dump({"seed": seed}, f)


def _fake_launcher(out, offsets, calls):
    def launch(cmd):
        calls.append(cmd)
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        _write_run(args["run_dir"], int(args["seed"]), offsets[args["attention"]])
        return 0
    return launch


def test_runs_seed_major_with_reuse_and_resume_flags(tmp_path, capsys):
    out = str(tmp_path)
    _write_run(study.run_dir_of(out, "ssa", 1235), 1235, 0.1, finished=False)  # a run that died
    calls = []
    codes = study.train_all(out, ["softmax", "ssa"], [1234, 1235], ["train.max_steps=200"],
                            launch=_fake_launcher(out, {"softmax": 0.0, "ssa": 0.1}, calls))
    assert list(codes) == ["softmax-s1234", "ssa-s1234", "softmax-s1235", "ssa-s1235"] and not any(codes.values())
    for cmd in calls:
        assert "compare_to=[]" in cmd and "reuse_if_complete=true" in cmd and "train.max_steps=200" in cmd
    resumed = [c for c in calls if "resume=true" in c]
    assert len(resumed) == 1 and "attention=ssa" in resumed[0] and "seed=1235" in resumed[0]
    printed = capsys.readouterr().out
    assert "[study] run 4/4: ssa-s1235" in printed and "s left" in printed


def _write_heldout(run_dir, seed, offset):
    band = random.Random(seed).gauss(0, 0.03)
    with open(os.path.join(run_dir, "heldout.csv"), "w") as f:
        f.write("step,val_loss\n")
        for step in (100, 200):
            f.write(f"{step},{3.5 + band + offset + random.Random(seed + step).gauss(0, 0.004):.5f}\n")


@pytest.mark.parametrize("offset,detected", [(0.15, True), (0.0, False)])
def test_summary_verdict(tmp_path, offset, detected):
    out = str(tmp_path)
    seeds = [1, 2, 3]
    for s in seeds:
        _write_run(study.run_dir_of(out, "softmax", s), s, 0.0)
        _write_run(study.run_dir_of(out, "ssa", s), s, offset)
        _write_heldout(study.run_dir_of(out, "softmax", s), s, 0.0)
        _write_heldout(study.run_dir_of(out, "ssa", s), s, offset)
    text = study.summarize(out, ["softmax", "ssa"], seeds, plot=True)
    assert os.path.isfile(os.path.join(out, "study.png"))
    assert "## ssa vs softmax: training loss" in text and "## ssa vs softmax: held-out loss" in text
    last = [line for line in text.splitlines() if line.startswith("| 151-200 |")]
    held = [line for line in text.splitlines() if line.startswith("| 200-200 |")]
    assert len(last) == 1 and len(held) == 1
    assert ("softmax lower by" in last[0]) == detected, text
    assert ("softmax lower by" in held[0]) == detected, text
    assert "| ssa | 3 |" in text


def test_without_heldout_files_only_training_loss(tmp_path):
    out = str(tmp_path)
    for s in (1, 2):
        _write_run(study.run_dir_of(out, "softmax", s), s, 0.0)
        _write_run(study.run_dir_of(out, "ssa", s), s, 0.0)
    text = study.summarize(out, ["softmax", "ssa"], [1, 2], plot=False)
    assert ": training loss" in text and ": held-out loss" not in text


def test_needs_two_attentions(tmp_path):
    with pytest.raises(SystemExit, match="at least two"):
        study.main(["--attentions", "ssa", "--out", str(tmp_path), "--summarize-only"])


def test_cpu_studies_ask_for_the_heldout_loss_unless_given():
    assert study.with_cpu_heldout(["train.max_steps=8"], cuda=False) == [
        "train.max_steps=8", f"train.val_check_interval={study.CPU_HELDOUT_EVERY}"]
    assert study.with_cpu_heldout(["train.val_check_interval=3"], cuda=False) == ["train.val_check_interval=3"]
    assert study.with_cpu_heldout([], cuda=True) == []  # the GPU configs validate on their own


def test_n_per_layer_at_the_last_step_in_the_summary_and_plot(tmp_path):
    out = str(tmp_path)
    for s in (1, 2):
        _write_run(study.run_dir_of(out, "softmax", s), s, 0.0)
        d = study.run_dir_of(out, "ssa", s)
        _write_run(d, s, 0.0)
        rows = list(csv.reader(open(os.path.join(d, "metrics.csv"))))
        rows[0] += ["n_layer_01", "n_layer_02"]
        for i, r in enumerate(rows[1:], 1):
            r += [f"{1.5 + 0.001 * i:.4f}", f"{1.4 + 0.1 * s:.4f}"]  # layer 2's last n: 1.5 / 1.6
        with open(os.path.join(d, "metrics.csv"), "w", newline="") as f:
            csv.writer(f).writerows(rows)
    assert study.final_n(study.run_dir_of(out, "ssa", 1)) == {1: 1.7, 2: 1.5}
    assert study.final_n(study.run_dir_of(out, "softmax", 1)) == {}
    text = study.summarize(out, ["softmax", "ssa"], [1, 2], plot=True)
    assert "| attention | layer 1 | layer 2 |" in text
    assert "| ssa | 1.700 ± 0.000 | 1.550 ± 0.071 |" in text
    assert "| softmax |" not in text.split("n per layer")[1] and text.count("## n per layer at the last step") == 1
    # and over the schedule: each quarter's last step, mean over seeds (layer 1 rises, layer 2 is flat)
    over = text.split("## n per layer over the schedule")[1]
    assert "| ssa | 50 | 1.550 | 1.550 |" in over and "| ssa | 200 | 1.700 | 1.550 |" in over, over
    assert "| softmax |" not in over
    assert os.path.getsize(os.path.join(out, "study.png")) > 10_000


@pytest.mark.slow
def test_cpu_study_end_to_end_records_heldout_and_n(tmp_path):
    """Two attentions x two seeds through pretrain.py on CPU (tiny model, a few steps): every
    run writes heldout.csv, and the summary has both verdicts and n per layer."""
    out = str(tmp_path / "study")
    rc = study.main(["--attentions", "softmax,ssa", "--seeds", "2", "--out", out, "--",
                     "train.max_steps=4", "train.warmup_steps=1", "train.val_check_interval=2", "train.seq_length=32",
                     "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_every_n_steps=1",
                     "model.cpu_arch.hidden_size=32", "model.cpu_arch.ffn_hidden_size=64",
                     "data.vocab_size=512", f"data.dir={tmp_path / 'corpus'}", "data.max_bytes=400000"])
    assert rc == 0
    for a in ("softmax", "ssa"):
        for s in (1234, 1235):
            held = study.read_curve(study.run_dir_of(out, a, s), "heldout.csv", "val_loss")
            assert held is not None and held[0] == [2, 4], (a, s)
    text = open(os.path.join(out, "study.md")).read()
    assert ": training loss" in text and ": held-out loss" in text and "n per layer" in text


def test_parallel_runs_overlap_and_all_finish(tmp_path, capsys):
    import threading
    import time

    out = str(tmp_path)
    calls, live, peak, lock = [], [0], [0], threading.Lock()
    inner = _fake_launcher(out, {"softmax": 0.0, "ssa": 0.1}, calls)

    def launch(cmd):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.2)
        rc = inner(cmd)
        with lock:
            live[0] -= 1
        return rc

    codes = study.train_all(out, ["softmax", "ssa"], [1234, 1235, 1236], [], launch=launch, parallel=3)
    assert sorted(codes) == sorted(f"{a}-s{s}" for a in ("softmax", "ssa") for s in (1234, 1235, 1236))
    assert not any(codes.values()) and peak[0] == 3
    assert "6/6 done" in capsys.readouterr().out
    with pytest.raises(ValueError, match="parallel"):
        study.train_all(out, ["softmax", "ssa"], [1], [], launch=launch, parallel=0)


def _lr_launcher(best, calls, envs=None):
    """Trains nothing: writes a run whose held-out loss is lowest at the attention's ``best``
    rate (a quadratic in log2 of the rate), per seed."""
    def launch(cmd, env=None):
        calls.append(cmd)
        if envs is not None:
            envs.append((env or {}).get("CUDA_VISIBLE_DEVICES"))
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        lr, seed = float(args["train.lr"]), int(args["seed"])
        assert float(args["train.min_lr"]) == pytest.approx(lr / 10)
        _write_run(args["run_dir"], seed, 0.0)
        _write_heldout(args["run_dir"], seed, 0.2 * math.log2(lr / best[args["attention"]]) ** 2)
        return 0
    return launch


def test_lr_sweep_picks_each_attentions_rate_and_says_how_to_go_on(tmp_path):
    out, calls, envs = str(tmp_path), [], []
    lrs, seeds = [3e-4, 6e-4, 1.2e-3, 2.4e-3], [1, 2]
    best = {"softmax": 6e-4, "ssa": 1.2e-3}
    codes = study.train_all(out, ["softmax", "ssa"], seeds, ["train.max_steps=1000"], lrs=lrs, gpus=["0", "1"],
                            launch=_lr_launcher(best, calls, envs))
    assert len(codes) == 16 and not any(codes.values()) and "ssa-lr0.0012-s2" in codes
    assert sorted(set(envs)) == ["0", "1"]  # spread over both GPUs
    text, chosen = study.lr_sweep(out, ["softmax", "ssa"], seeds, lrs, ["train.max_steps=1000"])
    assert chosen == best
    assert "| ssa | 0.0012 | 2 |" in text and "held-out" in text
    assert "--lr softmax=0.0006,ssa=0.0012 -- train.max_steps=3000" in text
    assert os.path.isfile(os.path.join(out, "lr_sweep.md"))


@pytest.mark.parametrize("best_ssa", [3e-4, 1.2e-3, 2.4e-3])
def test_a_best_rate_on_the_grids_edge_is_marked(tmp_path, best_ssa):
    # the one-GPU sweep of 2026-11-28 chose 2.4e-3, its grid's largest rate, for both attentions:
    # a reader must be told the optimum may lie beyond, and which rates had fewer seeds
    out, lrs = str(tmp_path), [3e-4, 6e-4, 1.2e-3, 2.4e-3]
    best = {"softmax": 6e-4, "ssa": best_ssa}
    study.train_all(out, ["softmax", "ssa"], [1], [], lrs=lrs, launch=_lr_launcher(best, []))
    study.train_all(out, ["softmax", "ssa"], [2], [], lrs=[6e-4], launch=_lr_launcher(best, []))
    text, chosen = study.lr_sweep(out, ["softmax", "ssa"], [1, 2], lrs)
    assert chosen == best
    edge = {3e-4: "the grid's smallest** -- the optimum may lie beyond it; add 0.00015",
            2.4e-3: "the grid's largest** -- the optimum may lie beyond it; add 0.0048"}.get(best_ssa)
    assert ("ssa: its best rate" in text) == (edge is not None) and (edge is None or edge in text), text
    assert "softmax: its best rate" not in text  # 6e-4 is inside the grid
    assert "softmax: the rates were scored over different numbers of seeds (0.0003: 1, 0.0006: 2" in text
    # the training loss of the last quarter stands beside the held-out score (the launcher writes 0.0 offsets)
    row = next(line for line in text.splitlines() if line.startswith("| softmax | 0.0006 | 2 |"))
    assert row.count("|") == 7 and row.rstrip(" |").split("|")[-1].strip() != "-"


def test_each_attention_at_its_own_rate_is_summarised_from_its_runs(tmp_path):
    out, calls = str(tmp_path), []
    lr_of = study.parse_lr_of("softmax=6e-4,ssa=1.2e-3", ["softmax", "ssa"])
    study.train_all(out, ["softmax", "ssa"], [1, 2, 3], [], lr_of=lr_of, launch=_lr_launcher(lr_of, calls))
    assert {a for c in calls for a in c if a.startswith("seed=")} == {"seed=1", "seed=2", "seed=3"}
    assert all(("train.lr=0.0006" in c) == ("attention=softmax" in c) for c in calls)
    text = study.summarize(out, ["softmax", "ssa"], [1, 2, 3], plot=False, lr_of=lr_of)
    assert "rates softmax 0.0006, ssa 0.0012" in text and "| softmax | 3 |" in text and "| ssa | 3 |" in text
    with pytest.raises(SystemExit, match="the study's attentions"):
        study.parse_lr_of("softmax=6e-4", ["softmax", "ssa"])
    with pytest.raises(ValueError, match="not both"):
        study.train_all(out, ["softmax", "ssa"], [1], [], lrs=[1e-3], lr_of=lr_of, launch=_lr_launcher(lr_of, []))


def test_no_run_starts_after_the_launch_cutoff(tmp_path, capsys):
    out, calls = str(tmp_path), []
    codes = study.train_all(out, ["softmax", "ssa"], [1, 2], [], stop_launching_after=-1.0,
                            launch=_fake_launcher(out, {"softmax": 0.0, "ssa": 0.1}, calls))
    assert calls == [] and set(codes.values()) == {study.NOT_STARTED}
    assert "not started (--stop-launching-after" in capsys.readouterr().out


def test_cli_sweep_summary_and_refusals(tmp_path, capsys):
    out = str(tmp_path)
    best = {"softmax": 6e-4, "ssa": 1.2e-3}
    study.train_all(out, ["softmax", "ssa"], [1234], [], lrs=[6e-4, 1.2e-3], launch=_lr_launcher(best, []))
    assert study.main(["--summarize-only", "--seeds", "1", "--lrs", "6e-4,1.2e-3", "--out", out]) == 0
    assert "Best rate per attention: softmax 0.0006, ssa 0.0012" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not both"):
        study.main(["--summarize-only", "--lrs", "1e-3", "--lr", "softmax=1e-3,ssa=1e-3", "--out", out])


@pytest.mark.parametrize("passes", [None, 0.8, 4.2])
def test_reports_say_when_runs_read_their_data_more_than_once(tmp_path, passes):
    # the 1,000-step sweep of docs/results/2026-11-27-lr-sweep read the embedded corpus 4 times
    # and its ranking was one of over-fitting: the reports say so from each run's data.json
    out = str(tmp_path)
    for a, off in (("softmax", 0.0), ("ssa", 0.1)):
        for s in (1, 2):
            d = study.run_dir_of(out, a, s, None)
            _write_run(d, s, off)
            if passes is not None:
                with open(os.path.join(d, "data.json"), "w") as f:
                    json.dump({"prefix": "x", "corpus_tokens": 1000, "tokens_read": 4200, "passes": passes}, f)
    text = study.summarize(out, ["softmax", "ssa"], [1, 2], plot=False)
    assert ("read their training split up to 4.2 times" in text) == (passes == 4.2), text[:400]
    assert ("4 of 4 runs past one pass" in text) == (passes == 4.2)


def test_a_variant_trains_its_attention_with_its_overrides_under_its_own_label(tmp_path):
    """``--variant "ssa_nb=ssa policy=free ..."``: the ablation beside the pinned policy (issue
    44 item 3) is a study axis of its own -- its run directories and verdicts say ssa_nb, its
    launcher says attention=ssa with the variant's overrides after the study's."""
    variants = {}
    study.parse_variant("ssa_nb=ssa policy=free attention.options.learnable_b=true attention.options.n_min=1.0",
                        variants)
    assert variants == {"ssa_nb": ("ssa", ["policy=free", "attention.options.learnable_b=true",
                                           "attention.options.n_min=1.0"])}
    calls = []

    def launch(cmd):
        calls.append(cmd)
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        label = os.path.basename(args["run_dir"]).rsplit("-s", 1)[0]
        _write_run(args["run_dir"], int(args["seed"]), {"ssa": 0.0, "ssa_nb": 0.2}[label])
        return 0

    codes = study.train_all(str(tmp_path), ["ssa", "ssa_nb"], [1, 2], ["policy=pinned"], launch=launch,
                            variants=variants)
    assert list(codes) == ["ssa-s1", "ssa_nb-s1", "ssa-s2", "ssa_nb-s2"]
    nb = [c for c in calls if any(a.startswith("run_dir=") and "ssa_nb-s" in a for a in c)]
    assert len(nb) == 2 and all("attention=ssa" in c for c in calls)
    for c in nb:  # the variant's overrides come after the study's, so they win
        assert c.index("policy=free") > c.index("policy=pinned") and "attention.options.n_min=1.0" in c
    plain = [c for c in calls if c not in nb]
    assert all("policy=free" not in c for c in plain)
    text = study.summarize(str(tmp_path), ["ssa", "ssa_nb"], [1, 2], plot=False)
    assert "ssa_nb" in text


@pytest.mark.parametrize("spec,msg", [("nb ssa", "give"), ("ssa=softmax x=1", "an attention's name"),
                                      ("nb=nope x=1", "unknown attention"), ("nb=ssa policy", "key=value"),
                                      ("n/b=ssa", "give")])
def test_bad_variants_are_refused_by_name(spec, msg):
    with pytest.raises(SystemExit, match=msg):
        study.parse_variant(spec, {})
    with pytest.raises(SystemExit, match="not in --attentions"):
        study.main(["--summarize-only", "--variant", "nb=ssa policy=free", "--attentions", "softmax,ssa"])


@pytest.mark.parametrize("attentions, variant, want", [
    ("softmax,ssa", [], "model.cuda_graphs=none"),  # the unfused softmax has no graphs: none for all
    ("softmax_triton,ssa", [], None),  # both graph-capable: each run decides (auto)
    ("softmax_triton,nb", ["--variant", "nb=softmax policy=free"], "model.cuda_graphs=none"),  # a variant's attention
])
def test_on_cuda_the_study_gives_its_runs_graphs_all_or_none(monkeypatch, tmp_path, capsys, attentions, variant, want):
    import torch

    seen = {}

    def train_all(out, atts, seeds, overrides, **kw):
        seen["overrides"] = list(overrides)
        return {}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(study, "train_all", train_all)
    monkeypatch.setattr(study, "summarize", lambda *a, **k: "")
    study.main(["--attentions", attentions, *variant, "--seeds", "1", "--out", str(tmp_path), "--",
                "train.max_steps=10"])
    over = seen["overrides"]
    if want is None:
        assert not any(o.startswith("model.cuda_graphs") for o in over)
        assert "cuda_graphs" not in capsys.readouterr().out
    else:
        assert over[-1] == want and over[0] == "train.max_steps=10"
        assert "[study] model.cuda_graphs=auto -> none for every run" in capsys.readouterr().out
