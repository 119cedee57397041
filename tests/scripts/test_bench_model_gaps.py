"""benchmarks/bench_model.py --gaps: the idle-time report of a profiler trace. The trace
walk is pure Python, so it is checked on synthetic kernel events: overlapping kernels
(two streams) are not gaps, gaps below the threshold are ignored, and the report names
the kernels on either side of the largest gap."""

from benchmarks.bench_model import _gap_report


def _k(ts, dur, name):
    return {"cat": "kernel", "ph": "X", "ts": ts, "dur": dur, "name": name}


def test_gap_report_counts_idle_between_kernels(tmp_path):
    events = [
        _k(0, 100, "gemm_a"),
        _k(50, 100, "overlap_b"),        # second stream, overlaps: no gap
        _k(160, 10, "small_gap_c"),      # 10 us after 150: below threshold
        _k(300, 50, "after_big_gap_d"),  # 130 us idle after c
        _k(380, 20, "after_gap_e"),      # 30 us idle after d
        {"cat": "cpu_op", "ph": "X", "ts": 170, "dur": 100, "name": "host"},  # not a kernel
    ]
    out = tmp_path / "gaps.txt"
    text = _gap_report(events, str(out), "ssa fwdbwd mb 8", min_gap_us=20.0)
    head = text.splitlines()[0]
    assert "kernel span 0.4 ms" in head and "2 gaps >= 20 us totalling 0.2 ms" in head, head
    largest = text.split("largest gaps")[1].splitlines()[1]
    assert largest.split()[0] == "130" and "small_gap_c -> after_big_gap_d" in largest, largest
    assert out.read_text().startswith("ssa fwdbwd mb 8")


def test_gap_report_without_kernels(tmp_path):
    assert "no kernel events" in _gap_report([], str(tmp_path / "g.txt"), "x", 20.0)
