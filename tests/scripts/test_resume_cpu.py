"""Checkpoints that survive a kill, and resumes of resumed runs.

- The README's launcher (``scripts/pretrain.py``, CPU loop, shrunk cpu_smoke) is SIGKILLed
  while it is saving the step-4 checkpoint (the fault hook ``NEMO_SSA_FAULT`` holds the
  process inside ``save_checkpoint`` after the shards are written and before the rename
  that completes them). ``resume=true`` must start from the newest *complete* checkpoint
  (step 2), redo steps 3-4 bit for bit and finish the run.
- A run stopped, resumed, stopped and resumed again (three launches into one run
  directory) gives exactly the uninterrupted run's curve and n.
- Negative controls: a ``.partial`` directory holding a whole checkpoint is never picked
  (the rename is what completes a checkpoint), while the same files under the final name
  are (so the check is not vacuous).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from nemo_ssa.data import build_corpus

    out = tmp_path_factory.mktemp("corpus")
    return build_corpus(str(out), source="stdlib", vocab_size=512, max_bytes=400_000, quiet=True)


def _cli(corpus, run_dir, *extra):
    return [sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), "attention=ssa", "compare_to=[]",
            f"run_dir={run_dir}", f"data.dir={os.path.dirname(corpus.prefix)}", "data.vocab_size=512",
            "data.max_bytes=400000", "train.max_steps=6", "train.log_every_n_steps=1",
            "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
            "train.ckpt_every_n_steps=2", "model.cpu_arch.hidden_size=32",
            "model.cpu_arch.ffn_hidden_size=64", *extra]


def _rows(run_dir):
    return [(int(r["step"]), r["loss"], r["segment"]) for r in csv.DictReader(open(os.path.join(run_dir, "metrics.csv")))]


def test_sigkill_during_checkpoint_save_resumes_from_newest_complete(tiny_corpus, tmp_path):
    from nemo_ssa.train.checkpoint_io import latest_checkpoint

    run_dir = tmp_path / "killed"
    ckpts = run_dir / "checkpoints"
    env = dict(os.environ, PYTHONUNBUFFERED="1", NEMO_SSA_FAULT="after_save:4:120")
    proc = subprocess.Popen(_cli(tiny_corpus, run_dir), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = []
    deadline = time.time() + 240
    try:
        for line in proc.stdout:  # wait until the process sits inside the step-4 save
            out.append(line)
            if "fault injection: sleeping" in line or time.time() > deadline:
                break
        assert any("fault injection: sleeping" in x for x in out), "".join(out)[-3000:]
        # the step-4 shards are on disk, but only in the .partial directory
        assert (ckpts / "step_0000004.partial" / "metadata.json").is_file()
        assert not (ckpts / "step_0000004").exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: dist_checkpointing's writers too
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert latest_checkpoint(str(ckpts)).endswith("step_0000002")
    killed = _rows(run_dir)
    assert [s for s, _, _ in killed] == [1, 2, 3, 4]  # steps 3-4 trained, their checkpoint lost

    res = subprocess.run(_cli(tiny_corpus, run_dir, "resume=true"), cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert "step_0000002 (global step 2" in text, text[-3000:]
    # the loop no longer calls the scheduler before the (wrapped) optimizer step (item 8)
    assert "lr_scheduler.step()" not in text
    rows = _rows(run_dir)
    assert [(s, seg) for s, _, seg in rows] == [(s, "1") for s in range(1, 5)] + [(s, "2") for s in range(3, 7)]
    # the lost steps are redone bit for bit (same data position, RNG, optimizer state)
    redo = {s: loss for s, loss, seg in rows if seg == "2"}
    assert [redo[s] for s in (3, 4)] == [loss for s, loss, _ in killed if s in (3, 4)]
    # the stale .partial was replaced by the complete step-4 checkpoint, and the run finished
    assert sorted(os.listdir(ckpts)) == ["step_0000002", "step_0000004", "step_0000006"]


def _recipe(corpus, run_dir, max_steps):
    from recipes import nemotron_114m
    from nemo_ssa.train.cpu_recipe import shrink_for_cpu

    recipe = nemotron_114m.pretrain_recipe(dir=str(run_dir), attention="ssa", data_prefix=corpus.prefix,
                                           tokenizer_dir=corpus.tokenizer_dir, max_steps=max_steps,
                                           warmup_steps=1, lr=2e-3, seed=1234)
    shrink_for_cpu(recipe, arch=dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                     num_query_groups=2), seq_length=32, micro_batch_size=2, global_batch_size=4)
    recipe.model.config.hidden_dropout = 0.1  # dropout on: the RNG must survive both resumes too
    recipe.model.config.attention_dropout = 0.0
    return recipe


def _train(corpus, run_dir, **kw):
    from nemo_ssa.train.loop import train_on_cpu

    return train_on_cpu(_recipe(corpus, run_dir, 6), str(run_dir), max_steps=6, quiet=True, **kw)


def test_second_generation_resume_continues_the_curve(tiny_corpus, tmp_path):
    """run (stopped after 2) -> resume (stopped after 4) -> resume again: the merged curve,
    the final n and the metrics segments equal the uninterrupted run's."""
    from nemo_ssa.tools.compare import load_run

    full = _train(tiny_corpus, tmp_path / "full")
    d = tmp_path / "gen"
    g0 = _train(tiny_corpus, d, stop_after=2)
    g1 = _train(tiny_corpus, d, stop_after=4, resume=True)
    g2 = _train(tiny_corpus, d, resume=True)
    assert (g0.steps, g1.steps, g2.steps) == (2, 4, 6)
    assert g0.losses + g1.losses + g2.losses == full.losses  # bitwise
    assert g2.ssa_n == full.ssa_n and all(v != 1.5 for v in full.ssa_n.values())
    rows = _rows(d)
    assert [(s, seg) for s, _, seg in rows] == [(1, "1"), (2, "1"), (3, "2"), (4, "2"), (5, "3"), (6, "3")]
    merged, ref = load_run("gen", [str(d)]), load_run("full", [str(tmp_path / "full")])
    assert merged.steps == ref.steps == list(range(1, 7)) and merged.loss == ref.loss and merged.n == ref.n
    assert len(merged.segments) == 3


