"""The GPU parity protocol's CPU-side half: which runs are gated against which, and the
comparison of returned logs (directories or the packed .tgz)."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("parity", os.path.join(REPO, "scripts", "parity.py"))
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)


def test_plan_gates_kernels_against_their_own_reference():
    labels = ["ssa_reference-s1234", "ssa_reference-s4321", "softmax-s1234", "ssa_triton-s1234",
              "softmax_triton-s1234", "ssa_flex-s4321", "softmax-s1234-resumed"]
    order, gates, pairs = parity.plan_comparison(labels)
    assert order[0] == "softmax-s1234"  # the plot's baseline
    assert sorted(gates) == sorted([
        ("ssa_triton-s1234", "ssa_reference-s1234"),
        ("softmax_triton-s1234", "softmax-s1234"),
        ("ssa_flex-s4321", "ssa_reference-s4321"),  # same seed only
        ("softmax-s1234-resumed", "softmax-s1234"),
    ])
    assert pairs == [("ssa_reference-s4321", "ssa_reference-s1234")]  # noise floor: shown
    # softmax vs SSA is never gated
    assert not any({a.split("-s")[0], b.split("-s")[0]} == {"softmax", "ssa_reference"} for a, b in gates)


def test_plan_without_softmax_or_reference():
    order, gates, pairs = parity.plan_comparison(["ssa_triton-s7"])
    assert order == ["ssa_triton-s7"] and gates == [] and pairs == []


def _run(root, label, fn, steps=200):
    os.makedirs(os.path.join(root, label))
    with open(os.path.join(root, label, "metrics.csv"), "w") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        for s in range(1, steps + 1):
            w.writerow([s, fn(s)])


def _loss(s):
    return 3 + 7 * math.exp(-s / 50) + 0.05 * math.sin(s)


def test_compare_gates_the_kernel_and_reads_tarballs(tmp_path):
    logs = tmp_path / "logs"
    _run(logs, "softmax-s1", _loss)
    _run(logs, "ssa_reference-s1", lambda s: _loss(s) + 0.1)
    _run(logs, "ssa_triton-s1", lambda s: _loss(s) + 0.1 + (0.2 if s > 150 else 0.0))  # drifts away
    _run(logs, "softmax-s1-resumed", _loss)
    tgz = tmp_path / "parity-logs.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for name in os.listdir(logs):
            tar.add(logs / name, arcname=name)
    out = tmp_path / "out"
    assert parity.main(["compare", "--logs", str(tgz), "--out", str(out)]) == 1  # the drift fails
    gates = list(csv.DictReader(open(out / "gates.csv")))
    assert [(g["run"], g["ref"], g["passed"]) for g in gates] == [("ssa_triton-s1", "ssa_reference-s1", "False")]
    assert (out / "resume" / "gates.csv").exists()
    # without the drifting kernel everything passes (softmax vs SSA is 0.1 apart: shown only)
    assert parity.main(["compare", "--logs", str(logs), "--out", str(tmp_path / "o2"),
                        "--only", "softmax-s1", "ssa_reference-s1", "softmax-s1-resumed"]) == 0


def test_train_refuses_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs CUDA"):
        parity.main(["train", "--runs", "softmax:1", "--out", str(tmp_path)])


def test_experimental_runs_take_their_overrides_and_are_shown_not_gated():
    name, seed, own = parity._parse_run("nsa_ssa:1234:policy=free,attention.options.window=64")
    assert (name, seed, own) == ("nsa_ssa", 1234, ["policy=free", "attention.options.window=64"])
    assert parity._parse_run("nsa_ssa:1234:policy=free")[2] == ["policy=free"]
    cmd = parity._pretrain_cmd(name, seed, 10, "/tmp/r", own)
    assert "attention=nsa_ssa" in cmd and cmd[-2:] == own
    assert "train.micro_batch_size=8" in cmd and cmd.index("train.micro_batch_size=8") < cmd.index(own[0])  # protocol pinned, run overrides win
    assert parity._parse_resume("nsa_ssa:1234:500") == ("nsa_ssa", 1234, 500, [])
    # a resume check takes its own overrides too (an experimental attention needs policy=free)
    assert parity._parse_resume("nsa_ssa:1234:500:policy=free,train.seq_length=4096") == (
        "nsa_ssa", 1234, 500, ["policy=free", "train.seq_length=4096"])
    with pytest.raises(SystemExit, match="ATTENTION:SEED:STEP"):
        parity._parse_resume("nsa_ssa:1234")
    # NSA is a different attention, compared to softmax and itself, never gated
    order, gates, pairs = parity.plan_comparison(["softmax-s1234", "nsa-s1234", "nsa_ssa-s1234", "nsa_ssa-s4321"])
    assert order[0] == "softmax-s1234" and gates == []
    assert pairs == [("nsa_ssa-s4321", "nsa_ssa-s1234")]
    with pytest.raises(SystemExit, match="ATTENTION:SEED"):
        parity._parse_run("nsa_ssa")
