"""scripts/device/step_ab.py with a stand-in launcher: trees alternate round by round, the table
is written after every run, a failed run is shown as failed and the exit code says so."""

from __future__ import annotations

import json
import os

import pytest

from nemo_ssa.testing.scripts import REPO, load_script


def _load():
    return load_script("scripts/device/step_ab.py")


def _tree(tmp_path, name):
    d = tmp_path / name
    (d / "scripts").mkdir(parents=True)
    (d / "scripts" / "pretrain.py").write_text("")
    return str(d)


def _recording_launcher(calls, rate_of):
    """A stand-in for step_ab.launch: records (run dir name, overrides), writes a summary with
    ``rate_of(run_dir)`` tokens/s."""
    def run(tree, overrides, run_dir, log, timeout):
        calls.append((os.path.basename(run_dir), list(overrides)))
        os.makedirs(run_dir)
        json.dump({"tokens_per_s_median": rate_of(run_dir), "loss": {"1": 10.0}},
                  open(os.path.join(run_dir, "summary.json"), "w"))
        return 0

    return run


def test_trees_alternate_and_the_table_compares_to_the_first(tmp_path):
    ab = _load()
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    calls = []
    speed = {a: 100_000.0, b: 125_000.0}

    def run(tree, overrides, run_dir, log, timeout):
        calls.append((os.path.basename(tree), list(overrides)))
        os.makedirs(run_dir)
        rate = speed[tree] * (1 + 0.01 * len(calls))
        json.dump({"tokens_per_s_median": rate, "peak_memory_gib": 3.8, "cuda_graphs_captured": True,
                   "loss": {"1": 10.65, "60": 5.5}}, open(os.path.join(run_dir, "summary.json"), "w"))
        # the table exists after the first run already
        return 0

    out = tmp_path / "out"
    rc = ab.main(["--tree", f"before={a}", "--tree", f"after={b}", "--rounds", "3", "--out", str(out), "--",
                  "attention=ssa", "train.max_steps=60"], run=run)
    assert rc == 0
    assert [c[0] for c in calls] == ["a", "b", "b", "a", "a", "b"]  # A B, B A, A B
    assert all(c[1] == ["attention=ssa", "train.max_steps=60"] for c in calls)
    md = (out / "ab.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| after |"))
    # medians over rounds (1 % drift per call): after 127,500 / 128,750 / 132,500, before 101,000 / 104,000 / 105,000
    assert "| 128,750 | 1.238x | 3.80 | True | 10.65 / 5.5 ;" in row
    # then every run in the order it ran, with its own rate
    order_rows = [ln.split(" | ") for ln in md.splitlines() if ln[:4] in {f"| {i} " for i in range(1, 7)}]
    assert [(r[1], r[2], r[4]) for r in order_rows] == [
        ("1", "before", "101,000"), ("1", "after", "127,500"), ("2", "after", "128,750"),
        ("2", "before", "104,000"), ("3", "before", "105,000"), ("3", "after", "132,500")]


def test_a_failed_run_is_shown_and_fails_the_command(tmp_path):
    ab = _load()
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")

    def run(tree, overrides, run_dir, log, timeout):
        if tree == b:
            return 1
        os.makedirs(run_dir)
        json.dump({"tokens_per_s_median": 1.0, "loss": {}}, open(os.path.join(run_dir, "summary.json"), "w"))
        return 0

    rc = ab.main(["--tree", f"x={a}", "--tree", f"y={b}", "--rounds", "1", "--out", str(tmp_path / "o")], run=run)
    assert rc == 1 and "| y | failed |" in (tmp_path / "o" / "ab.md").read_text()


def test_an_arm_adds_overrides_to_one_trees_runs(tmp_path):
    """An option A/B'd on one tree: the same directory twice, one label with extra overrides."""
    ab = _load()
    a = _tree(tmp_path, "a")
    calls = []
    run = _recording_launcher(calls, lambda run_dir: 1.0)

    out = tmp_path / "o"
    rc = ab.main(["--tree", f"off={a}", "--tree", f"on={a}", "--arm", "on=model.fused_layernorm=true x=1",
                  "--rounds", "2", "--out", str(out), "--", "attention=ssa"], run=run)
    assert rc == 0
    assert calls == [("off-r0", ["attention=ssa"]), ("on-r0", ["attention=ssa", "model.fused_layernorm=true", "x=1"]),
                     ("on-r1", ["attention=ssa", "model.fused_layernorm=true", "x=1"]), ("off-r1", ["attention=ssa"])]
    assert "- on also: `model.fused_layernorm=true x=1`" in (out / "ab.md").read_text()


@pytest.mark.parametrize("arm, says", [("nope=a=1", "one of the trees"), ("off", "LABEL="),
                                       ("on=run_dir=/x", "run_dir and compare_to")])
def test_a_bad_arm_says_what_is_expected(arm, says, tmp_path):
    a = _tree(tmp_path, "a")
    with pytest.raises(SystemExit, match=says):
        _load().main(["--tree", f"off={a}", "--tree", f"on={a}", "--arm", arm, "--out", str(tmp_path / "o")],
                     run=lambda *x: pytest.fail("nothing may run"))


