"""scripts/device/two_gpu.py: the checks on synthetic run logs -- each gate passes on
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
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "device"))

import two_gpu  # noqa: E402

from nemo_ssa.tools.metrics_log import write_rank_file  # noqa: E402

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
    rc, md = _check(tmp_path, p)
    assert rc == 0, md
    assert "| dp: ssa-dp2 speed | reported | 190,000 vs 100,000 tokens/s of ssa-1gpu (1.90x) |" in md
    assert "| dp: ssa-dp2 n on every rank | PASS | 2 rank(s) identical" in md


def _speed_part(tmp_path, name, ssa_rate=190_000.0, with_ref=True):
    p = _part(tmp_path, name, part="speed")
    if with_ref:
        _run_dir(p, "ssa-1gpu-b32")
    _run_dir(p, "softmax-1gpu-b32")
    _run_dir(p, "ssa-dp2-speed", world=2, rate=ssa_rate)
    _run_dir(p, "softmax-dp2", world=2, rate=185_000.0)
    return p


@pytest.mark.parametrize("fault", [None, "slow", "reference_elsewhere"])
def test_speed_gate_is_weak_scaling_on_one_machine(tmp_path, fault):
    dp = _part(tmp_path, "dp")
    _run_dir(dp, "softmax-1gpu")
    if fault == "reference_elsewhere":  # a reference from another part (machine) is not used
        _run_dir(dp, "ssa-1gpu-b32")
    p = _speed_part(tmp_path, str(fault), ssa_rate=150_000.0 if fault == "slow" else 190_000.0,
                    with_ref=fault != "reference_elsewhere")
    out = tmp_path / "out"
    rc = two_gpu.main(["check", str(dp), str(p), "--out", str(out), "--no-plot"])
    md = (out / "two_gpu.md").read_text()
    failed = [line for line in md.splitlines() if "| FAIL |" in line]
    assert ("| speed: softmax-dp2 speed >= 1.8x one GPU at the same per-GPU batch | PASS | 185,000 vs 100,000 "
            "tokens/s of softmax-1gpu-b32") in md
    assert "softmax-dp2 loss vs softmax-1gpu | PASS" in md  # the loss reference comes from the dp part
    if fault is None:
        assert rc == 0 and not failed, md
    else:
        assert rc == 1 and len(failed) == 1 and "ssa-dp2-speed speed" in failed[0], md


@pytest.mark.parametrize("crowded", [False, True])
def test_a_speed_reference_run_beside_others_is_called_a_lower_bound(tmp_path, crowded):
    p = _speed_part(tmp_path, "speed")
    stage1 = [{"label": "ssa-1gpu-b32", "run": "ssa-1gpu-b32"}]
    if crowded:  # the 1-GPU reference shared its stage (and host) with another run
        stage1.append({"label": "softmax-1gpu-b32", "run": "softmax-1gpu-b32"})
    plan = [stage1, [{"label": "ssa-dp2-speed", "run": "ssa-dp2-speed"}]]
    jobs = [{"label": j["label"], "rc": 0} for st in plan for j in st]
    (p / "runs.json").write_text(json.dumps({"part": "speed", "plan": plan, "jobs": jobs}))
    rc, md = _check(tmp_path, p)
    line = next(x for x in md.splitlines() if "ssa-dp2-speed speed" in x)
    assert ("ssa-1gpu-b32 ran beside 1 other run(s) on the host: its rate is a lower bound" in line) == crowded, line


@pytest.mark.parametrize("fault", ["loss", "rank_n"])
def test_dp_part_fails_on_a_planted_fault(tmp_path, fault):
    p = _part(tmp_path, fault)
    _run_dir(p, "ssa-1gpu")
    d = _run_dir(p, "ssa-dp2", world=2, offset=0.1 if fault == "loss" else 0.0, rate=190_000.0)
    if fault == "rank_n":  # rank 1's n of layer 2 one ulp away
        rec = json.load(open(d / "ranks" / "rank_00001.json"))
        rec["n"]["2"] = math.nextafter(N[2], 2.0).hex()
        (d / "ranks" / "rank_00001.json").write_text(json.dumps(rec))
    rc, md = _check(tmp_path, p)
    assert rc == 1, md
    failed = [line for line in md.splitlines() if "| FAIL |" in line]
    want = {"loss": "ssa-dp2 loss", "rank_n": "ssa-dp2 n on every rank"}[fault]
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
    assert labels == {"ssa-1gpu", "softmax-1gpu", "ssa-dp2", "softmax-dp2", "ssa-2node", "ssa-2node.n1",
                      "ssa-dp2to1", "ssa-tp2sp", "ssa-tp2to1", "ssa-cp2", "ssa-1gpu-b32", "softmax-1gpu-b32",
                      "ssa-dp2-speed",
                      # four GPUs (issue 46)
                      "ssa-1gpu-g128", "softmax_triton-1gpu-g128", "ssa-dp4", "ssa-dp4-kill", "ssa-dp4to2",
                      "ssa-dp4to1", "ssa-1gpu-16k", "ssa-1gpu-32k", "softmax_triton-1gpu-16k", "ssa-tp2dp2",
                      "softmax_triton-tp2dp2", "ssa-cp2dp2-16k", "softmax_triton-cp2dp2-16k", "ssa-cp2dp2-32k",
                      "ssa-tp2-g128", "ssa-1gpu-g128-mb16", "ssa-1gpu-g128-unfused",
                      "softmax_triton-1gpu-g128-unfused",
                      # eight GPUs (issue 45)
                      "ssa-1gpu-g256", "softmax_triton-1gpu-g256", "ssa-dp8", "softmax_triton-dp8", "ssa-2x4",
                      "ssa-2x4.n1", "ssa-2x4to1", "ssa-1gpu-32k-g4", "ssa-tp2dp4", "ssa-tp4dp2",
                      "ssa-cp2dp4-32k"}
    # every gated four-GPU run has its reference in the plan, and every gate label is a planned run
    for run, ref in {**two_gpu.REFERENCE_OF, **two_gpu.RESUMED, **two_gpu.SPEED_REF_OF,
                     **two_gpu.IMPLEMENTATION_GAP_OF}.items():
        assert run in labels and ref in labels, (run, ref)
    dp4 = [j for stage in two_gpu.plan("dp4", "/s", cpu=False) for j in stage]
    kill = [j for j in dp4 if j.kill]
    assert len(kill) == 1 and kill[0].kill == (2, two_gpu.KILL_AT) and "--nproc-per-node=4" in " ".join(kill[0].launches[0])
    assert {j.copy_from for j in dp4 if j.copy_from} == {"ssa-dp4-kill"}
    cp = [j for stage in two_gpu.plan("layouts4", "/s", cpu=False) for j in stage if j.label == "ssa-cp2dp2-32k"]
    assert "train.seq_length=32768" in " ".join(cp[0].launches[0]) and "train.context_parallel=2" in " ".join(cp[0].launches[0])
    tp = [j for stage in two_gpu.plan("tp_cp", "/s", cpu=False) for j in stage if j.label == "ssa-tp2sp"]
    cmd = " ".join(tp[0].launches[0])
    assert "train.tensor_parallel=2" in cmd and "train.sequence_parallel=true" in cmd and "stop_after=100" in cmd
    assert "--nproc-per-node=2" in cmd and "train.num_gpus_per_node=2" in cmd and "train.max_steps=200" in cmd
    assert "model.init_on_cpu=true" in cmd  # every layout starts from the same weights
    nodes = [j for stage in two_gpu.plan("dp", "/s", cpu=False) for j in stage if j.run == "ssa-2node"]
    assert len(nodes) == 4 and nodes[0].kill == (1, two_gpu.KILL_AT) and all(j.expect_fail for j in nodes[:2])
    for j in nodes:
        cmd = " ".join(j.launches[0])
        assert "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=localhost:" in cmd
        assert "train.num_nodes=2" in cmd and "train.num_gpus_per_node=1" in cmd
    assert {j.gpus for j in nodes[:2]} == {"0", "1"} and "resume=true" in " ".join(nodes[2].launches[0])



def test_the_eight_gpu_parts_are_whole_nodes_with_their_references_first():
    """dp8 / layouts8 (issue 45): every multi-GPU job takes the node's eight GPUs, the 1-GPU
    references run first on distinct GPUs, the global batches match their references', the
    multi-node path is two torchrun launchers of four GPUs each with a rank of the second killed,
    and the killed run's checkpoint is copied before the run resumes (a later copy would hold
    the resumed run's own checkpoints)."""
    for part in ("dp8", "layouts8"):
        stages = two_gpu.plan(part, "/s", cpu=False)
        refs = stages[0]
        assert all(j.label.split("-")[1] == "1gpu" for j in refs) and len({j.gpus for j in refs}) == len(refs)
        for stage in stages[1:]:
            for j in stage:
                cmd = " ".join(j.launches[0])
                if j.label.endswith("to1"):
                    assert j.gpus == "0" and "resume=true" in cmd
                    continue
                world = len(j.gpus.split(","))
                assert world * (2 if j.run == "ssa-2x4" else 1) == 8, j.label
                ref = two_gpu.REFERENCE_OF[j.run]
                ref_cmd = " ".join(next(r for r in refs if r.label == ref).launches[0])
                gb = re.findall(r"train.global_batch_size=(\d+)", cmd)[-1]
                assert re.findall(r"train.global_batch_size=(\d+)", ref_cmd)[-1] == gb, (j.label, ref)
    dp8 = two_gpu.plan("dp8", "/s", cpu=False)
    jobs = [j for stage in dp8 for j in stage]
    nodes = [j for j in jobs if j.run == "ssa-2x4"]
    assert len(nodes) == 4 and nodes[0].kill == (5, two_gpu.KILL_AT) and all(j.expect_fail for j in nodes[:2])
    assert [j.gpus for j in nodes] == ["0,1,2,3", "4,5,6,7"] * 2
    for j in nodes:
        cmd = " ".join(j.launches[0])
        assert "--nnodes=2" in cmd and "--nproc-per-node=4" in cmd and "--rdzv-backend=c10d" in cmd
        assert "train.num_nodes=2" in cmd and "train.num_gpus_per_node=4" in cmd
        assert "train.distributed_optimizer=true" in cmd
    order = [stage[0].label for stage in dp8]
    assert order.index("ssa-2x4to1") == order.index("ssa-2x4") + 1 and order[-1] == "ssa-2x4"
    assert "resume=true" in " ".join(dp8[-1][0].launches[0])
    dp = next(j for j in jobs if j.label == "ssa-dp8")
    assert "--nproc-per-node=8" in " ".join(dp.launches[0]) and "train.distributed_optimizer=true" in " ".join(dp.launches[0])
    assert two_gpu.SPEEDUP_TARGET["ssa-dp8"] == 7.2 and two_gpu.SPEED_REF_OF["ssa-dp8"] == "ssa-1gpu-b32"
    lay = {j.label: " ".join(j.launches[0]) for stage in two_gpu.plan("layouts8", "/s", cpu=False) for j in stage}
    assert "train.tensor_parallel=2" in lay["ssa-tp2dp4"] and "train.tensor_parallel=4" in lay["ssa-tp4dp2"]
    assert "train.context_parallel=2" in lay["ssa-cp2dp4-32k"] and "train.seq_length=32768" in lay["ssa-cp2dp4-32k"]
    assert "model.fused_mlp=false" in lay["ssa-1gpu-g128-unfused"]

def _killed_part(tmp_path, name, *, seg2_first=4, kill=True, rc=-9):
    p = _part(tmp_path, name)
    d = p / "ssa-2node"
    d.mkdir()
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "segment"])
        for s in range(1, 6):
            w.writerow([s, 5.0, 1])
        for s in range(seg2_first, 7):
            w.writerow([s, 5.0, 2])
    rec = {"rank": 1, "at_step": 5}
    if kill:
        rec.update(killed_pid=123, seen_step=5, ended_by_themselves=False)
    meta = {"part": "dp", "max_steps": 6, "ckpt_every": 3,
            "jobs": [{"label": "ssa-2node", "rc": rc, "expect_fail": True, "kill": rec}]}
    (p / "runs.json").write_text(json.dumps(meta))
    return d, meta


@pytest.mark.parametrize("fault", [None, "restarted_from_scratch", "no_kill", "exit_0"])
def test_sigkill_gate(tmp_path, fault):
    d, meta = _killed_part(tmp_path, str(fault), seg2_first=1 if fault == "restarted_from_scratch" else 4,
                           kill=fault != "no_kill", rc=0 if fault == "exit_0" else -9)
    ok, detail = two_gpu.check_killed(str(d), meta, "ssa-2node")
    assert ok == (fault is None), detail
    if fault is None:
        assert "last checkpoint 3; resumed segment: steps 4-6" in detail


