"""scripts/device/gpu_session.py: timed steps, a killed step does not stop the next, one archive back;
presets write a results table (test, outcome, seconds) even when a step is killed."""

import os
import subprocess
import sys
import tarfile

import pytest

from nemo_ssa.testing.scripts import REPO, load_script


def _load_session():
    return load_script("scripts/device/gpu_session.py")


def test_steps_time_limits_and_packing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "device", "gpu_session.py"), "--out", str(out), "--budget", "30",
         "--no-bundle", "ok:10:echo hello; echo table > {out}/t.md", "slow:1:sleep 20", "bad:10:exit 3"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    table = proc.stdout.strip().splitlines()[-3:]
    assert table == ["| ok | 0 | 0 |", "| slow | killed at 1 s | 1 |", "| bad | 3 | 0 |"]
    assert os.listdir(out) == ["session.tgz"]  # only the archive goes back
    with tarfile.open(out / "session.tgz") as tar:
        names = sorted(tar.getnames())
        assert names == ["bad.log", "ok.log", "slow.log", "t.md"]
        assert b"hello" in tar.extractfile("ok.log").read()


def test_free_form_steps_install_the_bundle_too(tmp_path, monkeypatch):
    """A free-form step that imports the stack or fla needs the bundle as a preset does (one
    session's A/B timed fla as 'not installed' because only presets installed it)."""
    gs = _load_session()
    calls = []
    monkeypatch.setattr(gs, "install_bundle", lambda out: calls.append(out) or "installed 0 wheels (test)")
    gs.main(["--out", str(tmp_path / "o"), "--budget", "20", "ok:10:echo hi"])
    assert calls == [str(tmp_path / "o")]
    gs.main(["--out", str(tmp_path / "p"), "--budget", "20", "--no-bundle", "ok:10:echo hi"])
    assert len(calls) == 1


def test_presets_fit_the_device_limits():
    """Every preset: at most 9 minutes per command; quick within 4; full-1 + full-2 cover
    every GPU test file and every op test that runs on CUDA."""
    gs = _load_session()
    assert set(gs.PRESETS) == {"quick", "full-1", "full-2", "graphs", "graphs-default", "step-graphs", "syncs",
                               "layernorm-mb8", "layernorm-parity", "graphs-full", "graphs-full-parity", "graphs-full-mb32", "icl-dreg",
                               "icl-outlier-a", "icl-outlier-b", "graphs-full-resume", "icl-deterministic",
                               "full-mb8-profile", "param-copy-ab", "host-samples", "pbar-ab",
                               "pbar-parity", "pbar-ab-mb32", "attn-pair-mb32", "attn-pair-mb8",
                               "attn-sdpa-mb32", "metrics-defer-ab", "metrics-defer-mb32"}
    for name, p in gs.PRESETS.items():
        assert p["budget"] <= 540 and sum(s[2] for s in p["steps"]) <= p["budget"], name
    assert gs.PRESETS["quick"]["budget"] <= 240
    full = {f for n in ("full-1", "full-2") for s in gs.PRESETS[n]["steps"] if s[0] == "pytest" for f in s[3]}
    gpu_files = {os.path.relpath(p, REPO) for p in __import__("glob").glob(os.path.join(REPO, "tests/ops/*_gpu.py"))}
    assert gpu_files <= full, gpu_files - full
    assert {"tests/ops/attention/test_flash.py", "tests/ops/elsa/test_elsa.py", "tests/ops/nsa/test_nsa.py",
            "tests/ops/test_fused_attention_range.py"} <= full


def test_graphs_preset_runs_what_exists():
    """The graphs preset's commands name scripts, flags and config keys that exist (a renamed
    flag would burn a device call), and run both settings of every comparison."""
    import re

    gs = _load_session()
    cmds = [s[3] for s in gs.PRESETS["graphs"]["steps"] if s[0] == "cmd"]
    for cmd in cmds:
        script = cmd.split()[1]
        src = open(os.path.join(REPO, script)).read()
        for flag in re.findall(r" (--[a-z-]+)", cmd):
            assert f'"{flag}"' in src, (script, flag)
    cfg = open(os.path.join(REPO, "nemo_ssa/configs/model/nemotron_114m.yaml")).read()
    assert re.search(r"^cuda_graphs: auto", cfg, re.M)
    for what in ("train_megatron_core.py", "pretrain.py"):
        runs = [c for c in cmds if what in c]
        assert len(runs) == 2 and sum("local" in c for c in runs) == 1, what
    assert any("--cuda-graph none,local" in c for c in cmds)


