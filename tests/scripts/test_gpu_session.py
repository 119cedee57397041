"""scripts/gpu_session.py: timed steps, a killed step does not stop the next, one archive back."""

import os
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_steps_time_limits_and_packing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "gpu_session.py"), "--out", str(out), "--budget", "30",
         "ok:10:echo hello; echo table > {out}/t.md", "slow:1:sleep 20", "bad:10:exit 3"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    table = proc.stdout.strip().splitlines()[-3:]
    assert table == ["| ok | 0 | 0 |", "| slow | killed at 1 s | 1 |", "| bad | 3 | 0 |"]
    assert os.listdir(out) == ["session.tgz"]  # only the archive goes back
    with tarfile.open(out / "session.tgz") as tar:
        names = sorted(tar.getnames())
        assert names == ["bad.log", "ok.log", "slow.log", "t.md"]
        assert b"hello" in tar.extractfile("ok.log").read()


def test_model_grad_parity_needs_cuda():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "model_grad_parity.py"), "--steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr
