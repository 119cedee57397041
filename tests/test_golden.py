"""Golden values: the README's main job on CPU reproduces the committed loss curves.

Runs ``python scripts/pretrain.py`` exactly as the README does (softmax, then ssa, then the
comparison), in a temporary runs root, and checks each curve against tests/golden/cpu_smoke
with the compare tool's relative gate (Megatron's rule, rtol 0.05; tests/golden/README.md).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from nemo_ssa.tools import compare as cmp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "golden", "cpu_smoke")
RTOL = 0.05

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    root = tmp_path_factory.mktemp("story")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain.py"), f"runs_root={root}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root, proc.stdout


def test_corpus_is_the_one_the_golden_values_belong_to(story):
    from nemo_ssa.data import default_corpus_dir

    meta = json.load(open(os.path.join(GOLDEN, "meta.json")))
    manifest = json.load(open(os.path.join(default_corpus_dir(), "manifest.json")))
    assert manifest["inputs"]["sha256"] == meta["corpus_inputs_sha256"], (
        f"the embedded corpus differs from the golden run's (built from Python "
        f"{manifest['inputs'].get('python_version')}, golden from {meta['corpus_python']}): "
        f"regenerate with scripts/make_golden.py on this Python, see tests/golden/README.md")


@pytest.mark.parametrize("attention", ["softmax", "ssa"])
def test_main_job_matches_golden(story, attention, tmp_path):
    root, _ = story
    run = os.path.join(root, f"{attention}-s1234")
    golden = os.path.join(GOLDEN, f"{attention}.csv")
    rc = cmp.main([f"golden={golden}", f"{attention}={run}", "--ema", "0", "--rtol", str(RTOL),
                   "--no-plot", "--out", str(tmp_path / "cmp")])
    assert rc == 0, open(tmp_path / "cmp" / "summary.md").read()
    # the golden run learned: a stalled run would miss it by far more than the tolerance
    losses = [float(r["loss"]) for r in csv.DictReader(open(golden))]
    assert len(losses) == 60 and losses[-1] < losses[0] * (1 - 3 * RTOL)


def test_main_job_tells_the_story(story):
    root, out = story
    last = out.strip().splitlines()[-1]
    assert "comparison:" in last and "compare-softmax_vs_ssa-s1234" in last
    cmp_dir = os.path.join(root, "compare-softmax_vs_ssa-s1234")
    for name in ("loss.png", "ssa_n.png", "summary.md", "summary.csv"):
        assert os.path.getsize(os.path.join(cmp_dir, name)) > 0, name
    rows = {r["run"]: r for r in csv.DictReader(open(os.path.join(cmp_dir, "summary.csv")))}
    assert rows["softmax"]["baseline"] == "softmax" and int(rows["ssa"]["compared_steps"]) == 60


def test_a_stalled_run_fails_the_golden_gate(tmp_path):
    """Negative control for the gate itself: a curve that stops learning halfway fails."""
    rows = list(csv.DictReader(open(os.path.join(GOLDEN, "ssa.csv"))))
    stalled = tmp_path / "stalled.csv"
    with open(stalled, "w") as f:
        f.write("step,loss\n")
        for r in rows:
            step, loss = int(r["step"]), float(r["loss"])
            f.write(f"{step},{loss if step <= 30 else float(rows[29]['loss'])}\n")
    rc = cmp.main([f"golden={os.path.join(GOLDEN, 'ssa.csv')}", f"stalled={stalled}", "--ema", "0",
                   "--rtol", str(RTOL), "--no-plot", "--out", str(tmp_path / "o")])
    assert rc == 1
