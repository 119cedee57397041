"""The multi-GPU runs of the parallel paths on one 2-GPU machine: train, bring the small
files back, check. docs/two-gpu.md has the plan, the device calls and the gates.

On a 2-GPU machine (nvidia-h100-x2 / nvidia-h200-x2), one device command per part::

    python scripts/device/two_gpu.py run --part dp --out $OUT/dp         # DP2, two launchers + SIGKILL, resumes
    python scripts/device/two_gpu.py run --part tp_cp --out $OUT/tp_cp   # TP2+SP stop/resume, TP2 -> 1, CP2
    python scripts/device/two_gpu.py run --part speed --out $OUT/speed   # weak-scaling speed on one machine

Here, on what came back::

    python scripts/device/two_gpu.py check <files_at>/dp/two_gpu-dp.tgz <...tp_cp.tgz> <...speed.tgz> \\
        --out docs/results/<date>-two-gpu

``python scripts/device/two_gpu.py plan`` prints every command and runs nothing; ``--cpu-smoke``
runs a part on CPU (gloo, the tiny model, six steps; tests/scripts/test_two_gpu.py).

Every run is the 114M recipe through ``scripts/pretrain.py`` (local corpus, bf16, seq 1024,
``train=gpu_9min``, ``model.init_on_cpu=true``), 200 steps, seed 1234, global batch 64 of
micro batch 32, so every layout trains on the same samples in the same order (one GPU
accumulates two micro batches). The "two nodes" are two ``torchrun --nnodes=2`` launchers
with one GPU each and a c10d rendezvous on localhost; one of them loses a rank to SIGKILL
mid-run and both resume from the last complete checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

STEPS, STOP = 200, 100
KILL_AT = 130  # the two-node run: global rank 1 SIGKILLed once step >= KILL_AT (checkpoint every STOP)
SEED = 1234
GPU_COMMON = ["train=gpu_9min", f"train.max_steps={STEPS}", "train.micro_batch_size=32", "train.global_batch_size=64",
              f"train.val_check_interval={STOP}", "train.limit_val_batches=1", "compare_to=[]", f"seed={SEED}",
              "model.init_on_cpu=true",  # every layout starts from the identical weights
              # one GPU would take graphs under auto and the layouts it is compared with would not
              "model.cuda_graphs=none"]
CPU_STEPS, CPU_STOP = 6, 3
CPU_KILL_AT = 5
CPU_COMMON = [f"train.max_steps={CPU_STEPS}", "train.seq_length=32", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.log_every_n_steps=1", "model.cpu_arch.hidden_size=32",
              "model.cpu_arch.ffn_hidden_size=64", "data.vocab_size=512", "data.max_bytes=400000",
              "train.distributed_optimizer=auto", "compare_to=[]", f"seed={SEED}"]
KEEP = ("metrics.csv", "summary.json", "config.yaml", "complete.json", "cpu_run.json")
MAX_DELTA, EMA, FROM_STEP, GOLDEN_RTOL = 0.05, 0.9, 50, 0.05
REFERENCE_OF = {"ssa-dp2": "ssa-1gpu", "softmax-dp2": "softmax-1gpu", "ssa-tp2sp": "ssa-1gpu",
                "ssa-cp2": "ssa-1gpu", "ssa-2node": "ssa-1gpu",
                # four GPUs (issue 46): every layout at global batch 128 (CP: 2 sequences of 16K/32K)
                "ssa-dp4": "ssa-1gpu-g128", "ssa-dp4-kill": "ssa-1gpu-g128",
                # TP runs megatron's MLP and output layer + loss (the fused MLP and cross entropy
                # refuse TP/SP): its gate is one GPU on that same implementation; the fused 1-GPU
                # run is reported beside it (IMPLEMENTATION_GAP_OF)
                "ssa-tp2dp2": "ssa-1gpu-g128-unfused", "ssa-tp2-g128": "ssa-1gpu-g128-unfused",
                "softmax_triton-tp2dp2": "softmax_triton-1gpu-g128-unfused",
                "ssa-cp2dp2-16k": "ssa-1gpu-16k",
                "ssa-cp2dp2-32k": "ssa-1gpu-32k", "softmax_triton-cp2dp2-16k": "softmax_triton-1gpu-16k",
                "ssa-1gpu-g128-mb16": "ssa-1gpu-g128",
                # eight GPUs (issue 45): DP8 and the two launchers of four at global batch 256;
                # TP2 x DP4 / TP4 x DP2 at 128 on TP's own layers; CP2 x DP4 at 4 x 32K
                "ssa-dp8": "ssa-1gpu-g256", "softmax_triton-dp8": "softmax_triton-1gpu-g256",
                "ssa-2x4": "ssa-1gpu-g256",
                "ssa-tp2dp4": "ssa-1gpu-g128-unfused", "ssa-tp4dp2": "ssa-1gpu-g128-unfused",
                "ssa-cp2dp4-32k": "ssa-1gpu-32k-g4"}
#: loss differences reported, not gated: a layout against one GPU on the other implementation,
#: and the two 1-GPU implementations against each other (how far fused vs unfused layers alone
#: move this schedule's curve)
IMPLEMENTATION_GAP_OF = {"ssa-tp2dp2": "ssa-1gpu-g128", "ssa-tp2-g128": "ssa-1gpu-g128",
                         "softmax_triton-tp2dp2": "softmax_triton-1gpu-g128",
                         "ssa-1gpu-g128-unfused": "ssa-1gpu-g128",
                         "softmax_triton-1gpu-g128-unfused": "softmax_triton-1gpu-g128",
                         "ssa-tp2dp4": "ssa-1gpu-g128", "ssa-tp4dp2": "ssa-1gpu-g128"}
RESUMED = {"ssa-tp2to1": "ssa-1gpu", "ssa-dp2to1": "ssa-1gpu",
           "ssa-dp4to2": "ssa-1gpu-g128", "ssa-dp4to1": "ssa-1gpu-g128", "ssa-2x4to1": "ssa-1gpu-g256"}
KILLED = ("ssa-2node", "ssa-dp4-kill", "ssa-2x4")
#: 1-GPU runs at the per-GPU batch of a data-parallel step (one micro batch of 32): the
#: weak-scaling speed reference of each DP run, and the speed-up it must reach
SPEED_REF_OF = {"ssa-dp2-speed": "ssa-1gpu-b32", "softmax-dp2": "softmax-1gpu-b32", "ssa-dp4": "ssa-1gpu-b32",
                "ssa-dp8": "ssa-1gpu-b32"}
SPEEDUP_TARGET = {"ssa-dp2-speed": 1.8, "softmax-dp2": 1.8, "ssa-dp4": 3.7, "ssa-dp8": 7.2}
#: the same run's speed against one GPU at the same global batch (gradient accumulation)
SAME_GLOBAL_REF_OF = {"ssa-dp4": "ssa-1gpu-g128", "ssa-dp8": "ssa-1gpu-g256",
                      "softmax_triton-dp8": "softmax_triton-1gpu-g256"}


# ----------------------------------------------------------------------------- plan

class Job:
    """Launches run one after another in one run directory, on the GPUs in ``gpus``.

    ``run`` names the run directory (default: the label); the two launcher processes of a
    two-node run are two jobs of one stage with one run directory. ``kill`` = (global rank,
    step): once the run's log shows that step, that rank's worker gets SIGKILL, and jobs of
    the stage still alive 30 s later are ended as a scheduler ends a job whose task died
    (``expect_fail``: the launch is meant to die)."""

    def __init__(self, label: str, launches: List[List[str]], gpus: str, copy_from: Optional[str] = None,
                 run: Optional[str] = None, kill: Optional[Tuple[int, int]] = None, expect_fail: bool = False):
        self.label, self.launches, self.gpus, self.copy_from = label, launches, gpus, copy_from
        self.run, self.kill, self.expect_fail = run or label, kill, expect_fail


def _pretrain(world: int, overrides: List[str], nodes: Optional[Tuple[int, int, str]] = None) -> List[str]:
    """``nodes`` = (node rank, port, rendezvous id): one of two launcher processes of a
    two-node run (``world // 2`` GPUs each), rendezvous over c10d on localhost as on a cluster."""
    script = os.path.join(REPO, "scripts", "pretrain.py")
    if nodes is not None:
        node_rank, port, rdzv_id = nodes
        per_node = world // 2
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
                f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
                f"--rdzv-id={rdzv_id}", script, "train.num_nodes=2", f"train.num_gpus_per_node={per_node}",
                *overrides]
    if world == 1:
        return [sys.executable, script, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", script,
            f"train.num_gpus_per_node={world}", *overrides]


