"""The compare tool: segment merging, alignment, statistics, gates, errors, outputs."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys

import pytest

from nemo_ssa.tools import compare as cmp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_csv(path, rows, n_layers=0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cols = ["step", "loss", "lr"] + [f"n_layer_{i:02d}" for i in range(1, n_layers + 1)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for step, loss, *n in rows:
            w.writerow([step, repr(loss), 1e-3] + list(n))
    return path


def _curve(steps, fn, seed=0):
    rng = random.Random(seed)
    return [(s, fn(s) + rng.uniform(-0.01, 0.01)) for s in steps]


def _loss(s):
    return 10.0 * math.exp(-s / 40.0) + 3.0


def test_csv_resume_segments_merge_later_wins(tmp_path):
    first = [(s, 100.0 + s) for s in range(1, 16)]  # stopped at 15, checkpoint was at 10
    second = [(s, float(s)) for s in range(11, 21)]  # resumed from 10: 11..15 re-done
    path = _write_csv(str(tmp_path / "run" / "metrics.csv"), first + second)
    segs = cmp.read_csv_segments(path)
    assert [(s.steps[0], s.steps[-1]) for s in segs] == [(1, 15), (11, 20)]
    curve = cmp.load_run("run", [str(tmp_path / "run")])
    assert curve.steps == list(range(1, 21))
    assert curve.loss[:10] == [100.0 + s for s in range(1, 11)]
    assert curve.loss[10:] == [float(s) for s in range(11, 21)]
    assert curve.overlaps == [(11, 15)] and curve.gaps == []


def test_later_segment_supersedes_steps_it_does_not_relog(tmp_path):
    # segment 1 logged every step up to 17; segment 2 resumed at 11 but logs every 5
    a = _write_csv(str(tmp_path / "a.csv"), [(s, 1.0) for s in range(1, 18)])
    b = _write_csv(str(tmp_path / "b.csv"), [(s, 2.0) for s in (15, 20)])
    curve = cmp.load_run("r", [a, b])
    assert curve.steps == list(range(1, 15)) + [15, 20]
    assert all(x == 2.0 for s, x in zip(curve.steps, curve.loss) if s >= 15)


def test_gaps_are_reported(tmp_path):
    rows = [(s, 1.0) for s in range(5, 51, 5) if s not in (25, 30)]
    curve = cmp.load_run("g", [_write_csv(str(tmp_path / "g.csv"), rows)])
    assert curve.interval == 5 and curve.gaps == [(20, 35)]


def test_tensorboard_segments_and_n(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    tb = tmp_path / "run" / "tb"
    for first, last, base in ((1, 10, 100.0), (6, 12, 0.0)):
        w = SummaryWriter(log_dir=str(tb))
        for s in range(first, last + 1):
            w.add_scalar("reduced_train_loss", base + s, s)
            w.add_scalar("ssa/n/layer_01", 1.5 + s / 1000, s)
            w.add_scalar("lr", 1e-3, s)
        w.close()
    curve = cmp.load_run("tb", [str(tmp_path / "run")])
    assert curve.steps == list(range(1, 13))
    assert curve.loss == [100.0 + s for s in range(1, 6)] + [float(s) for s in range(6, 13)]
    assert len(curve.segments) == 2 and curve.overlaps == [(6, 10)]
    assert [s for s, _ in curve.n[1]] == list(range(1, 13))
    assert curve.n[1][-1][1] == pytest.approx(1.512)


def test_no_loss_tag_names_the_tags_found(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(tmp_path / "tb"))
    w.add_scalar("train_loss", 1.0, 1)
    w.close()
    with pytest.raises(cmp.CompareError, match=r"no 'reduced_train_loss'.*train_loss"):
        cmp.load_run("x", [str(tmp_path / "tb")])


def test_input_errors(tmp_path):
    empty = _write_csv(str(tmp_path / "empty.csv"), [])
    with pytest.raises(cmp.CompareError, match="empty"):
        cmp.load_run("e", [empty])
    bad = tmp_path / "bad.csv"
    bad.write_text("step,value\n1,2\n")
    with pytest.raises(cmp.CompareError, match="'step' and 'loss'"):
        cmp.load_run("b", [str(bad)])
    with pytest.raises(cmp.CompareError, match="no such file"):
        cmp.load_run("m", [str(tmp_path / "missing")])
    with pytest.raises(cmp.CompareError, match="no TensorBoard event files"):
        os.makedirs(tmp_path / "nothing")
        cmp.load_run("n", [str(tmp_path / "nothing")])


def test_nonfinite_reports_first_bad_step(tmp_path):
    rows = [(s, 5.0) for s in range(1, 10)] + [(10, float("nan")), (11, float("inf")), (12, 5.0)]
    path = _write_csv(str(tmp_path / "nan.csv"), rows)
    with pytest.raises(cmp.CompareError, match=r"nan at step 10 \(first non-finite"):
        cmp.load_run("nan", [path])
    curve = cmp.load_run("nan", [path], allow_nonfinite=True)
    assert curve.steps == list(range(1, 10))


def test_ema_is_tensorboards_debiased_ema():
    assert cmp.ema([2.0] * 5, 0.9) == pytest.approx([2.0] * 5)
    xs = [1.0, 3.0, 2.0]
    a = 0.5
    # by hand: debiased weights
    s1 = 1.0
    s2 = (a * (1 - a) * 1.0 + (1 - a) * 3.0) / (1 - a * a)
    s3 = (a * a * (1 - a) * 1.0 + a * (1 - a) * 3.0 + (1 - a) * 2.0) / (1 - a ** 3)
    assert cmp.ema(xs, a) == pytest.approx([s1, s2, s3])
    assert cmp.ema(xs, 0.0) == xs
    with pytest.raises(cmp.CompareError):
        cmp.ema(xs, 1.0)


def _two_runs(tmp_path, shift=0.0, shift_from=0, steps=range(1, 101)):
    base = _curve(steps, _loss, seed=1)
    other = [(s, x + (shift if s >= shift_from else 0.0)) for s, x in _curve(steps, _loss, seed=1)]
    a = _write_csv(str(tmp_path / "base" / "metrics.csv"), base)
    b = _write_csv(str(tmp_path / "other" / "metrics.csv"), other)
    return os.path.dirname(a), os.path.dirname(b)


def test_stats_and_first_exceed_step(tmp_path):
    a, b = _two_runs(tmp_path, shift=0.2, shift_from=60)
    curves = [cmp.load_run("base", [a]), cmp.load_run("other", [b])]
    stats, gates = cmp.compare_runs(curves, alpha=0.0, tolerance=0.1)
    base, other = stats
    assert base.mean_abs_delta is None and other.compared == 100
    assert other.max_abs_delta == pytest.approx(0.2) and other.first_exceed_step == 60
    assert other.mean_abs_delta == pytest.approx(0.2 * 41 / 100)
    assert other.final_loss == pytest.approx(curves[1].loss[-1])
    assert base.min_step == min(zip(curves[0].loss, curves[0].steps))[1]
    assert gates == []
    # smoothing delays the crossing but does not remove it
    stats, _ = cmp.compare_runs(curves, alpha=0.9, tolerance=0.1)
    assert stats[1].first_exceed_step > 60


def test_gate_exit_codes(tmp_path, capsys):
    a, b = _two_runs(tmp_path, shift=0.2, shift_from=60)
    out = str(tmp_path / "out")
    assert cmp.main([a, b, "--out", out, "--ema", "0", "--max-delta", "0.3", "--no-plot"]) == 0
    assert cmp.main([a, b, "--out", out, "--ema", "0", "--max-delta", "0.1", "--no-plot"]) == 1
    err = capsys.readouterr().err
    assert "GATE FAILED: other vs base: first step over the limit 60" in err
    # relative gate, Megatron style: 0.2 / ~3.1 > 5 %
    assert cmp.main([a, b, "--out", out, "--ema", "0", "--rtol", "0.05", "--no-plot"]) == 1
    assert cmp.main([a, b, "--out", out, "--ema", "0", "--rtol", "0.1", "--no-plot"]) == 0
    rows = list(csv.DictReader(open(os.path.join(out, "gates.csv"))))
    assert rows[0]["run"] == "other" and rows[0]["passed"] == "True"


def test_gate_pairs_against_own_reference(tmp_path):
    steps = range(1, 51)
    soft = _write_csv(str(tmp_path / "soft.csv"), [(s, _loss(s) - 0.5) for s in steps])
    ref = _write_csv(str(tmp_path / "ref.csv"), [(s, _loss(s)) for s in steps])
    fused = _write_csv(str(tmp_path / "fused.csv"), [(s, _loss(s) + 0.01) for s in steps])
    args = [f"softmax={soft}", f"ssa_reference={ref}", f"ssa_triton={fused}", "--ema", "0", "--no-plot",
            "--out", str(tmp_path / "o")]
    # softmax vs SSA is shown, not gated: only the fused kernel vs its reference
    assert cmp.main(args + ["--gate", "ssa_triton=ssa_reference", "--max-delta", "0.05"]) == 0
    assert cmp.main(args + ["--max-delta", "0.05"]) == 1  # default gates everything vs baseline
    assert cmp.main(args + ["--gate", "ssa_triton=nope", "--max-delta", "0.05"]) == 2
    assert cmp.main(args + ["--gate", "ssa_triton=ssa_reference"]) == 2  # no threshold


def test_mismatched_ranges(tmp_path, capsys):
    a = _write_csv(str(tmp_path / "a.csv"), [(s, 1.0) for s in range(1, 101)])
    b = _write_csv(str(tmp_path / "b.csv"), [(s, 1.0) for s in range(1, 51)])
    c = _write_csv(str(tmp_path / "c.csv"), [(s, 1.0) for s in range(200, 300)])
    o = ["--no-plot", "--out", str(tmp_path / "o")]
    assert cmp.main([a, b] + o) == 2
    assert "mismatched step ranges" in capsys.readouterr().err
    assert cmp.main([a, b, "--common-range"] + o) == 0
    assert cmp.main([a, c, "--common-range"] + o) == 2
    assert "share no logged step" in capsys.readouterr().err
    assert cmp.main([a, f"x={a}", "--baseline", "zzz"] + o) == 2
    assert cmp.main([a, a] + o) == 2  # duplicate labels


def test_outputs_plots_and_summary(tmp_path):
    steps = list(range(1, 41))
    a = _write_csv(str(tmp_path / "softmax" / "metrics.csv"), [(s, _loss(s)) for s in steps])
    b = _write_csv(str(tmp_path / "ssa" / "metrics.csv"),
                   [(s, _loss(s) + 0.02, 1.5 + s / 1e3, 1.5 - s / 1e3) for s in steps], n_layers=2)
    out = tmp_path / "cmp"
    assert cmp.main([os.path.dirname(a), os.path.dirname(b), "--out", str(out), "--max-delta", "0.1"]) == 0
    for name in ("loss.png", "ssa_n.png", "summary.md", "summary.csv", "gates.csv", "compare.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "summary.md").read_text()
    assert "| softmax |" in md and "| ssa |" in md and "PASS" in md
    rows = {r["run"]: r for r in csv.DictReader(open(out / "summary.csv"))}
    assert float(rows["ssa"]["max_abs_delta"]) == pytest.approx(0.02, abs=1e-9)
    assert json.load(open(out / "compare.json"))["baseline"] == "softmax"
    # no SSA run -> no n plot
    out2 = tmp_path / "cmp2"
    assert cmp.main([os.path.dirname(a), f"again={a}", "--out", str(out2)]) == 0
    assert not (out2 / "ssa_n.png").exists()


@pytest.mark.parametrize("entry", [["scripts/compare_losses.py"], ["-m", "nemo_ssa", "compare"]])
def test_cli_entry_points(tmp_path, entry):
    a, b = _two_runs(tmp_path, shift=0.5, shift_from=1)
    proc = subprocess.run([sys.executable, *entry, a, b, "--no-plot", "--max-delta", "0.1",
                           "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "| other |" in proc.stdout and "GATE FAILED" in proc.stderr


def test_pairs_are_shown_not_gated(tmp_path):
    steps = range(1, 51)
    ref = _write_csv(str(tmp_path / "ref.csv"), [(s, _loss(s)) for s in steps])
    seed2 = _write_csv(str(tmp_path / "seed2.csv"), [(s, _loss(s) + 0.3) for s in steps])
    fused = _write_csv(str(tmp_path / "fused.csv"), [(s, _loss(s) + 0.01) for s in steps])
    out = tmp_path / "o"
    rc = cmp.main([f"ref={ref}", f"seed2={seed2}", f"fused={fused}", "--ema", "0", "--out", str(out),
                   "--pair", "seed2=ref", "--gate", "fused=ref", "--max-delta", "0.05"])
    assert rc == 0  # the 0.3 seed-to-seed gap is reported, not gated
    rows = {r["run"]: r for r in csv.DictReader(open(out / "gates.csv"))}
    assert rows["seed2"]["passed"] == "" and float(rows["seed2"]["max_abs_delta"]) == pytest.approx(0.3)
    assert rows["fused"]["passed"] == "True"
    assert "| seed2 | ref |" in (out / "summary.md").read_text() and "shown" in (out / "summary.md").read_text()


def test_segment_column_splits_a_resume_without_overlap(tmp_path):
    from nemo_ssa.tools.metrics_log import MetricsWriter

    run = str(tmp_path / "run")
    for first, last in ((1, 5), (6, 9)):  # resumed exactly after the last logged step
        w = MetricsWriter(run, append=first > 1, tensorboard=False)
        for s in range(first, last + 1):
            w.write(step=s, loss=10.0 - s, lr=1e-3, tokens_per_s=1.0)
        w.close()
    rows = list(csv.DictReader(open(os.path.join(run, "metrics.csv"))))
    assert [r["segment"] for r in rows] == ["1"] * 5 + ["2"] * 4
    curve = cmp.load_run("run", [run])
    assert [(a, b) for _, a, b in curve.segments] == [(1, 5), (6, 9)] and curve.overlaps == []
    assert curve.steps == list(range(1, 10))
