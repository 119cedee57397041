"""scripts/two_gpu.py (issue 17): the checks on synthetic run logs -- each gate passes on
good logs and fails on one planted fault (a loss offset, one rank's n one ulp off, the
checkpoint's n off, DP2 too slow, a resume without its second segment) -- and the whole
``tp_cp`` part on CPU (gloo, tiny model): TP2+SP stopped at step 3, its checkpoint resumed
on one process and at TP2, CP2, every gate of the check passing. The reader of n from a
dist checkpoint is checked against the values the training returned."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import two_gpu  # noqa: E402

from nemo_ssa.metrics_log import write_rank_file  # noqa: E402

N = {1: 1.5123, 2: 1.4987}
B = {1: 0.800000011920929, 2: 0.800000011920929}


def _run_dir(root, label, *, world=1, offset=0.0, rate=100_000.0, n=None, segments=(1,), ckpt_n=None):
    d = root / label
    d.mkdir(parents=True)
    steps = list(range(1, 301))
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "lr", "tokens_per_s", "grad_norm", "segment"])
        for s in steps:
            seg = segments[0] if s <= 150 or len(segments) == 1 else segments[1]
            w.writerow([s, f"{8 * math.exp(-s / 80) + 3 + offset:.6f}", "1e-4", rate, "1.0", seg])
    (d / "summary.json").write_text(json.dumps({"tokens_per_s_median": rate}))
    for r in range(world):
        layout = dict(rank=r, world_size=world, tp_rank=r, tp_size=world)
        write_rank_file(str(d), layout, 300, {"n": dict(n or N), "b": dict(B)})
    if ckpt_n is not None:
        (d / "ckpt_ssa.json").write_text(json.dumps({"checkpoint": "x", "n": {str(k): v for k, v in ckpt_n.items()},
                                                     "b": {}}))
    return d


def _check(tmp_path, part_dir, *extra):
    out = tmp_path / "out"
    return two_gpu.main(["check", str(part_dir), "--out", str(out), "--no-plot", *extra]), \
        (out / "two_gpu.md").read_text()


def _part(tmp_path, name, part="dp"):
    d = tmp_path / name
    d.mkdir()
    (d / "runs.json").write_text(json.dumps({"part": part}))
    return d


def test_dp_part_passes(tmp_path):
    p = _part(tmp_path, "good")
    _run_dir(p, "ssa-1gpu")
    _run_dir(p, "ssa-dp2", world=2, offset=0.004, rate=190_000.0)
    _run_dir(p, "softmax-1gpu")
    _run_dir(p, "softmax-dp2", world=2, rate=185_000.0)
    rc, md = _check(tmp_path, p)
    assert rc == 0, md
    assert "| dp: ssa-dp2 speed >= 1.8x | PASS | 190,000 vs 100,000 tokens/s (1.90x) |" in md
    assert "| dp: ssa-dp2 n on every rank | PASS | 2 rank(s) identical" in md


@pytest.mark.parametrize("fault", ["loss", "rank_n", "speed"])
def test_dp_part_fails_on_a_planted_fault(tmp_path, fault):
    p = _part(tmp_path, fault)
    _run_dir(p, "ssa-1gpu")
    d = _run_dir(p, "ssa-dp2", world=2, offset=0.1 if fault == "loss" else 0.0,
                 rate=150_000.0 if fault == "speed" else 190_000.0)
    if fault == "rank_n":  # rank 1's n of layer 2 one ulp away
        rec = json.load(open(d / "ranks" / "rank_00001.json"))
        rec["n"]["2"] = math.nextafter(N[2], 2.0).hex()
        (d / "ranks" / "rank_00001.json").write_text(json.dumps(rec))
    rc, md = _check(tmp_path, p)
    assert rc == 1, md
    failed = [line for line in md.splitlines() if "| FAIL |" in line]
    want = {"loss": "ssa-dp2 loss", "rank_n": "ssa-dp2 n on every rank", "speed": "ssa-dp2 speed"}[fault]
    assert len(failed) == 1 and want in failed[0], md
    if fault == "rank_n":
        assert "layer 2" in failed[0]


@pytest.mark.parametrize("fault", [None, "ckpt_n", "one_segment"])
def test_tp_part_checkpoint_and_resume(tmp_path, fault):
    p = _part(tmp_path, str(fault), part="tp_cp")
    _run_dir(p, "ssa-1gpu")
    ck = dict(N)
    if fault == "ckpt_n":
        ck[1] = N[1] + 1e-6
    _run_dir(p, "ssa-tp2sp", world=2, segments=(1, 2), ckpt_n=ck)
    _run_dir(p, "ssa-tp2to1", segments=(1,) if fault == "one_segment" else (1, 2))
    _run_dir(p, "ssa-cp2", world=2, rate=60_000.0)
    rc, md = _check(tmp_path, p)
    failed = [line for line in md.splitlines() if "| FAIL |" in line]
    if fault is None:
        assert rc == 0 and not failed, md
        assert "checkpoint n = rank 0's" in md and "| tp_cp: ssa-cp2 speed | reported |" in md
    else:
        want = {"ckpt_n": "ssa-tp2sp n on every rank", "one_segment": "ssa-tp2to1 resume"}[fault]
        assert rc == 1 and len(failed) == 1 and want in failed[0], md


def test_plan_has_every_run_of_the_issue():
    labels = {j.label for part in two_gpu.PARTS for stage in two_gpu.plan(part, "/s", cpu=False) for j in stage}
    assert labels == {"ssa-1gpu", "softmax-1gpu", "ssa-dp2", "softmax-dp2", "ssa-tp2sp", "ssa-tp2to1", "ssa-cp2"}
    tp = [j for stage in two_gpu.plan("tp_cp", "/s", cpu=False) for j in stage if j.label == "ssa-tp2sp"]
    cmd = " ".join(tp[0].launches[0])
    assert "train.tensor_parallel=2" in cmd and "train.sequence_parallel=true" in cmd and "stop_after=150" in cmd
    assert "--nproc-per-node=2" in cmd and "train.num_gpus_per_node=2" in cmd and "train.max_steps=300" in cmd


@pytest.mark.slow
def test_tp_cp_part_end_to_end_on_cpu(tmp_path):
    """The GPU plan's tp_cp part on CPU, then its check: every gate passes."""
    out = tmp_path / "tp_cp"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "two_gpu.py"), "run", "--part", "tp_cp",
                           "--cpu-smoke", "--out", str(out), "--scratch", str(tmp_path / "scratch"),
                           "--budget", "1200"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    tgz = out / "two_gpu-tp_cp.tgz"
    assert tgz.is_file()
    res = tmp_path / "check"
    rc = two_gpu.main(["check", str(tgz), "--out", str(res), "--no-plot", "--from-step", "1"])
    md = (res / "two_gpu.md").read_text()
    assert rc == 0, md
    for want in ("ssa-tp2sp loss vs ssa-1gpu | PASS", "ssa-cp2 loss vs ssa-1gpu | PASS", "ssa-tp2to1 resume | PASS",
                 "ssa-tp2sp n on every rank | PASS | 2 rank(s) identical", "checkpoint n = rank 0's"):
        assert want in md, (want, md)


@pytest.mark.parametrize("key,want", [
    ("decoder.layers.self_attention.core_attention.n", (None, "n")),          # CPU loop, stacked layers
    ("module.decoder.layers.self_attention.core_attention.b", (None, "b")),   # NeMo's prefix
    ("module.decoder.layers.3.self_attention.n", ("3", "n")),                  # nsa_ssa, per-layer key
    ("optimizer.state.exp_avg.decoder.layers.self_attention.core_attention.n", None),
    ("optimizer.distributed.dp_group_idx_0.bucket_idx_0.exp_avg_sq.module.decoder.layers.self_attention."
     "core_attention.n", None),
    ("decoder.layers.self_attention.linear_qkv.weight", None),
])
def test_checkpoint_key_of_ssa_scalars(key, want):
    from nemo_ssa.megatron.checkpoints import _SSA_CKPT_KEY

    m = _SSA_CKPT_KEY.match(key)
    assert (m.groups() if m else None) == want
