"""benchmarks/bench_mlp.py's logic on CPU (``--smoke-cpu``: tiny shapes, fp16 kernels in the
Triton interpreter, aot_eager for the compiled rows), so the GPU run is not its first run:
every variant row and every tile row completes and passes its correctness check."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark")


@pytest.mark.parametrize("extra", [[], ["--tiles"]], ids=["variants", "tiles"])
def test_bench_mlp_smoke(tmp_path, extra):
    out = tmp_path / "mlp.md"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_mlp.py"), "--smoke-cpu",
                           "--tokens", "48", "--out", str(out)] + extra,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.read_text()
    assert "error" not in md.lower() and "FAIL" not in md and "WRONG" not in md, md
    if extra:
        assert "Fastest at 48 tokens" in md
    else:
        for name in ("megatron MLP", "torch eager", "compile default", "compile max-autotune", "nemo_ssa fused",
                     "nemo_ssa module", "fused under compile"):
            assert f"| 48 | {name} |" in md, name
