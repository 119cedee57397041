"""benchmarks/host_path.py: the host path of one attention fwd+bwd with launches stubbed.

What it counts, not how fast it is (no timing is asserted): each impl and call style makes
the launches the recipe's H100 call makes (softmax: forward, dQ, dK/dV; SSA: forward,
preprocess, the single pass's dK/dV, postprocess), cProfile's counts are positive, and a
second tree (this checkout named as a directory) runs in its own process with the same
launches. Runs in a subprocess: the suite sets TRITON_INTERPRET=1, which the tool refuses.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "benchmarks/host_path.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_recipe_call_makes_the_h100_launches_in_every_tree():
    r = _run("--calls", "3", "--profile-calls", "1", "--call", "run,megatron", "--trees", f".,{REPO}",
             "--launches")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 8, r.stdout
    for tree, call, impl, py, total, *_, launches, digest in (map(str.strip, row) for row in rows):
        assert float(py) > 0 and float(total) >= float(py), row
        assert launches == ("4" if impl == "ssa_triton" else "3"), (tree, call, impl, launches)
    digests = {}
    for tree, call, impl, *_, digest in (list(map(str.strip, row)) for row in rows):
        digests.setdefault((call, impl), set()).add(digest)
    assert all(len(d) == 1 for d in digests.values()), digests  # the same tree twice: the same launches
    assert "attn_bwd_postprocess" in r.stdout and "attn_bwd_kernel_dq" in r.stdout


def test_refused_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "benchmarks/host_path.py", "--calls", "1"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "TRITON_INTERPRET" in (r.stdout + r.stderr)


def test_rope_qkv_makes_one_launch_each_way():
    """The QKV-buffer RoPE pass: forward and backward one ``_rope_layout_kernel`` launch each,
    the backward's INVERSE rotation, through ``launch`` (so the stub sees them)."""
    r = _run("--calls", "3", "--profile-calls", "1", "--impl", "rope_qkv", "--launches")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 1 and rows[0][-2].strip() == "2", r.stdout
    launches = [ln for ln in r.stdout.splitlines() if ln.startswith("_rope_layout_kernel ")]
    assert len(launches) == 2, r.stdout
    assert "('INVERSE', False)" in launches[0] and "('INVERSE', True)" in launches[1]