@pytest.mark.parametrize("preset", ["step-graphs", "graphs-default", "syncs"])
def test_graph_presets_name_flags_and_keys_that_exist(preset):
    """Every script flag and launcher key in the preset's commands exists (a rename would burn a
    device call)."""
    import re

    gs = _load_session()
    conf = os.path.join(REPO, "nemo_ssa", "configs")
    cfg_text = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(conf) for f in files
                       if f.endswith(".yaml"))
    for step in (s for s in gs.PRESETS[preset]["steps"] if s[0] == "cmd"):
        for part in step[3].split("&&"):
            words = part.split()
            script = words[2].replace(".", "/") + ".py" if words[1] == "-m" else words[1]
            src = open(os.path.join(REPO, script)).read()
            for flag in re.findall(r" (--[a-z-]+)", part):
                assert f'"{flag}"' in src, (script, flag)
            groups = {d for d in os.listdir(conf) if os.path.isdir(os.path.join(conf, d))}  # attention=, train=
            for key in re.findall(r" (?:[a-z_]+\.)?([a-z_]+)=", part):
                assert key in groups or re.search(rf"^\s*{key}:", cfg_text, re.M), (preset, key)


@pytest.mark.parametrize("preset", ["layernorm-mb8", "layernorm-parity", "graphs-full", "pbar-ab", "pbar-parity",
                                    "pbar-ab-mb32", "attn-pair-mb32", "attn-pair-mb8", "attn-sdpa-mb32"])
def test_ab_presets_name_trees_flags_and_keys_that_exist(preset):
    """An A/B preset (scripts/device/step_ab.py): its flags exist, --arm and the compare tool
    name its trees, every launcher override after ``--`` is a config key, and the option under
    test differs between trees (set on one only, or set on each to its own value)."""
    gs = _load_session()
    conf = os.path.join(REPO, "nemo_ssa", "configs")
    cfg_text = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(conf) for f in files
                       if f.endswith(".yaml"))
    groups = {d for d in os.listdir(conf) if os.path.isdir(os.path.join(conf, d))}
    for cmd in [s[3] for s in gs.PRESETS[preset]["steps"] if s[0] == "cmd"]:
        _check_ab_command(cmd, src_groups=(groups, cfg_text), preset=preset)


def _check_ab_command(cmd, src_groups, preset):
    import re

    groups, cfg_text = src_groups
    ab, _, rest = cmd.partition(" -- ")
    src = open(os.path.join(REPO, "scripts/device/step_ab.py")).read()
    for flag in re.findall(r" (--[a-z-]+)", ab):
        assert f'"{flag}"' in src, flag
    trees = re.findall(r"--tree ([a-z_]+)=\.", ab)
    arms = dict(re.findall(r"--arm ([a-z_]+)=(\S+)", ab))
    assert len(trees) >= 2 and arms and set(arms) <= set(trees), (trees, arms)
    assert len({arms.get(t, "") for t in trees}) >= 2, "every tree runs the same options"
    launcher, _, compare = rest.partition("&&")
    for key in re.findall(r"(?:^| )(?:[a-z_]+\.)?([a-z_]+)=", launcher + " " + " ".join(arms.values())):
        assert key in groups or re.search(rf"^\s*{key}:", cfg_text, re.M), (preset, key)
    if compare:
        assert sorted(re.findall(r" ([a-z_]+)=\{out\}", compare)) == sorted(trees)


@pytest.mark.parametrize("preset", ["param-copy-ab", "metrics-defer-ab", "metrics-defer-mb32"])
def test_a_parent_tree_preset_says_how_its_tree_is_built_and_carried(preset):
    """A preset that A/Bs this checkout against a parent tree under dev/ (the device copy has no
    git history): the tree is the checkout against a dev/<commit> the preset's text says how to
    build and carry, a commit of this history, and the job's overrides are config keys."""
    import re
    import subprocess

    gs = _load_session()
    p = gs.PRESETS[preset]
    for cmd in [s[3] for s in p["steps"] if s[0] == "cmd"]:
        ab, _, rest = cmd.partition(" -- ")
        trees = dict(re.findall(r"--tree ([a-z_]+)=(\S+)", ab))
        parents = {t for t in trees.values() if t.startswith("dev/")}
        assert len(trees) == 2 and "." in trees.values() and len(parents) == 1, trees
        sha = parents.pop()[len("dev/"):]
        assert f"git archive {sha} " in p["about"] and f'"dev/{sha}"' in p["about"], (preset, sha)
        if os.path.isdir(os.path.join(REPO, ".git")):
            subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{sha}^{{commit}}"], check=True)
        src = open(os.path.join(REPO, "scripts/device/step_ab.py")).read()
        assert all(f'"{flag}"' in src for flag in re.findall(r" (--[a-z-]+)", ab))
        conf = os.path.join(REPO, "nemo_ssa", "configs")
        cfg_text = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(conf) for f in files
                           if f.endswith(".yaml"))
        groups = {d for d in os.listdir(conf) if os.path.isdir(os.path.join(conf, d))}
        for key in re.findall(r"(?:^| )(?:[a-z_]+\.)?([a-z_]+)=", rest):
            assert key in groups or re.search(rf"^\s*{key}:", cfg_text, re.M), (preset, key)


def test_memory_heavy_cases_run_alone():
    """full-2 runs every NSA GPU case exactly once: the gpu_big ones in a one-worker step
    (beside three xdist workers one ran out of memory on an H100), the rest in parallel."""
    gs = _load_session()
    steps = [s for s in gs.PRESETS["full-2"]["steps"] if s[0] == "pytest"]
    markers = {s[4]: s for s in steps}
    assert set(markers) == {"not gpu_big", "gpu_big"}
    big = markers["gpu_big"]
    assert len(big) > 6 and big[6] == 1
    cmd = gs.pytest_command(big[3], big[4], big[5], big[6], "/tmp/x.jsonl")
    assert " -n " not in cmd and "-m gpu_big" in cmd
    cmd = gs.pytest_command(["a.py"], "not gpu_big", 100, 4, "/tmp/x.jsonl")
    assert "-m 'not gpu_big'" in cmd
    src = open(os.path.join(REPO, "tests/ops/nsa/test_nsa_gpu.py")).read()
    assert "BIG = pytest.mark.gpu_big" in src


def test_preset_writes_results_even_when_killed(tmp_path, monkeypatch):
    """A preset step killed at its limit still leaves a results file: finished tests with
    outcome and seconds, the rest 'not run'. Runs a tiny pytest file through the machinery."""
    gs = _load_session()
    tests = tmp_path / "test_tiny.py"
    tests.write_text("import time\n"
                     "def test_a(): pass\n"
                     "def test_b(): assert 1 == 2, 'boom'\n"
                     "def test_c(): time.sleep(600)\n"
                     "def test_d(): pass\n")
    (tmp_path / "conftest.py").write_text(open(os.path.join(REPO, "tests", "conftest.py")).read())
    # the inner pytest inherits the environment: an order override (the suite run
    # reversed, NEMO_SSA_TEST_ORDER) would reverse the tiny file too
    monkeypatch.delenv("NEMO_SSA_TEST_ORDER", raising=False)
    # the step's limit covers the inner pytest's start-up (torch's import through the copied
    # conftest) with room for a 2-core machine that another xdist worker keeps busy
    monkeypatch.setitem(gs.PRESETS, "quick", dict(about="tiny", expect=5, budget=80,
                                                  steps=[("pytest", "tests-quick", 40, [str(tests)], None, 0)]))
    out = tmp_path / "out"
    rc = gs.main(["--preset", "quick", "--out", str(out), "--no-bundle", "--workers", "1", "--commit", "abc123"])
    assert rc == 1
    assert sorted(os.listdir(out)) == ["gpu-tests-quick.md", "session.tgz"]
    md = (out / "gpu-tests-quick.md").read_text()
    assert "commit: `abc123`" in md and "killed at 40 s" in md
    rows = {ln.split("|")[1].strip().strip("`").split("::")[-1]: ln.split("|")[2].strip()
            for ln in md.splitlines() if ln.startswith("| `")}
    assert rows == {"test_a": "passed", "test_b": "failed", "test_c": "not run (time limit)",
                    "test_d": "not run (time limit)"}, rows
    assert "boom" in md  # the failure's first line


