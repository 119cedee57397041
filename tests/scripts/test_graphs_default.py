"""scripts/device/graphs_default.py: the checks model.cuda_graphs=auto rests on.

The verdicts are read from the run directories the launcher writes (metrics.csv with its
``segment`` column, heldout.csv, summary.json); here they are written by hand, each failure
mode once, and the kill-on-step watcher runs against a process that writes rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from nemo_ssa.testing.scripts import REPO, load_script


def _load():
    return load_script("scripts/device/graphs_default.py")


def _run(tmp_path, name, segments, heldout, rate=None, captured=None):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.csv", "w") as f:
        f.write("step,loss,segment\n")
        for seg, rows in segments.items():
            for step, loss in rows:
                f.write(f"{step},{loss},{seg}\n")
    with open(d / "heldout.csv", "w") as f:
        f.write("step,val_loss\n" + "".join(f"{s},3.0\n" for s in heldout))
    if rate or captured is not None:
        (d / "summary.json").write_text(json.dumps({"tokens_per_s_median": rate, "cuda_graphs_captured": captured}))
    return str(d)


def _killed_then_resumed(redo_loss="2.500000", last=60):
    first = [(s, f"{3 - s / 100:.6f}") for s in range(1, 47)]
    second = [(s, f"{3 - s / 100:.6f}") for s in range(41, last + 1)]
    second[0] = (41, redo_loss)
    first[40] = (41, "2.500000")
    return {1: first, 2: second}


def test_resume_passes_when_the_redone_step_and_the_cadence_match(tmp_path):
    gd = _load()
    v = gd.resume_verdict(_run(tmp_path, "ok", _killed_then_resumed(), [20, 40, 40, 60], captured=True))
    assert v["result"] == "PASS", v
    assert "step 41" in v["detail"]


@pytest.mark.parametrize("case, want", [
    (dict(segments=_killed_then_resumed(redo_loss="2.500001"), heldout=[20, 40, 60]), "step 41: loss 2.500001"),
    (dict(segments=_killed_then_resumed(), heldout=[20, 40, 41]), "held-out at [20, 40, 41]"),
    (dict(segments=_killed_then_resumed(last=59), heldout=[20, 40, 60]), "ended at step 59"),
    (dict(segments={1: [(s, "3.0") for s in range(1, 61)]}, heldout=[20, 40, 60]), "no resumed segment"),
    (dict(segments=_killed_then_resumed(), heldout=[20, 40, 60], captured=False), "captured no CUDA graphs"),
])
def test_resume_fails_on_each_fault(tmp_path, case, want):
    gd = _load()
    v = gd.resume_verdict(_run(tmp_path, "bad", case["segments"], case["heldout"], captured=case.get("captured", True)))
    assert v["result"] == "FAIL" and want in v["detail"], v


def test_parity_gate_and_speed(tmp_path):
    gd = _load()
    base = {1: [(s, f"{5 - s / 50:.4f}") for s in range(1, 101)]}
    near = {1: [(s, f"{5 - s / 50 + 0.01:.4f}") for s in range(1, 101)]}
    far = {1: [(s, f"{5 - s / 50 + 0.2:.4f}") for s in range(1, 101)]}
    none = _run(tmp_path, "none", base, [100], rate=400000, captured=False)
    ok = gd.parity(str(tmp_path), "p", none, _run(tmp_path, "near", near, [100], rate=420000, captured=True))
    assert ok["result"] == "PASS" and "1.05x" in ok["detail"], ok
    bad = gd.parity(str(tmp_path), "q", none, _run(tmp_path, "far", far, [100], captured=True))
    assert bad["result"] == "FAIL" and "tokens/s missing" in bad["detail"], bad
    # equal curves, but the graphed run captured no graphs: not a pass
    idle = gd.parity(str(tmp_path), "r", none, _run(tmp_path, "idle", near, [100], rate=420000, captured=False))
    assert idle["result"] == "FAIL" and "graphs captured none / local: False / False" in idle["detail"], idle


def test_kill_after_stops_the_run_at_the_step(tmp_path):
    gd = _load()
    run = tmp_path / "r"
    run.mkdir()
    writer = ("import sys, time\nf = open(sys.argv[1], 'w'); f.write('step,loss,segment\\n')\n"
              "for s in range(1, 1000):\n    f.write(f'{s},1.0,1\\n'); f.flush(); time.sleep(0.02)\n")
    proc = subprocess.Popen([sys.executable, "-c", writer, str(run / "metrics.csv")], start_new_session=True)
    assert gd.kill_after(proc, str(run), 30, timeout=60, poll=0.05)
    assert proc.returncode == -9 and 30 <= gd.last_step(str(run)) < 999
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    assert not gd.kill_after(done, str(run / "missing"), 30, timeout=10, poll=0.05)


def test_the_launches_name_keys_that_exist():
    """Every override the checks pass exists in the launcher's config tree (a renamed key would
    burn a device call)."""
    gd = _load()
    args = gd.pretrain_args("/tmp/x", "ssa_triton", "local", "train.max_steps=60", "train.ckpt_every_n_steps=20",
                            "train.val_check_interval=20", "train.log_every_n_steps=1", "resume=true",
                            "train.num_gpus_per_node=2")
    conf = os.path.join(REPO, "nemo_ssa", "configs")
    text = {name: open(os.path.join(conf, *name.split("/"))).read()
            for name in ("config.yaml", "train/gpu_9min.yaml", "model/nemotron_114m.yaml")}
    for a in args:
        key = a.split("=")[0]
        group, _, leaf = key.rpartition(".")
        where = {"": "config.yaml", "train": "train/gpu_9min.yaml", "model": "model/nemotron_114m.yaml"}[group]
        if key in ("attention", "train"):
            continue
        assert re.search(rf"^{leaf}:", text[where], re.M), (key, where)
    assert os.path.isfile(os.path.join(conf, "attention", "softmax_triton.yaml"))


def test_unknown_check_is_refused():
    gd = _load()
    with pytest.raises(SystemExit, match="softmax_triton, resume, dp2"):
        gd.main(["--out", "/tmp/unused-graphs-default", "--only", "resume,tp2"])


def test_the_resume_check_runs_under_the_graphs_it_is_given(tmp_path, monkeypatch):
    """``--resume-graphs full``: both launches of the killed-and-resumed run use megatron's
    whole-iteration graph (the check's row says so); the default stays local."""
    gd = _load()
    seen = []

    class Done:
        def wait(self):
            return 0

    def start(args, log, gpu, torchrun=0):
        seen.append(args)
        return Done()

    run_dir, proc, extra = gd.start_resume(str(tmp_path), "0", start=start, graphs="full")
    assert run_dir.endswith("resume-full") and "model.cuda_graphs=full" in seen[0]
    monkeypatch.setattr(gd, "kill_after", lambda *a, **k: True)  # the first launch "reached" the kill step
    rows = gd.finish_resume(str(tmp_path), run_dir, proc, extra, "0", start=start, graphs="full")
    assert "model.cuda_graphs=full" in seen[1] and "resume=true" in seen[1]
    assert rows[0]["check"] == "resume with graphs (full)" and rows[0]["result"] == "FAIL"  # no metrics here
    gd.start_resume(str(tmp_path), "0", start=start)
    assert "model.cuda_graphs=local" in seen[2]
