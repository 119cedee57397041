"""profile_summary on a synthetic chrome trace: step windows, idle attribution, the sync table."""

from nemo_ssa.tools.profile_summary import call_site, summarize


def _x(name, ts, dur, cat, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "pid": 1}


def _trace():
    ev = []
    for i, t0 in enumerate((0.0, 10_000.0)):  # two 10 ms steps
        ev.append(_x(f"ProfilerStep#{i}", t0, 9_900.0, "user_annotation"))
        # the profiler writes the step on the GPU's timeline too, starting when the GPU gets there
        ev.append(_x(f"ProfilerStep#{i}", t0 + 2_000.0, 9_000.0, "gpu_user_annotation", tid=7))
        ev.append(_x("gemm", t0 + 1_000.0, 4_000.0, "kernel", tid=7))
        # an .item() in the grad-norm code: python frames around a stream sync
        ev.append(_x("megatron/core/optimizer/optimizer.py(200): clip_grad_norm", t0 + 5_000.0, 1_500.0, "python_function"))
        ev.append(_x("megatron/core/optimizer/clip_grads.py(133): get_grad_norm_fp32", t0 + 5_100.0, 1_300.0, "python_function"))
        ev.append(_x("torch/_tensor.py(1): item", t0 + 5_200.0, 1_100.0, "python_function"))
        ev.append(_x("cudaStreamSynchronize", t0 + 5_300.0, 900.0, "cuda_runtime"))
        # a lightning log with a blocking copy, in step 1 only
        if i == 1:
            ev.append(_x("lightning/pytorch/core/module.py(380): log", t0 + 7_000.0, 500.0, "python_function"))
            ev.append(_x("cudaStreamSynchronize", t0 + 7_100.0, 100.0, "cuda_runtime"))
        # a launch is no sync
        ev.append(_x("cudaLaunchKernel", t0 + 8_000.0, 5.0, "cuda_runtime"))
    return ev


def test_steps_are_the_host_annotations_only():
    out = summarize(_trace())
    rows = [line for line in out.splitlines() if line.startswith("| ProfilerStep#")]
    assert len(rows) == 2, out
    assert rows[0].split("|")[2].strip() == "10.00"  # wall: this step's start to the next one's
    assert rows[0].split("|")[4].strip() == "4.00"  # GPU busy


def test_sync_table_counts_and_names_call_sites():
    out = summarize(_trace())
    assert "1.5 per step, 0.95 ms waited per step" in out, out
    rows = [line for line in out.splitlines() if "cudaStreamSynchronize:" in line]
    assert len(rows) == 2, out
    assert rows[0].startswith("| 1.0 | 0.900 | cudaStreamSynchronize: megatron/core/optimizer/clip_grads.py(133): "
                              "get_grad_norm_fp32 <- megatron/core/optimizer/optimizer.py(200): clip_grad_norm"), rows
    assert rows[1].startswith("| 0.5 | 0.050 | cudaStreamSynchronize: lightning/pytorch/core/module.py(380): log"), rows
    assert "cudaLaunchKernel" not in out


def test_no_sync_says_so():
    ev = [e for e in _trace() if e["name"] != "cudaStreamSynchronize"]
    assert "0.0 per step, 0.00 ms waited per step" in summarize(ev)


def test_call_site_skips_plumbing():
    frames = ["a.py(1): step", "b.py(2): clip", "torch/_tensor.py(3): item", "<built-in method item>"]
    assert call_site(frames) == "b.py(2): clip <- a.py(1): step"
    assert call_site(["torch/x.py(1): f"]) == "(no Python frame)"


def test_op_table_counts_a_per_tensor_loop_by_call_site():
    """Three copies per step from one loop (each with a nested op that must not count twice),
    one norm elsewhere: the loop's row says 3.0 per step and names its frame."""
    ev = _trace()
    for t0 in (0.0, 10_000.0):
        ev.append(_x("megatron/core/optimizer/optimizer.py(77): _copy_this_to_that", t0 + 8_100.0, 400.0,
                     "python_function"))
        for k in range(3):
            ev.append(_x("aten::copy_", t0 + 8_120.0 + 100.0 * k, 50.0, "cpu_op"))
            ev.append(_x("aten::empty", t0 + 8_130.0 + 100.0 * k, 10.0, "cpu_op"))  # inside the copy
        ev.append(_x("aten::_foreach_norm", t0 + 9_000.0, 30.0, "cpu_op"))
    out = summarize(ev)
    assert "Host ops on the main thread (outermost only): 4 per step, 0.18 ms" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| 3.0 |")]
    assert rows == ["| 3.0 | 0.150 | aten::copy_: megatron/core/optimizer/optimizer.py(77): _copy_this_to_that |"], out
    assert "| 1.0 | 0.030 | aten::_foreach_norm: (no Python frame) |" in out
    assert "| per step | op ms per step | call site (innermost first) |" in out
    assert "aten::empty" not in out