def test_pytest_command_uses_xdist_and_timeout_only_when_installed(monkeypatch):
    gs = _load_session()
    monkeypatch.setattr(gs, "_have", lambda m: False)
    cmd = gs.pytest_command(["a.py"], "gpu_quick", 100, 4, "/tmp/x.jsonl")
    assert "-n" not in cmd.split() and "--timeout" not in cmd and "-m gpu_quick" in cmd
    assert cmd.startswith("NEMO_SSA_TEST_LOG=/tmp/x.jsonl ") and "--durations=25" in cmd
    monkeypatch.setattr(gs, "_have", lambda m: True)
    cmd = gs.pytest_command(["a.py"], None, 100, 4, "/tmp/x.jsonl")
    assert "-n 4 --dist loadgroup" in cmd and "--timeout 100" in cmd


def test_model_grad_parity_needs_cuda():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checks.model_grad_parity", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr


def test_a_packed_bundle_is_installed_where_there_is_no_whl_dir(tmp_path, monkeypatch):
    """.bundle/bundle.tar.xz (scripts/device/pack_bundle.py: what fits a call's carry) installs
    the wheels it holds, as .whl/ would."""
    import zipfile

    sys.path.insert(0, os.path.join(REPO, "scripts", "device"))
    import pack_bundle

    gs = _load_session()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a-1.0-py3-none-any.whl", "b-2.0-py3-none-any.whl"):
        with zipfile.ZipFile(src / name, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("x.py", "print(1)\n" * 50)
    repo = tmp_path / "repo"
    pack_bundle.pack(str(src), str(repo / ".bundle" / "bundle.tar.xz"))
    monkeypatch.setattr(gs, "REPO", str(repo))
    monkeypatch.setenv("PYTHONPATH", "")
    seen = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def fake_run(cmd, **kw):
        seen.append([os.path.basename(c) for c in cmd if c.endswith(".whl")])
        return Done()

    monkeypatch.setattr(gs.subprocess, "run", fake_run)
    (tmp_path / "out").mkdir()
    msg = gs.install_bundle(str(tmp_path / "out"))
    assert msg.startswith("installed 2 wheels"), msg
    assert seen == [["a-1.0-py3-none-any.whl", "b-2.0-py3-none-any.whl"]]
    os.rename(repo / ".bundle", repo / "gone")
    assert gs.install_bundle(str(tmp_path / "out")).startswith("no .whl/ or .bundle/ bundle")


def test_the_archive_leaves_out_checkpoints_and_large_files(tmp_path, monkeypatch):
    """A preset's NeMo runs write checkpoints under ``--out``: packing two of them (4 GB) took a
    call's last 230 s and the archive was too large to come back."""
    gs = _load_session()
    monkeypatch.setattr(gs, "PACK_MAX_FILE", 1000)
    run = tmp_path / "run"
    (run / "checkpoints" / "step=10").mkdir(parents=True)
    (run / "checkpoints" / "step=10" / "w.distcp").write_bytes(b"x" * 10)
    (run / "metrics.csv").write_text("step,loss\n1,2.0\n")
    (tmp_path / "big.bin").write_bytes(b"x" * 2000)
    (tmp_path / "a.log").write_text("hello\n")
    gs.pack(str(tmp_path))
    with tarfile.open(tmp_path / "session.tgz") as tar:
        names = set(tar.getnames())
        left = tar.extractfile("left-out.txt").read().decode()
    assert {"a.log", "run", "run/metrics.csv", "left-out.txt"} == names
    assert "run/checkpoints (a checkpoint folder)" in left and "big.bin (2,000 bytes)" in left


def test_the_session_stops_before_any_step_when_the_stack_does_not_import(tmp_path, monkeypatch, capsys):
    """A call whose carry lacked the bundle ran every step into ``No module named 'megatron'``
    and reported the last one as passing (2026-12-02): now nothing runs and the exit says why."""
    gs = _load_session()
    monkeypatch.setattr(gs, "REPO", str(tmp_path))  # no .whl/, no .bundle/
    monkeypatch.setattr(gs, "STACK_MODULES", ("nemo_ssa_no_such_module",))
    marker = tmp_path / "ran"
    rc = gs.main(["--out", str(tmp_path / "o"), f"step:10:touch {marker}"])
    assert rc == 2 and not marker.exists()
    assert "nemo_ssa_no_such_module does not import" in capsys.readouterr().out
    monkeypatch.setattr(gs, "STACK_MODULES", ("json",))
    assert gs.main(["--out", str(tmp_path / "o2"), f"step:10:touch {marker}"]) == 0 and marker.exists()


def test_the_icl_outlier_presets_retrain_each_pinned_run_once():
    """The two halves together: softmax and ssa at seeds 1-3 on the linear task, each once, in
    the pinned runs' configuration (2026-11-28-icl-paper: TF32, graphs, 50,000 steps), and the
    step fails unless every run's JSON was written (a budget-stopped call must not read as done)."""
    import re

    gs = _load_session()
    seen, done = [], set()
    for name in ("icl-outlier-a", "icl-outlier-b"):
        (step,) = gs.PRESETS[name]["steps"]
        cmd = step[3]
        for proc in cmd.split(" & ")[:-1]:
            assert "--task linear" in proc and "--steps 50000" in proc and "--tf32" in proc and "--cuda-graphs" in proc
            atts = re.search(r"--attentions (\S+)", proc).group(1).split(",")
            seed = int(re.search(r"--first-seed (\d+)", proc).group(1))
            assert f"--concurrent {len(atts)}" in proc
            seen += [(a, seed) for a in atts]
        checked = {os.path.basename(p) for p in re.findall(r"test -s (\S+)", cmd)}
        assert checked == {f"linear-{a}-s{s}.json" for a, s in seen if (a, s) not in done}, name
        done |= set(seen)
    assert sorted(seen) == sorted((a, s) for a in ("softmax", "ssa") for s in (1, 2, 3))


def test_the_icl_training_budget_ends_before_the_step_is_killed():
    """A run's own budget must stop it (checkpointed) before the session kills the step: the
    training clock starts after ~30 s of imports, a finished run is evaluated for up to ~40 s, and
    the step's limit is the preset's budget less the bundle's install and start-up (~41 s on the
    first call of 2026-12-02, where a budget of 495 s was killed at 499 s before checkpointing)."""
    import re

    gs = _load_session()
    for name in ("icl-outlier-a", "icl-outlier-b"):
        preset = gs.PRESETS[name]
        budgets = {float(b) for b in re.findall(r"--budget-s (\S+)", preset["steps"][0][3])}
        assert budgets == {gs.ICL_BUDGET_S}, name
        assert gs.ICL_BUDGET_S + 30 + 40 <= preset["budget"] - 41, name


def test_the_results_commit_says_when_the_tree_is_not_its_head(tmp_path, monkeypatch):
    """Without --commit the results file names git's HEAD; a tree with changes to tracked files
    (the device's copy of a checkout ahead of main) is marked, not named as HEAD."""
    session = _load_session()
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("a\n")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(session, "REPO", str(tmp_path))
    assert session._commit(None) == head
    assert session._commit("abc1234") == "abc1234"
    (tmp_path / "untracked.txt").write_text("b\n")  # the outputs a session writes are not a change
    assert session._commit(None) == head
    (tmp_path / "f.txt").write_text("changed\n")
    assert session._commit(None) == f"{head} with uncommitted changes (pass --commit)"
    monkeypatch.setattr(session, "REPO", str(tmp_path / "not-a-repo"))
    assert session._commit(None) == "unknown (pass --commit)"
