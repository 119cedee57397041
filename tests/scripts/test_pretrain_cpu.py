"""The CPU training path end to end: the launcher's main job, warm-up RNG safety, resume.

Everything here trains the recipe's real model (shrunk) through megatron-core's DDP,
optimizer and dist_checkpointing on a tiny local corpus.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from nemo_ssa.data import build_corpus

    out = tmp_path_factory.mktemp("corpus")
    return build_corpus(str(out), source="stdlib", vocab_size=512, max_bytes=400_000, quiet=True)


def _recipe(corpus, attention="ssa", max_steps=6, dropout=0.0, run_dir="/tmp/unused", hidden=32,
            attention_options=None, policy="pinned", heldout=False):
    from recipes import nemotron_114m
    from nemo_ssa.train.cpu_recipe import shrink_for_cpu

    recipe = nemotron_114m.pretrain_recipe(
        dir=run_dir, attention=attention, attention_options=attention_options, policy=policy,
        data_prefix=corpus.prefix, tokenizer_dir=corpus.tokenizer_dir, max_steps=max_steps,
        warmup_steps=1, lr=2e-3, seed=1234,
    )
    shrink_for_cpu(recipe, arch=dict(num_layers=2, hidden_size=hidden, ffn_hidden_size=64,
                                     num_attention_heads=4, num_query_groups=2),
                   seq_length=32, micro_batch_size=2, global_batch_size=4, heldout=heldout)
    recipe.model.config.hidden_dropout = dropout
    recipe.model.config.attention_dropout = dropout
    return recipe


def _train(corpus, run_dir, **kw):
    from nemo_ssa.train.loop import train_on_cpu

    recipe_kw = {k: kw.pop(k) for k in ("attention", "dropout", "hidden", "attention_options", "policy", "heldout")
                 if k in kw}
    max_steps = kw.pop("max_steps", 6)
    recipe = _recipe(corpus, max_steps=max_steps, run_dir=str(run_dir), **recipe_kw)
    return train_on_cpu(recipe, str(run_dir), max_steps=max_steps, quiet=True, **kw)


def test_warmup_restores_every_rng(tiny_corpus, tmp_path):
    """Identical losses with and without warm-up; the same warm-up without the restore
    changes them (dropout draws from the RNG the warm-up consumed)."""
    base = _train(tiny_corpus, tmp_path / "a", dropout=0.2, warmup=False, max_steps=3)
    warm = _train(tiny_corpus, tmp_path / "b", dropout=0.2, warmup=True, max_steps=3)
    leak = _train(tiny_corpus, tmp_path / "c", dropout=0.2, warmup=True,
                  warmup_restores_rng=False, max_steps=3)
    assert base.losses == warm.losses
    assert base.losses != leak.losses


def test_resume_continues_the_same_curve_bitwise(tiny_corpus, tmp_path):
    """Crashed after step 4 with the checkpoint at 3: the resume re-does step 4, and the
    compare tool's merged curve equals the uninterrupted run's bit for bit."""
    from nemo_ssa.tools.compare import load_run

    full = _train(tiny_corpus, tmp_path / "full", max_steps=6)
    first = _train(tiny_corpus, tmp_path / "res", max_steps=6, stop_after=4, ckpt_every=3, save_at_end=False)
    assert first.steps == 4 and first.checkpoint.endswith("step_0000003")
    second = _train(tiny_corpus, tmp_path / "res", max_steps=6, resume=True)
    assert first.losses[:3] + second.losses == full.losses
    # n went through dist_checkpointing and kept learning from the restored value
    assert second.ssa_n == full.ssa_n
    assert all(v != 1.5 for v in full.ssa_n.values())
    rows = list(csv.DictReader(open(tmp_path / "res" / "metrics.csv")))
    assert [(int(r["step"]), r["segment"]) for r in rows] == [(s, "1") for s in range(1, 5)] + \
        [(s, "2") for s in range(4, 7)]
    merged, ref = load_run("res", [str(tmp_path / "res")]), load_run("full", [str(tmp_path / "full")])
    assert merged.steps == ref.steps == list(range(1, 7))
    assert merged.loss == ref.loss  # bitwise: floats compared exactly
    assert merged.n == ref.n
    assert len(merged.segments) == 2 and merged.overlaps == [(4, 4)]
    # the TensorBoard events tell the same story (one event file per launch)
    merged_tb = load_run("res", [str(tmp_path / "res")], source="tb")
    assert merged_tb.steps == ref.steps and len(merged_tb.segments) == 2
    assert merged_tb.loss == pytest.approx(ref.loss, rel=1e-6)  # TB stores float32


def test_heldout_loss_is_evaluated_without_changing_the_training_run(tiny_corpus, tmp_path):
    """heldout_every writes heldout.csv (step, val_loss) at every N steps and the last, on
    the validation split; evaluating leaves the training curve bit for bit as it was
    (eval mode, no gradients, RNG restored: dropout would show any draw it consumed)."""
    from nemo_ssa.tools.metrics_log import HELDOUT_CSV

    plain = _train(tiny_corpus, tmp_path / "plain", heldout=True, dropout=0.2, max_steps=5)
    held = _train(tiny_corpus, tmp_path / "held", heldout=True, dropout=0.2, max_steps=5, heldout_every=2)
    assert held.losses == plain.losses
    assert not (tmp_path / "plain" / HELDOUT_CSV).exists()
    rows = list(csv.DictReader(open(tmp_path / "held" / HELDOUT_CSV)))
    assert [int(r["step"]) for r in rows] == [2, 4, 5]
    vals = [float(r["val_loss"]) for r in rows]
    assert all(math.isfinite(v) and 0 < v < 10 for v in vals)
    assert vals[0] != vals[-1]  # evaluated on the model at that step, not once
    with pytest.raises(ValueError, match="no validation split"):
        _train(tiny_corpus, tmp_path / "nosplit", max_steps=2, heldout_every=1)


def test_softmax_and_ssa_differ_only_in_attention(tiny_corpus, tmp_path):
    soft = _train(tiny_corpus, tmp_path / "soft", attention="softmax", max_steps=2)
    ssa = _train(tiny_corpus, tmp_path / "ssa", attention="ssa", max_steps=2)
    assert soft.ssa_n == {} and sorted(ssa.ssa_n) == [1, 2]
    assert soft.extra["params"] + 2 == ssa.extra["params"]  # one n per layer
    # same init and data: the first losses are close but not identical
    assert soft.losses[0] != ssa.losses[0]
    assert abs(soft.losses[0] - ssa.losses[0]) < 0.5


def test_main_job_cli_trains_and_says_where_logs_are(tiny_corpus, tmp_path):
    """The README's main job command, shrunk: hydra launcher -> CPU path; loss goes down."""
    run_dir = tmp_path / "run"
    corpus_dir = os.path.dirname(tiny_corpus.prefix)
    cmd = [sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), "attention=ssa", "compare_to=[]",
           f"run_dir={run_dir}", f"data.dir={corpus_dir}", "data.vocab_size=512",
           "data.max_bytes=400000", "train.max_steps=12", "train.log_every_n_steps=4",
           "train.seq_length=32", "train.lr=3e-3", "train.ckpt_every_n_steps=null",
           "model.cpu_arch.hidden_size=32", "model.cpu_arch.ffn_hidden_size=64",
           "attention.options.n=2.0", "train.val_check_interval=50"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "path: megatron-core CPU loop" in out
    assert f"logs: {run_dir}" in proc.stdout.strip().splitlines()[-1]
    # the pinned policy reset the override and said so, and wrote what it did
    assert "Overriding n=2.0" in out
    policy = json.load(open(run_dir / "attention_policy.json"))
    assert policy["name"] == "ssa_reference" and policy["options"]["n"] == 1.5
    # the run's config record carries the model options, megatron's CUDA graphs off (the default)
    import yaml

    assert yaml.safe_load(open(run_dir / "config.yaml"))["model"]["cuda_graphs"] == "none"
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert len(rows) == 12
    losses = [float(r["loss"]) for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1
    assert {"n_layer_01", "n_layer_02"} <= set(rows[0])
    assert os.path.isdir(run_dir / "tb") and os.listdir(run_dir / "tb")
    # an interval beyond max_steps is one held-out evaluation at the end, said in one line
    assert "train.val_check_interval=50 is beyond train.max_steps=12" in out
    assert [r["step"] for r in csv.DictReader(open(run_dir / "heldout.csv"))] == ["12"]
    # what the run read of its data: 12 steps x global batch 8 (cpu_smoke) x 32 tokens, inside one pass
    data = json.load(open(run_dir / "data.json"))
    assert data["tokens_read"] == 12 * 8 * 32 and 0 < data["passes"] < 1 and "passes;" not in out


def test_cpu_loop_applies_weight_decay_multipliers(tiny_corpus, tmp_path):
    """megatron marks n/norms/biases with wd_mult=0; the loop must fold it into the groups
    (as NeMo does), or n would decay at the full rate."""
    res = _train(tiny_corpus, tmp_path / "wd", max_steps=1)
    no_wd = res.extra["no_weight_decay"]
    assert {f"decoder.layers.{i}.self_attention.core_attention.n" for i in (0, 1)} <= set(no_wd)
    assert not any(name.endswith("linear_qkv.weight") or name.endswith("linear_fc1.weight")
                   for name in no_wd)


NSA_TINY = dict(block_len=4, stride=2, select_block=8, top_n=4, window=8)  # seq 32: every branch matters


def test_nsa_ssa_trains_logs_and_resumes_n(tiny_corpus, tmp_path):
    """attention=nsa_ssa through the CPU loop like the SSA core attentions: one n per
    layer (at ...self_attention.n), learned, logged, exempt from weight decay, and carried
    through dist_checkpointing (the resumed curve and n equal the uninterrupted run's)."""
    kw = dict(attention="nsa_ssa", attention_options=NSA_TINY, policy="free", hidden=64)
    nsa = _train(tiny_corpus, tmp_path / "nsa", attention="nsa", attention_options=NSA_TINY, policy="free",
                 hidden=64, max_steps=1)
    full = _train(tiny_corpus, tmp_path / "full", max_steps=2, **kw)
    assert nsa.ssa_n == {} and sorted(full.ssa_n) == [1, 2]
    assert nsa.extra["params"] + 2 == full.extra["params"]  # one n per layer
    assert all(math.isfinite(v) and v != 1.5 for v in full.ssa_n.values())
    assert {f"decoder.layers.{i}.self_attention.n" for i in (0, 1)} <= set(full.extra["no_weight_decay"])
    rows = list(csv.DictReader(open(tmp_path / "full" / "metrics.csv")))
    assert {"n_layer_01", "n_layer_02"} <= set(rows[0])
    first = _train(tiny_corpus, tmp_path / "res", max_steps=2, stop_after=1, ckpt_every=1, save_at_end=False, **kw)
    second = _train(tiny_corpus, tmp_path / "res", max_steps=2, resume=True, **kw)
    assert first.losses + second.losses == full.losses and second.ssa_n == full.ssa_n


def _pretrain_module():
    from nemo_ssa.cli import pretrain

    return pretrain


def test_baseline_reuse_and_fresh_runs_set_the_old_one_aside(tmp_path):
    mod = _pretrain_module()
    cfg = {"attention": {"name": "softmax"}, "seed": 1, "train": {"max_steps": 5}, "resume": False,
           "compare_to": [], "reuse_if_complete": True}
    ident = mod._identity(cfg)
    # how a run was launched does not change what it computes; what it trains does
    assert mod._identity(dict(cfg, resume=True, compare_to=["x"], reuse_if_complete=False)) == ident
    assert mod._identity(dict(cfg, seed=2)) != ident
    # nor how its values reach the log (a run finished before the drop default is reused after)
    for pbv in ("keep", "drop"):
        assert mod._identity(dict(cfg, train={"max_steps": 5, "progress_bar_values": pbv})) == ident
    assert mod._identity(dict(cfg, train={"max_steps": 6})) != ident
    run = tmp_path / "softmax-s1"
    run.mkdir()
    assert not mod._finished(str(run), ident)
    (run / "complete.json").write_text(json.dumps({"identity": ident}))
    assert mod._finished(str(run), ident) and not mod._finished(str(run), mod._identity(dict(cfg, seed=2)))
    (run / "metrics.csv").write_text("step,loss\n1,2\n")
    (run / "checkpoints").mkdir()
    mod._set_aside_previous(str(run))
    prev = [p for p in os.listdir(run) if p.startswith("previous-")]
    assert len(prev) == 1 and sorted(os.listdir(run / prev[0])) == ["checkpoints", "complete.json", "metrics.csv"]
    assert not (run / "metrics.csv").exists()


def test_story_refuses_one_run_dir_for_several_runs(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), f"run_dir={tmp_path}/x"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "compare_to trains 2 runs (softmax, ssa); set runs_root" in proc.stderr + proc.stdout
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), "compare_to=[nope]"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "compare_to names attention 'nope'" in proc.stderr + proc.stdout


