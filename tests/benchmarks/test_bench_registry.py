"""benchmarks/registry.py and benchmarks/run.py on CPU: the registry's entries and shapes,
``--list``, the dry run's agreement check (and that it fails on a wrong callable), ``--ab``
against a worktree of HEAD, the no-CUDA refusal of a timing run, and the host timer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks import bench_attention, registry, run  # noqa: E402

RUN = os.path.join(REPO, "benchmarks", "run.py")


def _run(*args, env=None, timeout=300):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, RUN, *args], capture_output=True, text=True, timeout=timeout, env=e,
                          cwd=REPO)


def test_registry_has_the_recipe_shape_and_the_scripts_rows():
    att = registry.get("attention")
    recipe = registry.shapes("attention", "recipe")
    assert [(s.B, s.Hq, s.Hkv, s.N, s.D) for s in recipe] == [(8, 24, 8, 1024, 32), (32, 24, 8, 1024, 32)]
    # the attention rows are bench_attention.py's, timed against SDPA in the same process
    names = {e.name for e in att.entries}
    assert names <= set(bench_attention.ROWS) and {"softmax_triton", "ssa_triton", "sdpa_cudnn"} <= names
    assert all(e.baseline in names for e in att.entries if e.baseline)
    nsa = registry.get("nsa")
    assert {"nsa_layer", "compressed", "selection", "selected", "window", "sdpa_flash"} <= {e.name for e in nsa.entries}
    assert registry.shapes("nsa", "recipe")[0].D == 32
    for op in registry.REGISTRY:
        for s in ("recipe", "wide", "long", "tiny"):
            assert registry.shapes(op, s), (op, s)
    assert any(s.D == 128 for s in registry.shapes("attention", "wide"))
    assert max(s.N for s in registry.shapes("nsa", "long")) >= 65536
    with pytest.raises(KeyError, match="unknown benchmark op"):
        registry.get("nope")
    with pytest.raises(KeyError, match="no shape set"):
        registry.shapes("attention", "huge")


def test_list_runs_on_cpu():
    proc = _run("--list")
    assert proc.returncode == 0, proc.stderr
    assert "recipe (B8-N1024-HQ24-HKV8-D32)" in proc.stdout and "ssa_triton" in proc.stdout
    assert "nsa_layer" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_timing_without_cuda_says_so():
    proc = _run("--op", "attention", "--shape", "recipe")
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr


def test_dry_run_agrees_at_tiny_shapes():
    rows = run.dry_run([registry.get("attention"), registry.get("nsa")], only="softmax_triton,ssa_triton,window")
    by = {(r["op"], r["impl"]): r for r in rows}
    assert set(by) == {("attention", "softmax_triton"), ("attention", "ssa_triton"), ("nsa", "window")}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-4


def test_dry_run_fails_on_a_wrong_callable(monkeypatch):
    real = bench_attention.row_fn

    def wrong(name, causal, q, k, v, n, b):
        fn, extra, note = real(name, causal, q, k, v, n, b)
        if name != "ssa_triton":
            return fn, extra, note
        return (lambda q, k, v: fn(q, k, v) * 1.01), extra, note  # 1% off: must fail

    monkeypatch.setattr(bench_attention, "row_fn", wrong)
    rows = run.dry_run([registry.get("attention")], only="softmax_triton,ssa_triton")
    status = {r["impl"]: r["status"] for r in rows}
    assert status == {"softmax_triton": "ok", "ssa_triton": "FAIL"}


def test_dry_run_fails_when_a_kernel_cannot_be_built(monkeypatch):
    def broken(name, *a):
        raise RuntimeError("kernel missing")

    monkeypatch.setattr(bench_attention, "row_fn", broken)
    rows = run.dry_run([registry.get("attention")], only="ssa_triton,sdpa_cudnn")
    status = {r["impl"]: r["status"] for r in rows}
    # a kernel that cannot be built fails; a CUDA-only baseline is skipped with its reason
    assert status == {"ssa_triton": "FAIL", "sdpa_cudnn": "skip"}


@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(REPO, ".git")),
                    reason="needs git and a checkout")
def test_ab_dry_run_from_a_worktree_of_head(tmp_path):
    before = subprocess.run(["git", "-C", REPO, "worktree", "list"], capture_output=True, text=True).stdout
    proc = _run("--dry-run", "--op", "attention", "--only", "ssa_triton", "--ab", "HEAD", "--out",
                str(tmp_path / "ab.md"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the ref's run imported nemo_ssa from the worktree, not from this checkout
    headers = [ln for ln in proc.stdout.splitlines() if ln.startswith("# benchmarks/run.py")]
    assert any("nemo_ssa from " in h and "nemo_ssa_ab_" in h.split("nemo_ssa from ")[1] for h in headers), headers
    assert "A/B: this tree vs HEAD" in proc.stdout
    table = (tmp_path / "ab.md").read_text()
    assert "status_ref" in table
    line = next(ln for ln in table.splitlines() if "ssa_triton" in ln)
    assert line.count(" ok ") == 2
    after = subprocess.run(["git", "-C", REPO, "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before  # the worktree is removed


def test_merge_ab_ratios():
    here = [dict(op="a", shape="s", impl="k", mode="fwd", ms=2.0, x_base=1.0, note="")]
    ref = [dict(op="a", shape="s", impl="k", mode="fwd", ms=4.0, x_base=2.0, note="")]
    m = run.merge_ab(here, ref, dry=False)
    assert m[0]["here/ref"] == 0.5 and m[0]["ms_ref"] == 4.0 and m[0]["x_base_ref"] == 2.0


def test_shared_baselines_are_timed_once():
    """softmax_triton and ssa_triton share sdpa_cudnn: it is timed (and printed) once, after them."""
    bench = registry.get("attention")
    assert run.needed(bench, ["softmax_triton", "ssa_triton"]) == ["softmax_triton", "ssa_triton", "sdpa_cudnn"]
    assert run.needed(bench, ["sdpa_cudnn", "softmax_triton", "softmax_triton"]) == ["sdpa_cudnn", "softmax_triton"]
    assert run.needed(bench, ["sdpa_flash"]) == ["sdpa_flash", "sdpa_cudnn"]


def test_ratios_against_the_baseline():
    rows = [dict(op="a", shape="s", impl="k", mode="fwd", baseline="b", ms=3.0),
            dict(op="a", shape="s", impl="b", mode="fwd", baseline="", ms=2.0)]
    run._ratios(rows)
    assert rows[0]["x_base"] == 1.5 and rows[1]["x_base"] != rows[1]["x_base"]  # NaN: no baseline


def test_ab_takes_a_directory_holding_a_tree(tmp_path):
    """``--ab DIR`` (a tree unpacked without git, as on the lent GPUs) is used as it is and
    left in place; a directory without ``nemo_ssa/`` is refused by name."""
    from benchmarks.ab import worktree

    tree = tmp_path / "ref"
    (tree / "nemo_ssa").mkdir(parents=True)
    with worktree(str(tree)) as (tmp, wt):
        assert wt == str(tree) and os.path.isdir(tmp)
    assert not os.path.exists(tmp) and (tree / "nemo_ssa").is_dir()
    with pytest.raises(SystemExit, match="no nemo_ssa/ package"):
        with worktree(str(tmp_path)):
            pass


def test_host_timer_is_the_median_of_single_synchronized_calls():
    # --timer host: each call starts after a sync and only its own CPU time counts; a call
    # that is slow once in a while must not move the median, and every call is synced first
    from benchmarks import timing

    syncs, calls = [], []

    def fn():
        calls.append(1)
        time.sleep(0.02 if len(calls) % 7 == 0 else 0.001)

    ms = timing.host_ms(fn, n=21, warmup=2, sync=lambda: syncs.append(len(calls)))
    assert len(calls) == 23 and len(syncs) == 22  # one sync before each timed call, one at the end
    assert syncs[:21] == list(range(2, 23))
    assert 0.9 <= ms < 10, ms


def test_enqueue_timer_sizes_the_wait_times_calls_behind_it_and_counts_late_samples():
    # --timer enqueue: every sample starts a device wait sized from the first estimate (3x the
    # calls' host time, at least 5 ms), times `calls` calls issued behind it, and counts the
    # samples whose wait had ended before the calls were issued (a sync inside the call)
    from benchmarks import timing

    log, waits = [], []

    def fn():
        log.append("call")
        time.sleep(0.001)

    def busy(ms):
        waits.append(ms)
        log.append("busy")
        sample = len(waits)
        return lambda: sample % 4 != 0  # every fourth sample: the device went idle first

    ms, late = timing.enqueue_ms(fn, calls=5, reps=9, warmup=2, busy=busy, sync=lambda: log.append("sync"))
    assert 0.9 <= ms < 10, ms
    assert late == 2  # samples 4 and 8 of 9
    assert len(waits) == 9 and all(w == waits[0] for w in waits) and waits[0] >= 3 * 5 * 0.9
    # warm-up, sync, estimate, sync; then per sample: the wait, the calls, a sync
    assert log[:2] == ["call"] * 2 and log[2] == "sync" and log[3:8] == ["call"] * 5 and log[8] == "sync"
    assert log[9:16] == ["busy"] + ["call"] * 5 + ["sync"]
    assert log.count("call") == 2 + 5 + 9 * 5


def test_enqueue_timer_waits_at_least_five_ms_for_a_cheap_call():
    from benchmarks import timing

    waits = []
    timing.enqueue_ms(lambda: None, calls=3, reps=1, warmup=1,
                      busy=lambda ms: waits.append(ms) or (lambda: True), sync=lambda: None)
    assert waits == [5.0]


def test_run_takes_the_host_timer_and_refuses_an_unknown_one():
    from benchmarks import run

    assert run.parse_args(["--timer", "host"]).timer == "host"
    assert run.parse_args(["--timer", "enqueue"]).timer == "enqueue"
    assert run.parse_args(["--timer", "kernel"]).timer == "kernel"
    assert run.parse_args([]).timer == "wall"
    with pytest.raises(SystemExit):
        run.parse_args(["--timer", "gpu"])


def test_kernel_timer_sums_device_activity_only():
    """--timer kernel: the profiler events of the device count (kernels, copies), the host's
    (the CPU ops that launched them) do not."""
    import types

    import torch

    from benchmarks import timing

    dev, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [types.SimpleNamespace(device_type=dev, device_time=30.5), types.SimpleNamespace(device_type=cpu, device_time=0.0),
          types.SimpleNamespace(device_type=dev, device_time=12.0), types.SimpleNamespace(device_type=cpu, device_time=99.0)]
    assert timing.device_us(ev) == 42.5
    assert timing.device_us([]) == 0


def test_rope_dry_run_checks_every_output_of_the_tuple(monkeypatch):
    """The rope op returns (q, k, v): the dry run agrees on all three, and fails when only
    the last of them (v) is wrong -- the worst of the tuple counts, not the first."""
    import nemo_ssa.ops.rope as rope

    rows = run.dry_run([registry.get("rope")])
    assert {r["impl"]: r["status"] for r in rows} == {"rope_torch": "ok", "rope_qkv_triton": "ok"}, rows
    real = rope.rope_layout_qkv_triton

    def v_off(*a, **k):
        q, k_, v = real(*a, **k)
        return q, k_, v * 1.01
    monkeypatch.setattr(rope, "rope_layout_qkv_triton", v_off)
    rows = run.dry_run([registry.get("rope")])
    assert {r["impl"]: r["status"] for r in rows} == {"rope_torch": "ok", "rope_qkv_triton": "FAIL"}, rows