# ------------------------------------------------------------------ damaged checkpoints
def _damage(ckpt, how):
    """Damage a complete checkpoint the ways disks and copies do (issue 46)."""
    shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
    if how == "truncated_shard":
        with open(os.path.join(ckpt, shards[0]), "r+b") as f:
            f.truncate(100)
        return shards[0]
    if how == "missing_shard":
        os.remove(os.path.join(ckpt, shards[-1]))
        return shards[-1]
    target = {"bad_metadata_json": "metadata.json", "bad_index": ".metadata", "bad_common": "common.pt"}[how]
    with open(os.path.join(ckpt, target), "wb") as f:
        f.write(b"\x00garbage")
    return target


DAMAGES = ["truncated_shard", "missing_shard", "bad_metadata_json", "bad_index", "bad_common"]


def test_checkpoint_problem_names_every_damage(tiny_corpus, tmp_path):
    import shutil

    from nemo_ssa.megatron.checkpoints import checkpoint_problem

    d = tmp_path / "run"
    _train(tiny_corpus, d, stop_after=2)
    good = str(d / "checkpoints" / "step_0000002")
    assert checkpoint_problem(good) is None
    for how in DAMAGES:
        bad = str(tmp_path / how)
        shutil.copytree(good, bad)
        what = _damage(bad, how)
        why = checkpoint_problem(bad)
        assert why is not None and what in why, (how, why)
        assert "\n" not in why