def test_checkpoint_of_the_reference_resumes_under_the_triton_kernel(tiny_corpus, tmp_path):
    """ssa_reference and ssa_triton share parameter names: a run checkpointed with one
    continues under the other (here the Triton kernel runs in the CPU interpreter) on the
    same curve as the uninterrupted reference run, up to kernel rounding."""
    full = _train(tiny_corpus, tmp_path / "full", attention="ssa_reference", max_steps=3, hidden=64)
    first = _train(tiny_corpus, tmp_path / "mix", attention="ssa_reference", max_steps=3, stop_after=2,
                   ckpt_every=2, hidden=64)
    assert first.checkpoint.endswith("step_0000002")
    second = _train(tiny_corpus, tmp_path / "mix", attention="ssa_triton", max_steps=3, resume=True,
                    warmup=False, hidden=64)
    assert second.steps == 3 and len(second.losses) == 1
    assert abs(second.losses[0] - full.losses[2]) < 1e-4, (second.losses, full.losses)
    for layer, value in full.ssa_n.items():
        assert abs(second.ssa_n[layer] - value) < 1e-5
    assert all(v != 1.5 for v in second.ssa_n.values())


def test_fused_cross_entropy_trains_the_same_curve(tiny_corpus, tmp_path, monkeypatch):
    """model.fused_cross_entropy=true on the CPU loop (eager chunked output layer + loss, the
    loss mask as its weight-gradient row weight) follows megatron's loss path step for step."""
    import nemo_ssa.ops.cross_entropy as ce
    from nemo_ssa.train.loop import train_on_cpu

    calls = []
    real = ce.linear_cross_entropy
    monkeypatch.setattr(ce, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    curves = {}
    for value in ("false", "true"):
        assert calls == []  # false: megatron's path
        recipe = _recipe(tiny_corpus, attention="softmax", max_steps=3, run_dir=str(tmp_path / value))
        recipe.model.config.forward_step_fn.fused_cross_entropy = value
        curves[value] = train_on_cpu(recipe, str(tmp_path / value), max_steps=3, quiet=True).losses
    assert len(curves["true"]) == 3 and len(calls) >= 3 * 2  # 3 steps x 2 micro-batches, fused
    for a, b in zip(curves["true"], curves["false"]):
        assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(b), curves
