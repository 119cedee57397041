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


def test_format_rows_ratios_against_the_first_attention_and_parity_lines():
    """``x <baseline>`` is over the first attention of --attentions (it read nan when that was
    not 'softmax'); a variant whose loss or gradient norm moved shows in its parity line."""
    from benchmarks.bench_model import format_rows

    def row(att, cg, tps, loss, gn):
        return dict(attention=att, mode="fwdbwd", mb=8, ms=1e3 * 8192 / tps, tokens_s=tps, fused_ln="false",
                    cuda_graph=cg, mfu=0.1, peak_gib=1.0, loss=loss, grad_norm=gn)

    rows = [row("softmax_triton", "none", 100.0, 10.0, 2.0), row("softmax_triton", "local", 200.0, 10.0, 2.0),
            row("ssa_triton", "none", 50.0, 10.5, 3.0), row("ssa_triton", "local", 150.0, 10.6, 3.3)]
    md = format_rows(rows, [("false", "none"), ("false", "local")], "softmax_triton")
    lines = md.splitlines()
    assert "x softmax_triton" in lines[0] and "nan" not in md
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines[2:6]]
    assert [c[7] for c in cells] == ["1.00", "1.00", "0.50", "0.75"]   # vs the baseline attention, same variant
    assert [c[8] for c in cells] == ["1.00", "2.00", "1.00", "3.00"]   # vs the same attention's first variant
    par = [ln for ln in lines if ln.startswith("- parity")]
    assert len(par) == 2
    assert "loss +0.00e+00, grad norm +0.00e+00" in par[0]
    assert "loss +1.00e-01" in par[1] and "grad norm +1.00e-01 relative" in par[1]