def test_resume_skips_a_damaged_newest_checkpoint_and_loses_only_its_steps(tiny_corpus, tmp_path):
    """One rank: checkpoints at 2 and 4, the step-4 one truncated; resume=true names it,
    loads step 2 and redoes steps 3-6 bit for bit (the uninterrupted run's curve)."""
    from nemo_ssa.train.loop import train_on_cpu

    full = _train(tiny_corpus, tmp_path / "full")
    d = tmp_path / "damaged"
    first = train_on_cpu(_recipe(tiny_corpus, d, 6), str(d), max_steps=6, quiet=True, ckpt_every=2, stop_after=4)
    assert sorted(os.listdir(d / "checkpoints")) == ["step_0000002", "step_0000004"]
    _damage(str(d / "checkpoints" / "step_0000004"), "truncated_shard")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        again = train_on_cpu(_recipe(tiny_corpus, d, 6), str(d), max_steps=6, ckpt_every=2, resume=True)
    log = buf.getvalue()
    assert "resume: skipped" in log and "step_0000004" in log and "truncated" in log, log[-2000:]
    assert "step_0000002 (global step 2" in log and "1 newer one(s) skipped" in log, log[-2000:]
    assert first.losses == full.losses[:4] and again.losses == full.losses[2:]
    assert again.ssa_n == full.ssa_n


def test_resume_on_two_ranks_skips_a_damaged_checkpoint(tiny_corpus, tmp_path, how="truncated_shard"):
    """Two gloo ranks (torchrun, the README launcher) with the distributed optimizer: the
    damaged newest checkpoint is skipped on every rank alike and the older one resumes."""
    d = tmp_path / "dp2"
    base = ["--standalone", "--nproc-per-node=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *base, *_cli(tiny_corpus, d)[1:],
           "train.num_gpus_per_node=2", "train.distributed_optimizer=true"]
    r = subprocess.run(cmd + ["stop_after=4"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ckpts = d / "checkpoints"
    assert {"step_0000002", "step_0000004"} <= set(os.listdir(ckpts))
    before = _rows(d)
    _damage(str(ckpts / "step_0000004"), how)
    r = subprocess.run(cmd + ["resume=true"], cwd=REPO, capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    assert "resume: skipped" in text and "step_0000004" in text and "step_0000002 (global step 2" in text, text[-3000:]
    rows = _rows(d)
    redo = {s: loss for s, loss, seg in rows if seg == "2"}
    assert sorted(redo) == [3, 4, 5, 6]
    assert [redo[s] for s in (3, 4)] == [loss for s, loss, _ in before if s in (3, 4)]


def test_nemo_resume_names_the_newest_loadable_checkpoint(tiny_corpus, tmp_path):
    """The GPU path: NeMo's AutoResume takes the newest ``-last`` checkpoint; when it is
    damaged the launcher passes the newest loadable one as ``resume_from_path`` and says what
    it skipped; an intact ``-last`` is left to NeMo (no explicit path)."""
    import shutil

    from nemo_ssa.cli import pretrain

    d = tmp_path / "run"
    _train(tiny_corpus, d, stop_after=2)
    good = d / "checkpoints" / "step_0000002"
    root = tmp_path / "nemo"
    for name in ("m--step=19-consumed_samples=80.0-last", "m--step=9-consumed_samples=40.0"):
        shutil.copytree(good, root / name / "weights")
        (root / name / "context").mkdir()
    last = root / "m--step=19-consumed_samples=80.0-last"
    assert pretrain.nemo_loadable_checkpoint(str(root)) == (str(last / "weights"), None, [])
    _damage(str(last / "weights"), "missing_shard")
    ckpt, explicit, skipped = pretrain.nemo_loadable_checkpoint(str(root))
    older = root / "m--step=9-consumed_samples=40.0"
    assert (ckpt, explicit) == (str(older / "weights"), str(older))
    assert [p for p, _ in skipped] == [str(last)] and "missing" in skipped[0][1]
    assert pretrain.nemo_loadable_checkpoint(str(tmp_path / "none")) == (None, None, [])