@pytest.mark.slow
def test_the_dp_part_end_to_end_on_cpu(tmp_path):
    """The dp part of the GPU plan on CPU (gloo, tiny model), then the check: every gate
    passes, the two-"node" run's rank 1 SIGKILLed after step 5 resumes from its step-3
    checkpoint, and that checkpoint (distributed optimizer, DP2) also resumes on one process.
    What this adds to the layouts' own CPU tests (tests/scripts/test_parallel_cpu.py: DP2,
    TP2, TP2 + SP, CP2 against one rank, TP2 checkpoints resumed on one rank and the reverse)
    is the orchestration: stages, the kill, the copies, the archive and the check. The tp_cp
    part's orchestration is the same code (its gates: test_tp_part_checkpoint_and_resume on
    planted runs; two archives in one check: the speed-gate tests), and softmax-1gpu is the
    speed part's reference: both left out, ~45 % of this test's time on CI's two cores."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = tmp_path / "dp"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "device", "two_gpu.py"), "run", "--part", "dp",
                           "--cpu-smoke", "--out", str(out), "--scratch", str(tmp_path / "scratch_dp"), "--budget", "1200",
                           "--only", "ssa-1gpu,ssa-dp2,ssa-2node,ssa-2node.n1,ssa-dp2to1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    tgzs = [str(out / "two_gpu-dp.tgz")]
    res = tmp_path / "check"
    rc = two_gpu.main(["check", *tgzs, "--out", str(res), "--no-plot", "--from-step", "1", "--no-speed-gate"])
    md = (res / "two_gpu.md").read_text()
    failed = [line for line in md.splitlines() if "| FAIL |" in line]
    assert not failed and rc == 0, (rc, md)
    for want in ("checkpoint n = rank 0's", "ssa-dp2 loss vs ssa-1gpu | PASS", "ssa-2node loss vs ssa-1gpu | PASS",
                 "ssa-2node SIGKILL and resume | PASS | rank 1 SIGKILLed at step 5",
                 "resumed segment: steps 4-6", "ssa-dp2to1 resume | PASS", "ssa-dp2to1 n on every rank | PASS"):
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


@pytest.mark.parametrize("fault", [None, "tp_off_its_implementation"])
def test_tp_is_gated_on_its_own_implementation_and_the_fused_gap_reported(tmp_path, fault):
    # TP runs megatron's MLP and loss: its gate is the 1-GPU run on those layers; how far the
    # fused 1-GPU run sits is reported (0.08 here, above the gate's 0.05) and fails nothing
    p = _part(tmp_path, "l4", part="layouts4")
    _run_dir(p, "ssa-1gpu-g128")
    _run_dir(p, "ssa-1gpu-g128-unfused", offset=0.08)
    _run_dir(p, "ssa-tp2-g128", world=2, offset=0.08 + (0.1 if fault else 0.004))
    rc, md = _check(tmp_path, p)
    failed = [line for line in md.splitlines() if "| FAIL |" in line]
    gap = next(x for x in md.splitlines() if "ssa-1gpu-g128-unfused loss vs ssa-1gpu-g128 (other implementation)" in x)
    assert "| reported |" in gap and "max 0.0800" in gap, gap
    assert "ssa-tp2-g128 loss vs ssa-1gpu-g128 (other implementation) | reported" in md
    if fault is None:
        assert rc == 0 and not failed, md
    else:
        assert rc == 1 and len(failed) == 1 and "ssa-tp2-g128 loss vs ssa-1gpu-g128-unfused" in failed[0], md


@pytest.mark.parametrize("own_reference", [True, False])
def test_a_second_seed_is_gated_only_against_references_of_its_seed(tmp_path, own_reference):
    # `run --seed 4321` repeats jobs at another init and data order: its archive is a part of
    # its own, and a reference of seed 1234 (here 0.3 away) never stands in for a missing one
    first = _part(tmp_path, "s1234", part="layouts4")
    _run_dir(first, "softmax_triton-1gpu-g128-unfused", offset=0.3)
    _run_dir(first, "softmax_triton-tp2dp2", world=4, offset=0.3)
    second = tmp_path / "s4321"
    second.mkdir()
    (second / "runs.json").write_text(json.dumps({"part": "layouts4", "seed": 4321, "jobs": []}))
    _run_dir(second, "softmax_triton-tp2dp2", world=4, offset=0.004)
    if own_reference:
        _run_dir(second, "softmax_triton-1gpu-g128-unfused")
    out = tmp_path / "out"
    rc = two_gpu.main(["check", str(first), str(second), "--out", str(out), "--no-plot"])
    md = (out / "two_gpu.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith("| layouts4-s4321: softmax_triton-tp2dp2 loss"))
    if own_reference:
        assert rc == 0 and "| PASS |" in row, md
    else:
        assert rc == 1 and "| FAIL |" in row and "no softmax_triton-1gpu-g128-unfused in any part" in row, md
    assert "| layouts4: softmax_triton-tp2dp2 loss vs softmax_triton-1gpu-g128-unfused | PASS |" in md, md


def test_plan_takes_another_seed_for_every_job():
    stages = two_gpu.plan("layouts4", "/s", cpu=False, extra=["seed=4321"])
    launches = [cmd for stage in stages for job in stage for cmd in job.launches]
    assert launches and all(cmd.index("seed=4321") > cmd.index(f"seed={two_gpu.SEED}") for cmd in launches)
