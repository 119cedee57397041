"""scripts/train_megatron_core.py: nemo-ssa's attention through plain megatron-core (no NeMo):
the layer spec from nemo_ssa.megatron.layer_specs, the version-proof optimizer call, a few
steps on CPU -- the loss falls and n moves; the same run at TP2 + SP (two gloo ranks)
reproduces it, so the TP reduction of n needs nothing from the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "train_megatron_core.py")


def _env():
    """This process's environment without a torch.distributed world of its own (an in-process
    test may have set one up: its MASTER_PORT is taken)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def _run(tmp_path, name, *args, nproc=1):
    out = tmp_path / f"{name}.json"
    launch = [sys.executable, SCRIPT] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", SCRIPT]
    proc = subprocess.run([*launch, "--steps", "8", "--out", str(out), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("mc"), "one", "--attention", "ssa")


def test_plain_megatron_core_trains_with_the_ssa_spec(one_rank):
    res, out = one_rank
    assert res["losses"][-1] < res["losses"][0] - 0.3, res["losses"]
    assert len(res["n"]) == 2 and all(abs(v - 1.5) > 1e-4 for v in res["n"].values())
    assert "[megatron-core] ssa: steps 1-8" in out
    # the run says whether graphs were captured (none here: a CPU run without --cuda-graph)
    assert res["cuda_graphs"] == {"mode": "none", "captured": False} and "CUDA graphs none (captured: False)" in out


@pytest.mark.slow
def test_tensor_parallel_reproduces_one_rank(one_rank, tmp_path):
    res, _ = one_rank
    tp2, _ = _run(tmp_path, "tp2", "--attention", "ssa", "--tp", "2", nproc=2)
    # fp32, same initial weights: the two runs differ only in reduction order, which eight
    # Adam steps at lr 3e-3 amplify to ~2e-4 (measured 1.6e-4)
    assert tp2["losses"] == pytest.approx(res["losses"], rel=1e-3)
    assert tp2["n"] == pytest.approx(res["n"], rel=1e-4)


def test_unknown_attention_names_the_choices(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--attention", "nope", "--steps", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode != 0 and "one of [" in proc.stderr + proc.stdout


def test_checkpoint_save_and_resume_continue_the_run_bitwise(tmp_path, one_rank):
    """--save at step 4, then --load: steps 5-8 and n equal the uninterrupted run's -- the
    checkpoint I/O (dist_checkpointing through nemo_ssa.train.checkpoint_io) on the plain
    megatron-core path, the one a megatron-core 0.17-0.19 stack runs (no NeMo)."""
    full, _ = one_rank
    ck = tmp_path / "ck"
    _run(tmp_path, "first", "--attention", "ssa", "--save", str(ck), "--save-at", "4")
    assert os.listdir(ck) == ["step_0000004"]
    resumed, out = _run(tmp_path, "resumed", "--attention", "ssa", "--load", str(ck))
    assert "loaded" in out and resumed["first_step"] == 5
    assert resumed["losses"] == full["losses"][4:] and resumed["n"] == full["n"]


def test_cuda_graph_local_is_refused_without_cuda_before_anything_starts(monkeypatch):
    """--cuda-graph local (megatron's layer graphs) needs CUDA: one line, in this process
    before a process group or a model exists."""
    import importlib.util

    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first
    spec = importlib.util.spec_from_file_location("train_megatron_core_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    was_initialized = dist.is_initialized()
    with pytest.raises(SystemExit, match=r"^\[megatron-core\] --cuda-graph=local needs a CUDA device"):
        script.main(["--cuda-graph", "local", "--steps", "1"])
    assert dist.is_initialized() == was_initialized