def plan(part: str, scratch: str, cpu: bool, extra: Sequence[str] = ()) -> List[List[Job]]:
    """Stages of jobs: the jobs of a stage run side by side, stages one after another."""
    common = (CPU_COMMON if cpu else GPU_COMMON) + list(extra)
    steps, stop = (CPU_STEPS, CPU_STOP) if cpu else (STEPS, STOP)
    kill_at = CPU_KILL_AT if cpu else KILL_AT
    ssa = "ssa" if cpu else "ssa_triton"  # on CPU `ssa` runs the reference kernel; same parameters
    st = "softmax" if cpu else "softmax_triton"  # the CPU smoke's head dim 8 is below the kernel's 16

    def run(label, world, attention, *extra, nodes=None):
        return _pretrain(world, [f"attention={attention}", f"run_dir={os.path.join(scratch, label)}",
                                 *common, *extra], nodes=nodes)

    if part == "dp":
        ck = f"train.ckpt_every_n_steps={stop}"

        def two_nodes(port, *extra, kill=None):
            # one launcher per "node", one GPU each; the same run directory (a shared filesystem)
            return [Job("ssa-2node", [run("ssa-2node", 2, ssa, ck, *extra, nodes=(0, port, "ssa-2node"))], "0",
                        kill=kill, expect_fail=kill is not None),
                    Job("ssa-2node.n1", [run("ssa-2node", 2, ssa, ck, *extra, nodes=(1, port, "ssa-2node"))], "1",
                        run="ssa-2node", expect_fail=kill is not None)]

        return [
            [Job("ssa-1gpu", [run("ssa-1gpu", 1, ssa)], "0"),
             Job("softmax-1gpu", [run("softmax-1gpu", 1, "softmax")], "1")],
            [Job("ssa-dp2", [run("ssa-dp2", 2, ssa)], "0,1")],
            # two nodes, distributed optimizer (DP2); rank 1 killed after the step-`stop` checkpoint
            two_nodes(29631, kill=(1, kill_at)),
            # the same two nodes resume; beside them, a copy of the killed run's DP2 checkpoint
            # resumes on one GPU (the distributed optimizer resharded DP2 -> DP1)
            two_nodes(29632, "resume=true")
            + [Job("ssa-dp2to1", [run("ssa-dp2to1", 1, ssa, ck, "resume=true")], "0", copy_from="ssa-2node")],
        ]
    if part == "speed":
        # weak scaling on one machine: 1 GPU at the per-GPU work of a DP2 step (one micro
        # batch of 32, then the optimizer) against DP2 (global batch 64); softmax-dp2 also
        # runs the whole schedule for its loss gate against the 1-GPU softmax-1gpu
        ref = [f"train.global_batch_size={2 if cpu else 32}", f"train.max_steps={stop}"]
        return [
            [Job("ssa-1gpu-b32", [run("ssa-1gpu-b32", 1, ssa, *ref)], "0"),
             Job("softmax-1gpu-b32", [run("softmax-1gpu-b32", 1, "softmax", *ref)], "1")],
            [Job("ssa-dp2-speed", [run("ssa-dp2-speed", 2, ssa, f"train.max_steps={stop}")], "0,1")],
            [Job("softmax-dp2", [run("softmax-dp2", 2, "softmax")], "0,1")],
        ]
    if part == "tp_cp":
        tp = ["train.tensor_parallel=2", "train.sequence_parallel=true"]
        first = [f"stop_after={stop}", f"train.ckpt_every_n_steps={stop}"]
        # the part carries its own 1-GPU loss reference (ssa-1gpu, as in the dp part), run beside
        # the first TP2 launch (no speed is taken here); beside the TP2 resume, the
        # checkpoint's copy resumes on one GPU
        return [
            [Job("ssa-tp2sp", [run("ssa-tp2sp", 2, ssa, *tp, *first)], "0,1"),
             Job("ssa-1gpu", [run("ssa-1gpu", 1, ssa)], "0")],
            [Job("ssa-tp2sp", [run("ssa-tp2sp", 2, ssa, *tp, f"train.ckpt_every_n_steps={stop}", "resume=true")],
                 "0,1"),
             Job("ssa-tp2to1", [run("ssa-tp2to1", 1, ssa, f"train.ckpt_every_n_steps={stop}", "resume=true")], "1",
                 copy_from="ssa-tp2sp")],
            [Job("ssa-cp2", [run("ssa-cp2", 2, ssa, "train.context_parallel=2")], "0,1")],
        ]
    if part == "dp4":
        # four GPUs: 1-GPU references side by side, DP4 (distributed optimizer) for loss and
        # speed, then a DP4 run losing one of four ranks to SIGKILL; its checkpoint resumes at
        # DP2 and on one GPU (resharded), then the killed run itself resumes at DP4
        g128 = [f"train.global_batch_size={8 if cpu else 128}"]
        ck = [f"train.ckpt_every_n_steps={stop}", "train.distributed_optimizer=true"]
        b32 = [f"train.global_batch_size={2 if cpu else 32}", f"train.max_steps={stop}"] + \
            (["train.warmup_steps=1"] if cpu else [])
        return [
            [Job("ssa-1gpu-g128", [run("ssa-1gpu-g128", 1, ssa, *g128)], "0"),
             Job("softmax_triton-1gpu-g128", [run("softmax_triton-1gpu-g128", 1, st, *g128)], "1"),
             Job("ssa-1gpu-b32", [run("ssa-1gpu-b32", 1, ssa, *b32)], "2")],
            [Job("ssa-dp4", [run("ssa-dp4", 4, ssa, *g128, "train.distributed_optimizer=true")], "0,1,2,3")],
            [Job("ssa-dp4-kill", [run("ssa-dp4-kill", 4, ssa, *g128, *ck)], "0,1,2,3", kill=(2, kill_at),
                 expect_fail=True)],
            [Job("ssa-dp4to2", [run("ssa-dp4to2", 2, ssa, *g128, *ck, "resume=true")], "0,1",
                 copy_from="ssa-dp4-kill"),
             Job("ssa-dp4to1", [run("ssa-dp4to1", 1, ssa, *g128, *ck, "resume=true")], "2",
                 copy_from="ssa-dp4-kill")],
            [Job("ssa-dp4-kill", [run("ssa-dp4-kill", 4, ssa, *g128, *ck, "resume=true")], "0,1,2,3")],
        ]
    if part == "layouts4":
        # four GPUs: TP2 x DP2 and CP2 x DP2 (16K and 32K tokens), ssa_triton and softmax_triton;
        # CP runs 2 sequences per step (micro batch 1 x DP2), its 1-GPU references accumulate 2
        g128 = [f"train.global_batch_size={8 if cpu else 128}"]
        tp = ["train.tensor_parallel=2", "train.sequence_parallel=true", *g128]
        unfused = ["model.fused_mlp=false", "model.fused_cross_entropy=false"]  # the layers TP runs

        def cp_args(seq):
            return ["train.context_parallel=2", *long_seq(seq)]

        def long_seq(seq):
            return [f"train.seq_length={(seq // 256) if cpu else seq}", "train.micro_batch_size=1",
                    "train.global_batch_size=2"]

        return [
            [Job("ssa-1gpu-16k", [run("ssa-1gpu-16k", 1, ssa, *long_seq(16384))], "0"),
             Job("ssa-1gpu-32k", [run("ssa-1gpu-32k", 1, ssa, *long_seq(32768))], "1"),
             Job("softmax_triton-1gpu-16k", [run("softmax_triton-1gpu-16k", 1, st,
                                                 *long_seq(16384))], "2"),
             Job("ssa-1gpu-g128", [run("ssa-1gpu-g128", 1, ssa, *g128)], "3")],
            [Job("ssa-tp2dp2", [run("ssa-tp2dp2", 4, ssa, *tp)], "0,1,2,3")],
            [Job("softmax_triton-tp2dp2", [run("softmax_triton-tp2dp2", 4, st, *tp)], "0,1,2,3")],
            [Job("ssa-cp2dp2-16k", [run("ssa-cp2dp2-16k", 4, ssa, *cp_args(16384))], "0,1,2,3")],
            [Job("softmax_triton-cp2dp2-16k", [run("softmax_triton-cp2dp2-16k", 4, st,
                                                   *cp_args(16384))], "0,1,2,3")],
            [Job("ssa-cp2dp2-32k", [run("ssa-cp2dp2-32k", 4, ssa, *cp_args(32768))], "0,1,2,3")],
            # where TP2 x DP2's loss departs from one GPU's: TP2 alone at the same global batch
            # (TP without DP); one GPU on the path TP takes (megatron's MLP and output layer +
            # loss: the fused MLP and cross entropy refuse TP/SP), so TP is compared with TP's
            # own implementation; one GPU at micro batch 16 (the same samples and math, other
            # rounding: how far legitimate numerics alone move the curve)
            [Job("ssa-tp2-g128", [run("ssa-tp2-g128", 2, ssa, *tp)], "0,1"),
             Job("ssa-1gpu-g128-mb16", [run("ssa-1gpu-g128-mb16", 1, ssa, *g128,
                                            f"train.micro_batch_size={1 if cpu else 16}")], "2"),
             Job("ssa-1gpu-g128-unfused", [run("ssa-1gpu-g128-unfused", 1, ssa, *g128, *unfused)], "3")],
            [Job("softmax_triton-1gpu-g128-unfused", [run("softmax_triton-1gpu-g128-unfused", 1, st, *g128,
                                                          *unfused)], "0")],
        ]
    if part == "dp8":
        # eight GPUs (issue 45): the 1-GPU references side by side (global batch 256 = DP8's,
        # and one micro batch of 32 = DP8's per-GPU work), DP8 with the distributed optimizer
        # for loss and speed; then the multi-node path: two launchers of four GPUs each
        # (torchrun --nnodes=2, c10d), rank 5 SIGKILLed after the step-`stop` checkpoint, a copy
        # of its checkpoint resumed on one GPU, then both launchers resumed
        g256 = [f"train.global_batch_size={16 if cpu else 256}"]
        ck = [f"train.ckpt_every_n_steps={stop}", "train.distributed_optimizer=true"]
        b32 = [f"train.global_batch_size={2 if cpu else 32}", f"train.max_steps={stop}"] + \
            (["train.warmup_steps=1"] if cpu else [])
        eight = ",".join(str(i) for i in range(8))

        def two_nodes(port, *extra, kill=None):
            # one launcher per "node", four GPUs each; one run directory (a shared filesystem)
            return [Job("ssa-2x4", [run("ssa-2x4", 8, ssa, *g256, *ck, *extra, nodes=(0, port, "ssa-2x4"))],
                        "0,1,2,3", kill=kill, expect_fail=kill is not None),
                    Job("ssa-2x4.n1", [run("ssa-2x4", 8, ssa, *g256, *ck, *extra, nodes=(1, port, "ssa-2x4"))],
                        "4,5,6,7", run="ssa-2x4", expect_fail=kill is not None)]

        return [
            [Job("ssa-1gpu-g256", [run("ssa-1gpu-g256", 1, ssa, *g256)], "0"),
             Job("softmax_triton-1gpu-g256", [run("softmax_triton-1gpu-g256", 1, st, *g256)], "1"),
             Job("ssa-1gpu-b32", [run("ssa-1gpu-b32", 1, ssa, *b32)], "2")],
            [Job("ssa-dp8", [run("ssa-dp8", 8, ssa, *g256, "train.distributed_optimizer=true")], eight)],
            [Job("softmax_triton-dp8", [run("softmax_triton-dp8", 8, st, *g256, "train.distributed_optimizer=true")],
                 eight)],
            two_nodes(29641, kill=(5, kill_at)),
            # the killed run's checkpoint copied before the run itself resumes (the resume
            # writes later ones), resharded DP8 -> DP1
            [Job("ssa-2x4to1", [run("ssa-2x4to1", 1, ssa, *g256, *ck, "resume=true")], "0", copy_from="ssa-2x4")],
            two_nodes(29642, "resume=true"),
        ]
    if part == "layouts8":
        # eight GPUs (issue 45): TP2 x DP4 and TP4 x DP2 (TP + SP) at global batch 128, CP2 x DP4
        # at 32K tokens (4 sequences per step: micro batch 1 x DP4); each gated against one GPU
        # at the same global batch (TP on TP's own layers, as in layouts4)
        g128 = [f"train.global_batch_size={8 if cpu else 128}"]
        unfused = ["model.fused_mlp=false", "model.fused_cross_entropy=false"]  # the layers TP runs
        cp32 = [f"train.seq_length={(32768 // 256) if cpu else 32768}", "train.micro_batch_size=1",
                "train.global_batch_size=4"]
        eight = ",".join(str(i) for i in range(8))
        # TP4 shards the query groups four ways: the CPU smoke's tiny model has two, so every
        # run of the part (references too) takes four there
        arch = ["model.cpu_arch.num_query_groups=4"] if cpu else []

        def tp(n):
            return [f"train.tensor_parallel={n}", "train.sequence_parallel=true", *g128, *arch]

        return [
            [Job("ssa-1gpu-g128-unfused", [run("ssa-1gpu-g128-unfused", 1, ssa, *g128, *unfused, *arch)], "0"),
             Job("ssa-1gpu-g128", [run("ssa-1gpu-g128", 1, ssa, *g128, *arch)], "1"),
             Job("ssa-1gpu-32k-g4", [run("ssa-1gpu-32k-g4", 1, ssa, *cp32, *arch)], "2")],
            [Job("ssa-tp2dp4", [run("ssa-tp2dp4", 8, ssa, *tp(2))], eight)],
            [Job("ssa-tp4dp2", [run("ssa-tp4dp2", 8, ssa, *tp(4))], eight)],
            [Job("ssa-cp2dp4-32k", [run("ssa-cp2dp4-32k", 8, ssa, "train.context_parallel=2", *cp32, *arch)],
                 eight)],
        ]
    raise SystemExit(f"unknown part {part!r}: one of {', '.join(PARTS)}")


