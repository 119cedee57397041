"""``python -m nemo_ssa pretrain`` and ``python -m nemo_ssa study`` run from an installed wheel.

The wheel is built from a clean copy of what pyproject.toml packages (so stale ``build/``
files cannot leak into it), installed with ``pip install --target``, and run from a directory
outside the repository with only that install on ``PYTHONPATH``: the subprocess imports the
installed ``nemo_ssa`` and ``recipes`` (asserted), finds the hydra tree in the package, trains
the CPU main job for two steps and writes its run directory under the current directory, as a
checkout's run does. A copy of the install without its ``configs/`` fails the same command
(the negative control: the check sees a wheel that does not ship the hydra tree).
"""

from __future__ import annotations

import csv
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# the README's main job (tests/scripts/test_pretrain_cpu.py), shrunk to two steps
TINY = ["data.vocab_size=512", "data.max_bytes=400000", "train.max_steps=2", "train.warmup_steps=1",
        "train.log_every_n_steps=1", "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.ckpt_every_n_steps=null", "model.cpu_arch.hidden_size=32", "model.cpu_arch.ffn_hidden_size=64"]


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site dir holding the installed wheel, a work directory outside the repository, tiny corpus dir)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("nemo_ssa", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"), str(src), cwd=tmp)
    wheels = glob.glob(str(tmp / "dist" / "nemo_ssa-*.whl"))
    assert len(wheels) == 1, wheels
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(tmp / "site"), wheels[0], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    assert REPO not in work.parents
    from nemo_ssa.data import build_corpus

    corpus = build_corpus(str(tmp / "corpus"), source="stdlib", vocab_size=512, max_bytes=400_000, quiet=True)
    return tmp / "site", work, os.path.dirname(corpus.prefix)


def _env(site: Path) -> dict:
    """The installed copy alone on PYTHONPATH; nothing that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(site), PYTHONUNBUFFERED="1", PYTHONNOUSERSITE="1")
    return env


def _run(args, site: Path, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(site), capture_output=True, text=True,
                          timeout=timeout)


def test_installed_copy_is_what_runs(installed):
    site, work, _ = installed
    probe = ("import os, sys, nemo_ssa, recipes\n"
             "from nemo_ssa.cli import CONFIG_DIR\n"
             "from nemo_ssa.data import default_corpus_dir\n"
             "print(nemo_ssa.__file__); print(recipes.__file__); print(CONFIG_DIR); print(default_corpus_dir())\n"
             f"print(any(os.path.realpath(p or '.') == {str(REPO)!r} for p in sys.path))\n")
    proc = _run(["-c", probe], site, work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pkg, rec, configs, corpus_dir, repo_on_path = proc.stdout.split("\n")[:5]
    for path in (pkg, rec, configs):
        assert Path(path).resolve().is_relative_to(site.resolve()), (path, site)
    assert os.path.isfile(os.path.join(configs, "attention", "ssa.yaml"))
    assert repo_on_path == "False"
    # outside a checkout the embedded corpus goes beside runs/, under the current directory
    assert corpus_dir == str(work / "data" / "stdlib-corpus")


def test_pretrain_trains_and_writes_its_run_dir_under_the_cwd(installed):
    site, work, corpus = installed
    proc = _run(["-m", "nemo_ssa", "pretrain", "attention=ssa", "compare_to=[]", f"data.dir={corpus}", *TINY],
                site, work)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = work / "runs" / "ssa-s1234"
    assert f"logs: {run_dir}" in proc.stdout.strip().splitlines()[-1], out[-2000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2]
    # hydra's own files where a checkout's run puts them (hydra.output_subdir under run_dir)
    assert (run_dir / "hydra" / "config.yaml").is_file() and (run_dir / "attention_policy.json").is_file()


def test_study_runs_its_children_from_the_installed_copy(installed):
    """The study's children are the launcher as a module: they too must run without a checkout."""
    site, work, corpus = installed
    proc = _run(["-m", "nemo_ssa", "study", "--attentions", "softmax,ssa", "--seeds", "1", "--out", "runs/study",
                 "--", f"data.dir={corpus}", "train.val_check_interval=2", *TINY], site, work, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for name in ("softmax-s1234", "ssa-s1234"):
        assert (work / "runs" / "study" / name / "complete.json").is_file(), (name, out[-3000:])
    assert (work / "runs" / "study" / "study.md").is_file()


def test_a_wheel_without_the_hydra_tree_fails(installed, tmp_path):
    """Negative control: the same command against an install missing nemo_ssa/configs."""
    site, work, _ = installed
    broken = tmp_path / "site"
    shutil.copytree(site, broken, ignore=shutil.ignore_patterns("configs"))
    proc = _run(["-m", "nemo_ssa", "pretrain", "compare_to=[]", "--cfg", "job"], broken, work)
    assert proc.returncode != 0
    assert "Primary config directory not found" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
