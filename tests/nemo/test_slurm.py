"""nemo_ssa.nemo.slurm: the sbatch script nemo-run's Slurm executor renders for a
multi-node pretrain (2 nodes x 8 GPUs here), checked as a submission: bash syntax, the
#SBATCH lines, one torchrun per node with the c10d rendezvous, the launcher's layout keys
matching, a dead rank ending the job; and a bad layout refused before anything renders."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from nemo_ssa.nemo import slurm


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return slurm.render_sbatch(2, 8, ["attention=ssa_triton", "train=gpu_9min", "train.tensor_parallel=2",
                                      "train.num_gpus_per_node=1"],
                               account="acct", partition="batch", time="02:00:00",
                               job_dir=str(tmp_path_factory.mktemp("job")))


def test_sbatch_header_asks_for_two_nodes_of_eight_gpus(script):
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --time=02:00:00",
                 "#SBATCH --exclusive"):
        assert line in script, line


def test_one_torchrun_per_node_launches_the_pretrain_script(script):
    srun = [l for l in script.splitlines() if l.startswith("srun ") and "torchrun" in l]
    assert len(srun) == 1, script
    cmd = srun[0]
    for part in ("--kill-on-bad-exit=1", "--nnodes 2", "--nproc-per-node 8", "--rdzv-backend c10d",
                 "--node-rank $SLURM_NODEID", "-m nemo_ssa.cli.pretrain", "attention=ssa_triton",
                 "train.tensor_parallel=2", "train.num_nodes=2", "train.num_gpus_per_node=8"):
        assert part in cmd, (part, cmd)
    assert "train.num_gpus_per_node=1" not in cmd  # the executor's layout wins over a stale override
    # from this checkout the job exports it, so the module resolves without an install
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert f"export PYTHONPATH={repo}" in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_is_valid_bash(script, tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_a_layout_the_world_cannot_hold_is_refused_before_rendering(tmp_path):
    with pytest.raises(ValueError, match="tensor"):
        slurm.render_sbatch(2, 8, ["attention=ssa_triton", "train.tensor_parallel=3"], account="a",
                            job_dir=str(tmp_path))


def test_rendering_writes_nothing_outside_the_job_dir(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    slurm.render_sbatch(2, 8, ["attention=softmax"], account="a", job_dir=str(tmp_path / "job"))
    assert list(cwd.iterdir()) == []


def test_cli_writes_the_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    rc = slurm.main(["--nodes", "2", "--gpus-per-node", "8", "--account", "a", "--job-dir", str(tmp_path),
                     "--out", str(out), "--", "attention=softmax"])
    assert rc == 0 and "#SBATCH --nodes=2" in out.read_text()
    assert "sbatch" in capsys.readouterr().out