PARTS = ("dp", "tp_cp", "speed", "dp4", "layouts4", "dp8", "layouts8")


# ----------------------------------------------------------------------------- run

def _checkpoint_of(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint of a run: NeMo's ``-last`` (GPU) or the CPU loop's."""
    from nemo_ssa.megatron.checkpoints import nemo_resume_checkpoint
    from nemo_ssa.train.checkpoint_io import latest_checkpoint

    for d in sorted(glob.glob(os.path.join(run_dir, "*", "checkpoints"))):
        found = nemo_resume_checkpoint(d)
        if found:
            return found
    return latest_checkpoint(os.path.join(run_dir, "checkpoints"))


def checkpoints_of(run_dir: str) -> List[Dict]:
    """Every checkpoint directory of a run (NeMo's or the CPU loop's): name, step, complete."""
    from nemo_ssa.megatron.checkpoints import is_complete

    found = []
    for d in sorted(glob.glob(os.path.join(run_dir, "*", "checkpoints", "*"))
                    + glob.glob(os.path.join(run_dir, "checkpoints", "*"))):
        if not os.path.isdir(d):
            continue
        m = re.search(r"step[=_](\d+)", os.path.basename(d))
        weights = os.path.join(d, "weights")
        found.append({"name": os.path.basename(d), "step": int(m.group(1)) if m else None,
                      "complete": is_complete(weights if os.path.isdir(weights) else d)})
    return found


def _collect(run_dir: str, dest: str, logs: Sequence[str]) -> None:
    os.makedirs(dest, exist_ok=True)
    for name in KEEP:
        if os.path.isfile(os.path.join(run_dir, name)):
            shutil.copy2(os.path.join(run_dir, name), os.path.join(dest, name))
    if os.path.isdir(os.path.join(run_dir, "ranks")):
        shutil.copytree(os.path.join(run_dir, "ranks"), os.path.join(dest, "ranks"), dirs_exist_ok=True)
    for i, log in enumerate(logs):
        if os.path.isfile(log):
            shutil.copy2(log, os.path.join(dest, "launch.log" if i == 0 else f"launch-{i}.log"))
    with open(os.path.join(dest, "checkpoints.json"), "w") as f:
        json.dump(checkpoints_of(run_dir), f, indent=1)
    ckpt = _checkpoint_of(run_dir)
    if ckpt:
        from nemo_ssa.megatron.checkpoints import read_ssa_scalars

        try:
            vals = read_ssa_scalars(ckpt)
            with open(os.path.join(dest, "ckpt_ssa.json"), "w") as f:
                json.dump({"checkpoint": ckpt, "n": {str(k): v for k, v in vals["n"].items()},
                           "b": {str(k): v for k, v in vals["b"].items()}}, f, indent=1)
        except Exception as e:  # noqa: BLE001 -- recorded, the check reports it
            with open(os.path.join(dest, "ckpt_ssa.json"), "w") as f:
                json.dump({"checkpoint": ckpt, "error": f"{type(e).__name__}: {e}"}, f)


def run(args) -> int:
    out = os.path.abspath(args.out)
    scratch = os.path.abspath(args.scratch or os.path.join(tempfile.gettempdir(), f"two_gpu_{args.part}"))
    if os.path.isdir(scratch):
        shutil.rmtree(scratch)
    os.makedirs(scratch)
    os.makedirs(out, exist_ok=True)
    # logs and collected files stay in the scratch directory; `out` receives two files at the
    # end (the archive and runs.json), so a part cut off by its call leaves nothing half-written
    # there, and several parts fit the device tool's few returned files
    staging = os.path.join(scratch, "_returned")
    os.makedirs(staging)
    data_dir = args.data_dir or (os.path.join(scratch, "corpus") if args.cpu_smoke else None)
    # another seed (init and data order) of the same jobs: the check keeps its runs apart and
    # gates each run only against references of its own seed
    extra = ([f"data.dir={data_dir}"] if data_dir else []) + ([f"seed={args.seed}"] if args.seed != SEED else [])
    stages = plan(args.part, scratch, args.cpu_smoke, extra)
    if args.only:
        keep = set(args.only.split(","))
        stages = [st for st in ([j for j in stage if j.label in keep] for stage in stages) if st]
    t_start = time.time()
    deadline = t_start + args.budget
    table: List[Dict] = []
    env_base = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    _prepare_corpus(args.cpu_smoke, data_dir)
    for stage in stages:
        if time.time() > deadline - 30:
            print(f"[two_gpu] budget spent: stage {[j.label for j in stage]} not started", flush=True)
            table += [{"label": j.label, "rc": None, "seconds": 0.0, "skipped": True} for j in stage]
            continue
        for job in stage:
            if job.copy_from:
                dest = os.path.join(scratch, job.run)
                shutil.copytree(os.path.join(scratch, job.copy_from), dest, dirs_exist_ok=True)
                # the copy is its own run: its rank files must come from its own launch
                shutil.rmtree(os.path.join(dest, "ranks"), ignore_errors=True)
        running = []
        for job in stage:
            env = dict(env_base)
            if not args.cpu_smoke:
                env["CUDA_VISIBLE_DEVICES"] = job.gpus
            elif job.kill:  # the tiny CPU run is over in seconds: hold every rank after the kill step
                env["NEMO_SSA_FAULT"] = f"step_end:{job.kill[1]}:120"
            log = os.path.join(staging, f"{job.label}.log")
            running.append((job, log, _start(job, env, log)))
        kills = [_watch_and_kill(job, log, [r[2] for r in running], grace=10 if args.cpu_smoke else 30)
                 for job, log, _ in running if job.kill]
        for job, log, started in running:
            rc, seconds = _wait(job, log, started, deadline)
            row = {"label": job.label, "run": job.run, "rc": rc, "seconds": seconds, "expect_fail": job.expect_fail}
            for k in kills:
                k.join()
                if k.job is job:
                    row["kill"] = k.record
            table.append(row)
            print(f"[two_gpu] {job.label}: rc {rc} in {seconds:.0f} s" + (" (expected to die)" if job.expect_fail
                                                                            else ""), flush=True)
    for run_label in sorted({j.run for stage in stages for j in stage}):
        logs = [os.path.join(staging, f"{j.label}.log") for stage in stages for j in stage if j.run == run_label]
        _collect(os.path.join(scratch, run_label), os.path.join(staging, run_label), logs)
    with open(os.path.join(staging, "runs.json"), "w") as f:
        json.dump({"part": args.part, "seed": args.seed, "cpu_smoke": args.cpu_smoke, "seconds": time.time() - t_start,
                   "max_steps": CPU_STEPS if args.cpu_smoke else STEPS,
                   "ckpt_every": CPU_STOP if args.cpu_smoke else STOP,
                   "jobs": table,
                   "plan": [[{"label": j.label, "run": j.run, "gpus": j.gpus, "launches": j.launches,
                              "kill": j.kill} for j in st] for st in stages]},
                  f, indent=1)
    tgz = os.path.join(out, f"two_gpu-{args.part}.tgz")
    with tarfile.open(tgz + ".part", "w:gz") as tar:
        for name in sorted(os.listdir(staging)):
            tar.add(os.path.join(staging, name), arcname=name)
    os.replace(tgz + ".part", tgz)
    shutil.copy2(os.path.join(staging, "runs.json"), os.path.join(out, "runs.json"))
    print("\n| job | rc | s |\n|---|---|---|")
    for row in table:
        print(f"| {row['label']} | {row['rc']}{' (expected to die)' if row.get('expect_fail') else ''} | "
              f"{row['seconds']:.0f} |")
    print(f"[two_gpu] part {args.part}: {time.time() - t_start:.0f} s; logs in {tgz}", flush=True)
    ok = all((row["rc"] not in (0, None)) if row.get("expect_fail") else row["rc"] == 0 for row in table)
    return 0 if ok else 1


_STEP_IN_LOG = re.compile(r"(?:global_step[:=]\s*|\[cpu\] step\s+)(\d+)")


def _log_step(log: str) -> int:
    """The highest training step a launch log shows (NeMo's progress line or the CPU loop's)."""
    try:
        with open(log, errors="replace") as f:
            found = _STEP_IN_LOG.findall(f.read())
    except OSError:
        return -1
    return max((int(x) for x in found), default=-1)


def _descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _env_of(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def rank_worker(roots: Sequence[int], rank: int) -> Optional[int]:
    """The pid of the training worker of global ``rank`` under the launcher processes
    ``roots``: the topmost process whose environment has ``RANK=<rank>`` (its data-loader
    workers inherit the variable; the launcher agent has none)."""
    for root in roots:
        procs = _descendants(root)
        ranked = {p for p in procs if _env_of(p).get("RANK") == str(rank) and "LOCAL_RANK" in _env_of(p)}
        for p in procs:
            if p in ranked:
                try:
                    with open(f"/proc/{p}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                if ppid not in ranked:
                    return p
    return None


class _Killer:
    """Waits for ``job.kill``'s step in the stage's logs, SIGKILLs that rank's worker, then
    ends (SIGKILL to the process group) every job of the stage still alive after ``grace``
    seconds -- what a scheduler does to a job whose task died. ``record`` says what happened."""

    def __init__(self, job: Job, log: str, started, grace: float):
        import threading

        self.job, self.log, self.started, self.grace = job, log, started, grace
        self.record: Dict = {"rank": job.kill[0], "at_step": job.kill[1]}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def join(self):
        self._thread.join()

    def _run(self):
        import signal

        rank, at = self.job.kill
        logs = sorted(glob.glob(os.path.join(os.path.dirname(self.log), f"{self.job.run}*.log")))
        procs = [s[0] for s in self.started]
        while all(p.poll() is None for p in procs):
            seen = max((_log_step(log) for log in logs), default=-1)
            if seen >= at:
                pid = rank_worker([p.pid for p in procs], rank)
                if pid is None:
                    self.record["error"] = f"no worker with RANK={rank} found"
                    break
                os.kill(pid, signal.SIGKILL)
                self.record.update(killed_pid=pid, seen_step=seen, t=time.time())
                print(f"[two_gpu] SIGKILL to rank {rank} (pid {pid}) at step {seen}", flush=True)
                break
            time.sleep(0.5)
        else:
            self.record["error"] = "the launch ended before the kill step"
            return
        t_end = time.time() + self.grace
        while time.time() < t_end and any(p.poll() is None for p in procs):
            time.sleep(0.5)
        alive = [p for p in procs if p.poll() is None]
        self.record["ended_by_themselves"] = not alive
        for p in alive:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _watch_and_kill(job: Job, log: str, started, grace: float) -> _Killer:
    return _Killer(job, log, started, grace)


def _prepare_corpus(cpu: bool, data_dir: Optional[str]) -> None:
    """Build the embedded corpus once, before side-by-side runs would race to build it."""
    from omegaconf import OmegaConf

    from nemo_ssa.data import build_corpus, default_corpus_dir

    data = OmegaConf.load(os.path.join(REPO, "nemo_ssa", "configs", "data", "stdlib.yaml"))
    kw = dict(vocab_size=512, max_bytes=400_000) if cpu else dict(vocab_size=int(data.vocab_size),
                                                                   max_bytes=data.get("max_bytes"))
    build_corpus(data_dir or data.get("dir") or default_corpus_dir(data.source), source=data.source, quiet=True, **kw)


def _start(job: Job, env: Dict[str, str], log: str):
    """Start the job's launches as one shell chain (the next starts when the last ends)."""
    import shlex

    chain = " && ".join(" ".join(shlex.quote(a) for a in cmd) for cmd in job.launches)
    f = open(log, "a")
    f.write(f"$ {chain}\n")
    f.flush()
    return subprocess.Popen(["bash", "-c", chain], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True), f, time.time()


def _wait(job, log, started, deadline) -> Tuple[int, float]:
    import signal

    proc, f, t0 = started
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = 124
        f.write(f"\n[two_gpu] killed at the budget\n")
    f.close()
    return rc, time.time() - t0


# ----------------------------------------------------------------------------- check

def _unpack(paths: Sequence[str], into: str) -> Dict[str, str]:
    """{label: run dir} of every returned part (a .tgz or a directory); a label seen in two
    parts (each part has its own ssa-1gpu) is prefixed with the part."""
    runs: Dict[str, Dict[str, str]] = {}
    for i, path in enumerate(paths):
        if path.endswith(".tgz"):
            dest = os.path.join(into, f"part{i}")
            with tarfile.open(path) as tar:
                tar.extractall(dest)
            path = dest
        meta = os.path.join(path, "runs.json")
        m = json.load(open(meta)) if os.path.isfile(meta) else {}
        seed = int(m.get("seed", SEED))  # archives before --seed ran the default
        part = m.get("part", f"part{i}") + ("" if seed == SEED else f"-s{seed}")
        # a later archive of the same part (a re-run of some of its jobs) adds to it, and its
        # record of a re-run job replaces the earlier one
        runs.setdefault(part, {}).update({d: os.path.join(path, d) for d in sorted(os.listdir(path))
                                          if os.path.isfile(os.path.join(path, d, "metrics.csv"))})
        prev = _META.setdefault(part, {})
        prev.update({k: v for k, v in m.items() if k not in ("jobs", "beside")})
        prev["seed"] = seed
        rerun = {j.get("label") for j in m.get("jobs", [])}
        prev["jobs"] = [j for j in prev.get("jobs", []) if j.get("label") not in rerun] + m.get("jobs", [])
        prev.setdefault("beside", {}).update(_beside(m))
    return runs


def _beside(meta: Dict) -> Dict[str, int]:
    """{run: how many other runs shared its stage} from one archive's runs.json: a rate taken
    beside other runs on the same host (CPU, memory bandwidth, PCIe) is a lower bound, and a
    speed ratio against it says so."""
    ran = {j["label"] for j in meta.get("jobs", []) if j.get("rc") is not None}
    out: Dict[str, int] = {}
    for stage in meta.get("plan", []):
        live = {j["run"] for j in stage if j["label"] in ran}
        for run_label in live:
            out[run_label] = len(live) - 1
    return out


def _beside_note(part: str, label: str) -> str:
    n = _META.get(part, {}).get("beside", {}).get(label, 0)
    return f"; {label} ran beside {n} other run(s) on the host: its rate is a lower bound" if n else ""


_META: Dict[str, Dict] = {}  # runs.json of each unpacked part


def check_killed(run_dir: str, meta: Dict, label: str) -> Tuple[bool, str]:
    """A run whose rank was SIGKILLed and then resumed lost nothing beyond its last complete
    checkpoint: the kill happened (the launch died), the resumed segment starts right after
    the newest checkpoint taken before the kill, and runs to the end of the schedule."""
    rows = [r for r in meta.get("jobs", []) if r.get("label") == label and r.get("kill")]
    if not rows:
        return False, "no kill recorded in runs.json"
    kill = rows[0]["kill"]
    if "killed_pid" not in kill:
        return False, f"the kill did not happen: {kill.get('error', kill)}"
    if rows[0].get("rc") == 0:
        return False, "the killed launch exited 0"
    every, steps = int(meta.get("ckpt_every") or 0), int(meta.get("max_steps") or 0)
    if not every or not steps:
        return False, "runs.json lacks ckpt_every / max_steps"
    last_ckpt = every * (int(kill["seen_step"]) // every)
    segs: Dict[int, List[int]] = {}
    for r in csv.DictReader(open(os.path.join(run_dir, "metrics.csv"))):
        segs.setdefault(int(r.get("segment") or 1), []).append(int(r["step"]))
    if len(segs) < 2:
        return False, f"{len(segs)} segment(s) in metrics.csv: no resumed launch"
    first, last = min(segs[max(segs)]), max(segs[max(segs)])
    detail = (f"rank {kill['rank']} SIGKILLed at step {kill['seen_step']} (the other launcher "
              f"{'ended by itself' if kill.get('ended_by_themselves') else 'ended by the teardown'}); "
              f"last checkpoint {last_ckpt}; resumed segment: steps {first}-{last}")
    return first == last_ckpt + 1 and last == steps, detail


def _rate(run_dir: str) -> Optional[float]:
    """Median tokens/s: summary.json's (NeMo, rank 0), else metrics.csv's after 10 steps."""
    s = os.path.join(run_dir, "summary.json")
    if os.path.isfile(s):
        v = json.load(open(s)).get("tokens_per_s_median")
        if v:
            return float(v)
    rates = [float(r["tokens_per_s"]) for r in csv.DictReader(open(os.path.join(run_dir, "metrics.csv")))
             if r.get("tokens_per_s") not in (None, "", "nan")]
    rates = rates[10:] or rates
    return statistics.median(rates) if rates else None


def check_ranks(run_dir: str) -> Tuple[bool, str]:
    """Every rank's n (and b) per layer bit-identical; the checkpoint's n equal to rank 0's."""
    files = sorted(glob.glob(os.path.join(run_dir, "ranks", "rank_*.json")))
    if not files:
        return False, "no ranks/rank_*.json"
    recs = [json.load(open(f)) for f in files]
    world = recs[0].get("world_size", 1)
    if len(recs) != world:
        return False, f"{len(recs)} rank files for world size {world}"
    if not recs[0]["n"]:
        return True, f"{world} rank(s), no SSA layers"
    bad = [r["rank"] for r in recs if r["n"] != recs[0]["n"] or r["b"] != recs[0]["b"]]
    if bad:
        layer = next(k for k in recs[0]["n"] if any(r["n"].get(k) != recs[0]["n"][k] for r in recs))
        vals = ", ".join(f"rank {r['rank']} (tp {r.get('tp_rank')}) {float.fromhex(r['n'][layer]):.9g}" for r in recs)
        return False, f"n differs between ranks: layer {layer}: {vals}"
    msg = f"{world} rank(s) identical ({len(recs[0]['n'])} layers, e.g. n_1 = {float.fromhex(recs[0]['n']['1']):.6f})"
    ck = os.path.join(run_dir, "ckpt_ssa.json")
    if os.path.isfile(ck):
        saved = json.load(open(ck))
        if "error" in saved:
            return False, msg + f"; checkpoint unreadable: {saved['error']}"
        diff = [k for k, v in recs[0]["n"].items() if saved["n"].get(k) != float.fromhex(v)]
        if diff:
            return False, msg + f"; checkpoint n differs from rank 0's at layers {diff}"
        msg += "; checkpoint n = rank 0's"
    return True, msg


def _gap_detail(out: str) -> str:
    """One line from a reported comparison's summary.csv: mean and max |Δ| of the EMA curves."""
    try:
        rows = list(csv.DictReader(open(os.path.join(out, "summary.csv"))))
        r = next(r for r in rows if r["run"] != r["baseline"])
        return (f"EMA {EMA}, steps >= {r['from_step']}: mean |Δ| {float(r['mean_abs_delta']):.4f}, "
                f"max {float(r['max_abs_delta']):.4f} (step {r['max_delta_step']}); {out}/summary.md")
    except (OSError, StopIteration, KeyError, ValueError) as e:
        return f"no comparison ({type(e).__name__}: {e})"


def check(args) -> int:
    from nemo_ssa.tools.compare import main as compare_main

    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="two_gpu_check_")
    _META.clear()  # one check's archives only
    parts = _unpack(args.logs, tmp)
    rows, ok = [], True

    def gate(name, passed, detail):
        nonlocal ok
        ok &= bool(passed)
        rows.append((name, "PASS" if passed else "FAIL", detail))

    def find(runs, label, seed):
        """This part's run, else the same run of another part of the same seed (one 1-GPU
        reference serves all parts; a reference of another seed is another run)."""
        if label in runs:
            return runs[label]
        return next((r[label] for p, r in parts.items() if label in r and _META[p]["seed"] == seed), None)

    for part, own in parts.items():
        runs = dict(own)
        for label in (set(REFERENCE_OF.values()) | set(RESUMED.values()) | set(SPEED_REF_OF.values())
                      | set(IMPLEMENTATION_GAP_OF.values())):
            if label not in runs and find(own, label, _META[part]["seed"]):
                runs[label] = find(own, label, _META[part]["seed"])
        for run_label, ref_label in REFERENCE_OF.items():
            if run_label not in runs:
                continue
            if ref_label not in runs:
                gate(f"{part}: {run_label} loss", False, f"no {ref_label} in any part")
                continue
            out = os.path.join(args.out, part, f"{run_label}_vs_{ref_label}")
            rc = compare_main([f"{ref_label}={runs[ref_label]}", f"{run_label}={runs[run_label]}",
                               "--gate", f"{run_label}={ref_label}", "--max-delta", str(args.max_delta),
                               "--ema", str(EMA), "--from-step", str(args.from_step), "--out", out,
                               "--title", f"{run_label} vs {ref_label} ({part})"] + (["--no-plot"] if args.no_plot else []))
            gate(f"{part}: {run_label} loss vs {ref_label}", rc == 0,
                 f"EMA {EMA}, steps >= {args.from_step}, max |Δ| <= {args.max_delta}; {out}/summary.md")
        for run_label, ref_label in IMPLEMENTATION_GAP_OF.items():
            if run_label in own and ref_label in runs:
                out = os.path.join(args.out, part, f"{run_label}_vs_{ref_label}")
                compare_main([f"{ref_label}={runs[ref_label]}", f"{run_label}={runs[run_label]}",
                              "--ema", str(EMA), "--from-step", str(args.from_step), "--out", out,
                              "--title", f"{run_label} vs {ref_label} ({part}, reported)"]
                             + (["--no-plot"] if args.no_plot else []))
                rows.append((f"{part}: {run_label} loss vs {ref_label} (other implementation)", "reported",
                             _gap_detail(out)))
        for run_label, ref_label in RESUMED.items():
            if run_label in runs and ref_label in runs:
                out = os.path.join(args.out, part, f"{run_label}_resume")
                rc = compare_main([f"{ref_label}={runs[ref_label]}", f"{run_label}={runs[run_label]}",
                                   "--gate", f"{run_label}={ref_label}", "--rtol", str(GOLDEN_RTOL), "--ema", "0",
                                   "--out", out, "--title", f"{run_label}: checkpoint resumed on 1 GPU vs {ref_label}"]
                                  + (["--no-plot"] if args.no_plot else []))
                segs = sorted({r.get("segment") for r in csv.DictReader(open(os.path.join(runs[run_label], "metrics.csv")))})
                gate(f"{part}: {run_label} resume", rc == 0 and len(segs) >= 2,
                     f"raw loss, rtol {GOLDEN_RTOL} per step; {len(segs)} segment(s) in its metrics.csv")
        for label in KILLED:
            if label in runs:
                passed, detail = check_killed(runs[label], _META.get(part, {}), label)
                gate(f"{part}: {label} SIGKILL and resume", passed, detail)
        for label, run_dir in own.items():
            if label.endswith("1gpu") and label not in RESUMED:
                continue
            passed, detail = check_ranks(run_dir)
            gate(f"{part}: {label} n on every rank", passed, detail)
        for label, run_dir in own.items():
            weak = SPEED_REF_OF.get(label)
            if weak is not None:
                # weak scaling, one machine: each GPU does per step what the 1-GPU run does
                r, r1 = _rate(run_dir), (_rate(own[weak]) if weak in own else None)
                ratio = (r / r1) if (r and r1) else None
                detail = (f"{r or float('nan'):,.0f} vs {r1 or float('nan'):,.0f} tokens/s of {weak} "
                          f"({ratio or float('nan'):.2f}x){_beside_note(part, weak)}" if weak in own
                          else f"no {weak} in this part (the reference must run on the same machine)")
                target = SPEEDUP_TARGET[label]
                if args.no_speed_gate:
                    rows.append((f"{part}: {label} speed", "reported", detail))
                else:
                    gate(f"{part}: {label} speed >= {target}x one GPU at the same per-GPU batch",
                         ratio is not None and ratio >= target, detail)
                same = SAME_GLOBAL_REF_OF.get(label)
                if same is not None and same in own:
                    r2 = _rate(own[same])
                    rows.append((f"{part}: {label} speed at the same global batch", "reported",
                                 f"{r or float('nan'):,.0f} vs {r2 or float('nan'):,.0f} tokens/s of {same} "
                                 f"({(r / r2) if (r and r2) else float('nan'):.2f}x){_beside_note(part, same)}"))
                continue
            ref = REFERENCE_OF.get(label)
            if ref is None or ref not in runs:
                continue
            r, r1 = _rate(run_dir), _rate(runs[ref])
            ratio = (r / r1) if (r and r1) else None
            same = "" if ref in own else " (another machine)"
            rows.append((f"{part}: {label} speed", "reported",
                         f"{r or float('nan'):,.0f} vs {r1 or float('nan'):,.0f} tokens/s of {ref}{same} "
                         f"({ratio or float('nan'):.2f}x){_beside_note(part, ref) if ref in own else ''}"))
    lines = ["| check | result | detail |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "two_gpu.md"), "w") as f:
        f.write(f"# Two-GPU check\n\n`python scripts/device/two_gpu.py check {' '.join(args.logs)}`\n\n{text}\n")
    print(text)
    shutil.rmtree(tmp, ignore_errors=True)
    if not rows:
        print("[two_gpu] nothing to check: no run directories with metrics.csv", file=sys.stderr)
        return 2
    print(f"[two_gpu] {'all gates passed' if ok else 'a gate FAILED'}")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train one part (on the 2-GPU machine)")
    r.add_argument("--part", choices=PARTS, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--scratch", default=None, help="run directories and checkpoints (default: a temp dir)")
    r.add_argument("--budget", type=float, default=560.0, help="seconds for the whole part (jobs killed at it)")
    r.add_argument("--cpu-smoke", action="store_true", help="the same plan on CPU: tiny model, gloo, few steps")
    r.add_argument("--only", default=None, help="comma-separated job labels: run just these (a re-run of a part)")
    r.add_argument("--data-dir", default=None, help="corpus directory (default: the config's; --cpu-smoke: in scratch)")
    r.add_argument("--seed", type=int, default=SEED,
                   help=f"seed of every job (default {SEED}); the check gates a run only against references "
                        "of its own seed")
    p = sub.add_parser("plan", help="print the commands of every part, run nothing")
    p.add_argument("--cpu-smoke", action="store_true")
    c = sub.add_parser("check", help="gate the returned logs")
    c.add_argument("logs", nargs="+", help="two_gpu-<part>.tgz files or unpacked part directories")
    c.add_argument("--out", required=True)
    c.add_argument("--max-delta", type=float, default=MAX_DELTA)
    c.add_argument("--from-step", type=int, default=FROM_STEP)
    c.add_argument("--no-speed-gate", action="store_true", help="report DP2's speed-up without gating it (CPU)")
    c.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        for part in PARTS:
            print(f"## part {part}")
            for i, stage in enumerate(plan(part, "<scratch>", args.cpu_smoke), 1):
                for job in stage:
                    for cmd in job.launches:
                        gpus = "" if args.cpu_smoke else f"CUDA_VISIBLE_DEVICES={job.gpus} "
                        copy = f"(copy of {job.copy_from}'s run dir) " if job.copy_from else ""
                        print(f"stage {i} {job.label}: {copy}{gpus}{' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}")
        return 0
    return run(args) if args.cmd == "run" else check(args)


if __name__ == "__main__":
    sys.exit(main())
