"""benchmarks/scaling_model.py and bench_cp.py's table, on CPU: the communication model's
volumes and limits, and the CP table's ratios against CP1 from synthetic rows."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks import bench_cp, scaling_model as sm  # noqa: E402


def test_collective_volumes():
    p, bw = 1_000_000, 1e9
    assert sm.dp_comm(1, p, True, bw, 0.0, 1.0) == 0.0
    # all-reduce of fp32 gradients: 2 (N-1)/N * 4P; distributed optimizer: (N-1)/N * (4P + 2P)
    assert sm.dp_comm(2, p, False, bw, 0.0, 1.0) == pytest.approx(4 * p / bw)
    assert sm.dp_comm(2, p, True, bw, 0.0, 1.0) == pytest.approx(3 * p / bw)
    # only the exposed share of the gradient reduce counts; the parameter all-gather is whole
    assert sm.dp_comm(2, p, True, bw, 0.0, 0.0) == pytest.approx(p / bw)
    # hops add latency
    assert sm.dp_comm(512, p, False, bw, 1e-6, 1.0) > sm.dp_comm(8, p, False, bw, 1e-6, 1.0)


def test_table_falls_with_scale_and_network(capsys):
    args = sm.main(["--json"])
    rows = json.loads(capsys.readouterr().out)
    assert args == 0 and [r["gpus"] for r in rows] == [2, 4, 8, 64, 512]
    # plain DDP pays the whole optimizer step on every rank: per-GPU falls with every doubling;
    # the distributed optimizer shards it (rising within a node) until the network (64, 512)
    ddp = [r["dp_ddp"] for r in rows]
    assert ddp == sorted(ddp, reverse=True)
    distopt = [r["dp_distopt"] for r in rows]
    assert distopt[:3] == sorted(distopt[:3]) and distopt[2:] == sorted(distopt[2:], reverse=True)
    one = 32768 / sm.machine("dp4")["t1"]
    assert all(r["dp_ddp"] < one and r["tp2_dp"] < r["dp_ddp"] for r in rows)


def test_step_split_is_the_two_one_gpu_runs():
    for fit in sm.FITS:
        m = sm.machine(fit)
        assert m["t_mb"] > 0 and m["t_fixed"] > 0 and m["t_mb"] + m["t_fixed"] == pytest.approx(m["t1"])


def test_cp_table_ratios(tmp_path):
    rows1 = [{"attention": "ssa_triton", "seq": 16384, "cp": 1, "ms": 100.0, "tokens_per_s": 163840.0,
              "tokens_per_s_per_gpu": 163840.0, "peak_gib": 10.0, "comm_ms": 0, "gathered_kv_mib_per_layer": 0.0}]
    rows2 = [{"attention": "ssa_triton", "seq": 16384, "cp": 2, "ms": 80.0, "tokens_per_s": 204800.0,
              "tokens_per_s_per_gpu": 102400.0, "peak_gib": 5.0, "comm_ms": 8.0, "gathered_kv_mib_per_layer": 16.0},
             {"attention": "softmax", "seq": 32768, "cp": 2, "error": "OOM: x"}]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": rows1}))
    b.write_text(json.dumps({"rows": rows2}))
    text = bench_cp.table([str(a), str(b)])
    assert "| ssa_triton | 16,384 | 2 | 80.0 | 204,800 | 102,400 | 0.62x | 5.00 | 8.00 (10.0 %) | 16 |" in text
    assert "| softmax | 32,768 | 2 | OOM: x |" in text


def test_dp4_fit_reproduces_the_four_gpu_measurement(capsys):
    """--fit dp4 (the default) takes its DP overhead from the 4 x H200 run: its 4-GPU row is
    the measured speed-up over one GPU of that machine; the two-launcher DP2 fit is lower."""
    sm.main(["--json", "--gpus", "4"])
    dp4 = json.loads(capsys.readouterr().out)[0]
    sm.main(["--json", "--gpus", "4", "--fit", "dp2"])
    dp2 = json.loads(capsys.readouterr().out)[0]
    one = 32768 / sm.machine("dp4")["t1"]
    measured = sm.MEASURED_DP4["t1_b32"] / sm.MEASURED_DP4["t_dp4"] * 4  # the speed-up over one GPU
    assert dp4["dp_distopt"] / one * 4 == pytest.approx(measured, rel=1e-9)
    assert dp2["dp_distopt"] / (32768 / sm.machine("dp2")["t1"]) < dp4["dp_distopt"] / one