@pytest.mark.parametrize("trees, overrides, says", [
    (["only=."], [], "two --tree"),
    (["a=/nonexistent", "b=."], [], "neither a directory holding scripts/pretrain.py nor a git ref"),
    (["a=no-such-ref-3f1c", "b=."], [], "neither a directory holding scripts/pretrain.py nor a git ref"),
    (["a", "b=."], [], "LABEL=REF or LABEL=DIR"),
    (["a=.", "b=."], ["run_dir=/x"], "run_dir and compare_to"),
])
def test_bad_arguments_say_what_is_expected(trees, overrides, says, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [a for t in trees for a in ("--tree", t)] + ["--out", str(tmp_path), "--", *overrides]
    with pytest.raises(SystemExit, match=says):
        _load().main(argv, run=lambda *a: pytest.fail("nothing may run"))


@pytest.mark.skipif(not os.path.isdir(os.path.join(REPO, ".git")), reason="needs the checkout's git history")
def test_a_git_ref_is_checked_out_beside_and_removed_after(tmp_path):
    seen = {}

    def run(tree, overrides, run_dir, log, timeout):
        seen.setdefault(tree, os.path.isfile(os.path.join(tree, "scripts", "pretrain.py")))
        return 1  # no summary: the table says failed

    rc = _load().main(["--tree", "head=HEAD", "--tree", f"here={REPO}", "--rounds", "1", "--out", str(tmp_path)],
                      run=run)
    assert rc == 1 and len(seen) == 2 and all(seen.values())
    ref_tree = next(t for t in seen if t != REPO)
    assert ref_tree != REPO and not os.path.exists(ref_tree)  # the worktree is gone afterwards


SHORT = ["train.max_steps=20", "train.val_check_interval=20", "train.warmup_steps=10"]


def test_warmup_runs_each_distinct_tree_and_arm_once_short_and_uncounted(tmp_path):
    """--warmup-steps: one short run per distinct tree and arm before round 1, with that arm's
    overrides (attention=softmax_triton against attention=ssa on one tree compile different
    kernels: a warm-up without the arm's overrides had compiled ssa's twice and softmax's in its
    first counted round), two labels with the same tree and overrides sharing one; its steps set
    last so they win, none of it in the per-tree table."""
    ab = _load()
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    calls = []
    run = _recording_launcher(calls, lambda run_dir: 1.0 if run_dir.endswith("-warmup") else 200_000.0)

    out = tmp_path / "out"
    rc = ab.main(["--tree", f"off={a}", "--tree", f"on={a}", "--tree", f"again={a}", "--tree", f"other={b}",
                  "--arm", "on=model.x=1", "--rounds", "1", "--warmup-steps", "20", "--out", str(out), "--",
                  "train.max_steps=60"], run=run)
    assert rc == 0
    assert [c[0] for c in calls] == ["off-warmup", "on-warmup", "other-warmup", "off-r0", "on-r0", "again-r0",
                                     "other-r0"]
    assert calls[0][1] == ["train.max_steps=60"] + SHORT
    assert calls[1][1] == ["train.max_steps=60", "model.x=1"] + SHORT
    md = (out / "ab.md").read_text()
    assert "| 1 | warm-up | off |" in md and "| 2 | warm-up | on |" in md and "not counted" in md
    assert "| off | 200,000 | 200,000 | 1.000x |" in md  # the warm-up's rate is in no median


def test_warmup_per_tree_warms_each_tree_once_with_its_first_arm(tmp_path):
    """--warmup-per tree: arms that change only what is logged share one warm-up, run with the
    first label's overrides."""
    a = _tree(tmp_path, "a")
    calls = []
    run = _recording_launcher(calls, lambda run_dir: 200_000.0)
    rc = _load().main(["--tree", f"keep={a}", "--tree", f"drop={a}", "--arm", "keep=p=keep", "--arm", "drop=p=drop",
                       "--rounds", "1", "--warmup-steps", "20", "--warmup-per", "tree", "--out", str(tmp_path / "o"),
                       "--", "train.max_steps=60"], run=run)
    assert rc == 0
    assert [c[0] for c in calls] == ["keep-warmup", "keep-r0", "drop-r0"]
    assert calls[0][1] == ["train.max_steps=60", "p=keep"] + SHORT


def test_a_failed_warmup_stops_before_the_rounds_and_shows_its_log(tmp_path, capsys):
    """A refused warm-up (it had passed 20 LR warm-up steps to a 10-step run) let every round run
    on and pay the compile; now the A/B stops there and prints why."""
    ab = _load()
    a = _tree(tmp_path, "a")
    calls = []

    def run(tree, overrides, run_dir, log, timeout):
        calls.append(os.path.basename(run_dir))
        with open(log, "w") as f:
            f.write("[pretrain] invalid configuration: something the warm-up set\n")
        return 1

    rc = ab.main(["--tree", f"off={a}", "--tree", f"on={a}", "--warmup-steps", "10", "--out", str(tmp_path / "o"),
                  "--", "train.max_steps=60"], run=run)
    assert rc == 1 and calls == ["off-warmup"]
    assert "invalid configuration: something the warm-up set" in capsys.readouterr().out


@pytest.mark.parametrize("train", ["gpu_9min", "ssa_authors_full", "cpu_smoke"])
@pytest.mark.parametrize("warm", [1, 10, 20])
def test_the_warmup_overrides_pass_the_launchers_check(train, warm, tmp_path):
    """The warm-up's short run is one the launcher accepts on every train config the presets use."""
    from hydra import compose, initialize_config_dir

    from nemo_ssa.cli import pretrain

    calls = []
    a = _tree(tmp_path, "a")
    _load().main(["--tree", f"off={a}", "--tree", f"on={a}", "--rounds", "0", "--warmup-steps", str(warm),
                  "--out", str(tmp_path / "o"), "--", "train.max_steps=60"], run=_recording_launcher(calls, lambda d: 1.0))
    with initialize_config_dir(config_dir=os.path.join(REPO, "nemo_ssa", "configs"), version_base=None):
        cfg = compose("config", overrides=[f"train={train}", "compare_to=[]"] + calls[0][1])
    pretrain._check_config(cfg, cuda=train != "cpu_smoke")  # SystemExit names what it refused
