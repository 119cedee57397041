"""Run a planned list of GPU steps in one device command, each under its own time limit.

Named presets (the GPU test plan; ``PRESETS`` below lists what each runs)::

    python scripts/device/gpu_session.py --preset quick  --out $OUT --commit <sha>   # after any kernel change, <= 4 min
    python scripts/device/gpu_session.py --preset full-1 --out $OUT --commit <sha>   # flash, flex, ELSA, extreme logits
    python scripts/device/gpu_session.py --preset full-2 --out $OUT --commit <sha>   # NSA, CUDA runs of the CPU op tests, ops fuzz
    python scripts/device/gpu_session.py --preset graphs --out $OUT --commit <sha>   # model.cuda_graphs=local: speed + parity
    python scripts/device/gpu_session.py --preset graphs-default --out $OUT --commit <sha>   # the checks model.cuda_graphs=auto rests on (DP 2 needs 2 GPUs)
    python scripts/device/gpu_session.py --preset step-graphs --out $OUT --commit <sha>   # the mb-8 step with graphs, profiled
    python scripts/device/gpu_session.py --preset syncs --out $OUT --commit <sha>   # every sync of the step, by call site
    python scripts/device/gpu_session.py --preset layernorm-mb8 --out $OUT --commit <sha>   # fused layer norm at mb 8, 3 rounds
    python scripts/device/gpu_session.py --preset layernorm-parity --out $OUT --commit <sha>   # its 1,000-step parity + the spread
    python scripts/device/gpu_session.py --preset graphs-full --out $OUT --commit <sha>   # model.cuda_graphs=full vs local
    python scripts/device/gpu_session.py --preset graphs-full-parity --out $OUT --commit <sha>   # its mb-8 parity + the spread
    python scripts/device/gpu_session.py --preset graphs-full-mb32 --out $OUT --commit <sha>   # its mb-32 speed, 600 steps
    python scripts/device/gpu_session.py --preset icl-dreg --out $OUT --commit <sha>   # issue 44: d-dim regression, 50k steps
    python scripts/device/gpu_session.py --list-presets

Every session (a preset or free-form steps) installs the offline wheel bundle first when ``.whl/`` is present (as
scripts/device/gpu_proof.sh does), keeps Triton's and inductor's compile caches under
``.cache/`` in the checkout (a second command on a still-warm machine reuses them),
runs pytest with pytest-xdist (``-n``, when installed: Triton compiles are CPU-bound
and the workers compile in parallel) and pytest-timeout (a per-test cap, when
installed), and writes ``{out}/gpu-tests-<preset>.md``: one row per test (outcome,
seconds), device, date, commit, versions and the command -- the file the lead copies
to docs/results/. Tests are logged as they finish (``NEMO_SSA_TEST_LOG``, see
tests/conftest.py), so a step killed at its limit still reports what ran and lists
what did not.

Free-form steps (as before)::

    python scripts/device/gpu_session.py --out $OUT --budget 560 \\
        "flash-tests:150:python -m pytest -m gpu tests/ops/attention/test_flash_gpu.py -q" \\
        "bench:120:python benchmarks/bench_attention.py --quick --out {out}/bench_attention.md"

Each step is ``NAME:SECONDS:COMMAND`` (``{out}`` expands to the output folder). Steps run
in order; a step gets ``min(SECONDS, budget left)`` and is killed at its limit, the next
step still runs. Every step's full log goes to ``{out}/<name>.log``; at the end all files
under ``--out`` are packed into ``{out}/session.tgz`` (the device tool returns only a few
files; the loose files are removed, except the results markdown of a preset) and a table
of steps, exit codes and seconds is printed last, preceded by each log's tail.
"""

from __future__ import annotations

import argparse
import glob
import io
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU_FILES = ["tests/ops/attention/test_flash_gpu.py", "tests/ops/attention/test_flash_gluon.py",
             "tests/ops/common/test_hopper_bwd.py",
             "tests/ops/attention/test_flex_gpu.py", "tests/ops/elsa/test_elsa_gpu.py",
             "tests/ops/nsa/test_nsa_gpu.py", "tests/ops/test_fused_attention_range.py", "tests/ops/mlp/test_mlp_gpu.py",
             "tests/ops/test_tiny_shapes.py"]

def _keep_drop(out: str, rounds: int, job: str) -> str:
    """A step_ab command: the NeMo main job (ssa) with train.progress_bar_values keep against drop
    (the default, set anyway so the labels say what ran), one tree, after one 10-step warm-up run (the
    arms change only what is logged: one warm-up compiles what both run)."""
    return ("{py} scripts/device/step_ab.py --tree keep=. --tree drop=. --arm keep=train.progress_bar_values=keep "
            "--arm drop=train.progress_bar_values=drop "
            f"--rounds {rounds} --warmup-steps 10 --warmup-per tree --out {{out}}/{out} --timeout 110 -- attention=ssa train=gpu_9min {job}")


def _metrics_defer(out: str, job: str) -> str:
    """A step_ab command: the NeMo main job (ssa) from the parent tree dev/95a5fec (the blocking
    metrics read) against this checkout, 2 rounds alternated after a 10-step warm-up of each.

    The parent tree reads the checkout's corpus (data/ linked): built once, not once per tree (the
    build is 39 s of a cold machine's first run, which then passed the 110 s a run may take)."""
    return ("mkdir -p data && ln -sfn \"$PWD/data\" dev/95a5fec/data && "
            "{py} scripts/device/step_ab.py --tree block=dev/95a5fec --tree deferred=. --rounds 2 --warmup-steps 10 "
            f"--out {{out}}/{out} --timeout 150 -- attention=ssa train=gpu_9min {job}")


def _attn_pair(out: str, job: str, base: str = "softmax_triton") -> str:
    """A step_ab command: the NeMo main job (gpu_9min) as ``base`` (a softmax attention) against
    ssa, one tree, 2 rounds alternated after a 10-step warm-up of each (the two compile different
    kernels)."""
    return ("{py} scripts/device/step_ab.py --tree softmax=. --tree ssa=. "
            f"--arm softmax=attention={base} --arm ssa=attention=ssa --rounds 2 --warmup-steps 10 "
            f"--out {{out}}/{out} --timeout 110 -- train=gpu_9min {job}")


def _option_ab(out: str, trees, option: str, rounds: int, timeout: int, job: str, compare: bool = False,
               warmup: int = 0) -> str:
    """A step_ab command: the NeMo main job (ssa, graphs) from this checkout under each label in
    ``trees``, ``option`` set on the last one only; ``compare`` adds the compare tool over the
    runs' curves (one round); ``warmup`` steps of one uncounted run first (the kernels compiled; one
    for the tree: the graph options these presets A/B compile the same Triton kernels)."""
    cmd = ("{py} scripts/device/step_ab.py " + " ".join(f"--tree {t}=." for t in trees) + f" --arm {trees[-1]}={option} "
           f"--rounds {rounds} --out {{out}}/{out} --timeout {timeout} "
           + (f"--warmup-steps {warmup} --warmup-per tree " if warmup else "") +
           f"-- attention=ssa train=gpu_9min {job} model.cuda_graphs=local")
    if compare:
        cmd += (" && {py} -m nemo_ssa.tools.compare " + " ".join(f"{t}={{out}}/{out}/{t}-r0" for t in trees) +
                f" --ema 0.9 --out {{out}}/{out}/compare")
    return cmd


# The training budget of an icl-outlier call: its clock starts after the imports (~30 s) and a run
# that finishes is then evaluated (20-40 s), inside the step's limit of the session's 540 s less
# the bundle's install and start-up (~499 s): at 495 the first call was killed before its
# runs' budget checkpoints, losing up to 5,000 steps each (2026-12-02-icl-outlier-after).
ICL_BUDGET_S = 420


def _icl_linear(groups, budget_s: int) -> str:
    """The paper's linear in-context task retrained (issue 44: its ``outlier_after`` grid exists
    only in runs evaluated after it was added): one process per ``(attentions, seed)`` group,
    the pinned runs' configuration (TF32, graphs, 50,000 steps), checkpoints under /tmp/icl-outlier
    (the next call on the warm machine resumes), then the run JSONs copied out; exit 0 only when
    every run finished."""
    conf = "--task linear --seeds 1 --steps 50000 --cuda-graphs --tf32 --checkpoint-every 5000 --log-every 2500"
    runs, procs = [], []
    for atts, seed in groups:
        out = f"/tmp/icl-outlier/s{seed}-{atts.replace(',', '-')}"
        n = len(atts.split(","))
        procs.append(f"{{py}} -m nemo_ssa.study.icl_paper {conf} --attentions {atts} --first-seed {seed} "
                     f"--concurrent {n} --budget-s {budget_s} --out {out} > {{out}}/icl-{seed}-{atts.replace(',', '-')}.log 2>&1 &")
        runs += [f"{out}/runs/linear-{a}-s{seed}.json" for a in atts.split(",")]
    return (" ".join(procs) + " wait; mkdir -p {out}/icl-outlier && cp " + " ".join(runs) +
            " {out}/icl-outlier/ ; tail -n 4 {out}/icl-*.log; ls {out}/icl-outlier; " +
            " && ".join(f"test -s {r}" for r in runs))


# name -> (what it runs, expected seconds on an H100 incl. start-up, budget, steps). A pytest
# step is ("pytest", NAME, SECONDS, files, marker, per-test timeout); anything else is
# ("cmd", NAME, SECONDS, command); a pytest step may end with its own worker count (1: alone on the GPU). Expected times are estimates from the known file timings
# divided by the parallel compile; the budgets keep every command under 9 minutes.
PRESETS = {
    "quick": dict(
        about="gpu_quick cases of every kernel (flash fwd+bwd incl. GQA/causal/varlen/strided, flex, ELSA, "
              "NSA softmax+SSA, extreme logits bf16)",
        expect=150, budget=235,
        steps=[("pytest", "tests-quick", 215, GPU_FILES, "gpu_quick", 150)]),
    "full-1": dict(
        about="flash (GPU file + the CPU op tests run on CUDA, the eager/cached-launch path), flex, ELSA GPU file, "
              "extreme logits, tiny lengths (N=1,2,3,15,17), fused RoPE+layout, LM cross-entropy, fused MLP, the step's foreach/fused-AdamW paths",
        expect=360, budget=530,
        steps=[("pytest", "tests-full-1", 505,
                ["tests/ops/attention/test_flash_gpu.py", "tests/ops/attention/test_flash_gluon.py",
                 "tests/ops/common/test_hopper_bwd.py",
                 "tests/ops/attention/test_flex_gpu.py", "tests/ops/elsa/test_elsa_gpu.py",
                 "tests/ops/test_fused_attention_range.py", "tests/ops/attention/test_flash.py", "tests/ops/attention/test_flash_autograd_paths.py",
                 "tests/ops/rope/test_rope.py", "tests/ops/cross_entropy/test_cross_entropy.py", "tests/megatron/test_fast_paths.py",
                 "tests/nemo/test_optim_lr_log.py", "tests/megatron/test_sync_free.py",
                 "tests/ops/mlp/test_mlp_gpu.py", "tests/ops/test_tiny_shapes.py"],
                None, 240)]),
    "full-2": dict(
        about="NSA GPU file, the CPU op tests of ELSA and NSA run on CUDA, the ops fuzz on CUDA",
        expect=420, budget=530,
        # the N=4088 NSA cases (marker gpu_big, ~15-45 GB each) run alone after the rest: beside
        # three other xdist workers one of them ran out of memory on an 80 GB H100
        steps=[("pytest", "tests-full-2", 180,
                ["tests/ops/nsa/test_nsa_gpu.py", "tests/ops/nsa/test_nsa.py", "tests/ops/elsa/test_elsa.py"], "not gpu_big", 170),
               ("pytest", "tests-full-2-big", 250, ["tests/ops/nsa/test_nsa_gpu.py"], "gpu_big", 200, 1),
               ("cmd", "ops-fuzz", 95,
                "{py} -m nemo_ssa.testing.ops_fuzz --device cuda --cases 3000 --time-budget 50 "
                "--out {out}/ops-fuzz-cuda.md")]),
    "graphs": dict(
        about="megatron-core's local CUDA graphs (model.cuda_graphs=local) before they can become the default: "
              "the RoPE tests on CUDA, the 114M fwd+bwd with and without graphs (speed and the loss / "
              "gradient-norm parity lines), the plain megatron-core loop 20 steps each way, and the NeMo "
              "main job at micro batch 8, 50 steps each way (step-1 loss equal, held-out at 25 and 50, tokens/s)",
        expect=420, budget=540,
        steps=[("pytest", "tests-rope", 110, ["tests/ops/rope/test_rope.py", "tests/megatron/test_self_attention.py"],
                None, 100),
               ("cmd", "bench-graphs-mb8", 90,
                "{py} benchmarks/bench_model.py --attentions softmax_triton,ssa_triton --micro-batches 8 "
                "--cuda-graph none,local --out {out}/graphs-mb8.md"),
               ("cmd", "megatron-core-none", 45,
                "{py} scripts/train_megatron_core.py --attention ssa_triton --steps 20 --out {out}/mc-none.json"),
               ("cmd", "megatron-core-local", 45,
                "{py} scripts/train_megatron_core.py --attention ssa_triton --steps 20 --cuda-graph local "
                "--out {out}/mc-local.json"),
               ("cmd", "nemo-none", 120,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=50 train.val_check_interval=25 model.cuda_graphs=none "
                "run_dir={out}/nemo-none"),
               ("cmd", "nemo-local", 120,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=50 train.val_check_interval=25 model.cuda_graphs=local "
                "run_dir={out}/nemo-local")]),
    "step-graphs": dict(
        about="where the micro-batch-8 NeMo step with CUDA graphs goes (issue 43 item 3: the step within 1.05x of "
              "fwd+bwd + optimizer): bench_model's fwd+bwd and inner step (optimizer row) with graphs at micro batch "
              "8 and 32, the NeMo main job at micro batch 8 with graphs for ssa and softmax_triton, the ssa one "
              "profiled at steps 40-42 and its trace summarised (host gaps between graph replays)",
        expect=420, budget=540,
        steps=[("cmd", "bench-step-mb8", 110,
                "{py} benchmarks/bench_model.py --attentions softmax_triton,ssa_triton --micro-batches 8 --mode both "
                "--cuda-graph local --out {out}/step-bench-mb8.md"),
               ("cmd", "bench-step-mb32", 110,
                "{py} benchmarks/bench_model.py --attentions softmax_triton,ssa_triton --micro-batches 32 --mode both "
                "--cuda-graph local --out {out}/step-bench-mb32.md"),
               ("cmd", "nemo-mb8-ssa-profile", 120,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=local "
                "profile.start=40 profile.steps=3 run_dir={out}/nemo-mb8-ssa && {py} -m nemo_ssa.tools.profile_summary "
                "{out}/nemo-mb8-ssa/profile/trace.json.gz > {out}/nemo-mb8-ssa-gaps.md"),
               ("cmd", "nemo-mb8-softmax_triton", 100,
                "{py} scripts/pretrain.py attention=softmax_triton compare_to=[] train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=local "
                "run_dir={out}/nemo-mb8-softmax_triton")]),
    "syncs": dict(
        about="every host-device synchronisation of the NeMo step with CUDA graphs, by call site (issue 43: a "
              "sync drains the GPU's queue and the host's Python between it and the next launch is GPU idle "
              "time): the lr log's and the sync-free step's GPU tests, then the main job at micro batch 32 and 8 profiled at steps 40-42 "
              "and each trace summarised (its sync table)",
        expect=360, budget=480,
        steps=[("pytest", "tests-lr-log", 90, ["tests/nemo/test_optim_lr_log.py", "tests/megatron/test_sync_free.py",
                                          "tests/nemo/test_lightning_log.py"],
                None, 80, 1),
               ("cmd", "nemo-mb32-ssa-profile", 150,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.max_steps=60 "
                "train.val_check_interval=60 model.cuda_graphs=local profile.start=40 profile.steps=3 "
                "run_dir={out}/nemo-mb32-ssa && {py} -m nemo_ssa.tools.profile_summary "
                "{out}/nemo-mb32-ssa/profile/trace.json.gz > {out}/nemo-mb32-ssa-gaps.md"),
               ("cmd", "nemo-mb8-ssa-profile", 120,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=local "
                "profile.start=40 profile.steps=3 run_dir={out}/nemo-mb8-ssa && {py} -m nemo_ssa.tools.profile_summary "
                "{out}/nemo-mb8-ssa/profile/trace.json.gz > {out}/nemo-mb8-ssa-gaps.md")]),
    "layernorm-mb8": dict(
        about="model.fused_layernorm at micro batch 8 under graphs, off/on alternated on one tree for 3 rounds "
              "(the order reversed every other round: at mb 8 the run's place in the call moved tokens/s by "
              "10-20 %, more than the option; docs/results/2026-12-02-layernorm-gradbuf)",
        expect=490, budget=540,
        steps=[("cmd", "ln-mb8-ab", 535, _option_ab(
            "ln-mb8", ["off", "on"], "model.fused_layernorm=true", rounds=3, timeout=120,
            job="train.micro_batch_size=8 train.global_batch_size=8 train.max_steps=60 train.val_check_interval=60"))]),
    "layernorm-parity": dict(
        about="model.fused_layernorm's 1,000-step loss parity at micro batch 32 under graphs: off, off again (the "
              "run-to-run spread the gate is judged against) and on, one tree; then the compare tool on the "
              "three curves",
        expect=500, budget=540,
        steps=[("cmd", "ln-parity", 535, _option_ab(
            "ln-parity", ["off", "off_again", "on"], "model.fused_layernorm=true", rounds=1, timeout=175,
            job="train.max_steps=1000 train.val_check_interval=500", compare=True))]),
    "graphs-full": dict(
        about="model.cuda_graphs=full (megatron's whole-iteration graph through NeMo) against local, one tree: "
              "micro batch 8 for 2 rounds and 32 for 1, alternated; summary.json's cuda_graphs_captured says the "
              "training graph was captured, the losses are compared in the table",
        expect=500, budget=540,
        steps=[("cmd", "full-mb8", 340, _option_ab(
                    "full-mb8", ["local", "full"], "model.cuda_graphs=full", rounds=2, timeout=110,
                    job="train.micro_batch_size=8 train.global_batch_size=8 train.max_steps=60 "
                        "train.val_check_interval=60")),
               ("cmd", "full-mb32", 195, _option_ab(
                   "full-mb32", ["local", "full"], "model.cuda_graphs=full", rounds=1, timeout=95,
                   job="train.max_steps=60 train.val_check_interval=60"))]),
    "graphs-full-parity": dict(
        about="model.cuda_graphs=full against local over 1,000 steps at micro batch 8, one tree, after a "
              "20-step uncounted warm-up run: local, local again (the run-to-run spread the gate is judged "
              "against) and full, then the compare tool on the three curves",
        expect=480, budget=540,
        steps=[("cmd", "full-parity-mb8", 535, _option_ab(
                    "full-parity-mb8", ["local", "local_again", "full"], "model.cuda_graphs=full", rounds=1,
                    timeout=140, warmup=20, job="train.micro_batch_size=8 train.global_batch_size=8 train.max_steps=1000 "
                                     "train.val_check_interval=500", compare=True))]),
    "graphs-full-mb32": dict(
        about="model.cuda_graphs=full against local at micro batch 32 over 600 steps after a 20-step "
              "uncounted warm-up run (the first run of a fresh machine also compiles the kernels), the curves "
              "through the compare tool",
        expect=300, budget=540,
        steps=[("cmd", "full-mb32-600", 420, _option_ab(
                   "full-mb32-600", ["local", "full"], "model.cuda_graphs=full", rounds=1, timeout=160, warmup=20,
                   job="train.max_steps=600 train.val_check_interval=300", compare=True))]),
    "icl-dreg": dict(
        about="issue 44: the d-dimensional in-context regression (nemo_ssa.study.icl_train, d 8, k 24) toward "
              "its floor: the graphed step's GPU test, then softmax and ssa x seeds 1-3 for 50,000 steps, one "
              "process per run, each step one CUDA graph, checkpoints under /tmp/icl-dreg (the next call on a "
              "warm machine resumes them), then the table of what finished",
        expect=520, budget=540,
        steps=[("pytest", "tests-icl-graphs", 90, ["tests/test_icl_train.py"], "gpu", 80, 1),
               ("cmd", "icl-dreg", 445,
                "for s in 1 2 3; do for a in softmax ssa; do {py} -m nemo_ssa.study.icl_train --attentions $a "
                "--first-seed $s --seeds 1 --steps 50000 --cuda-graphs --budget-s 330 --checkpoint-every 5000 "
                "--out /tmp/icl-dreg > {out}/icl-dreg-$a-s$s.log 2>&1 & done; done; wait; "
                "{py} -m nemo_ssa.study.icl_train --attentions softmax,ssa --seeds 3 --steps 50000 --cuda-graphs "
                "--budget-s 1 --out /tmp/icl-dreg > {out}/icl-dreg-table.log 2>&1; "
                "mkdir -p {out}/icl-dreg && cp /tmp/icl-dreg/runs/*.json /tmp/icl-dreg/icl.md {out}/icl-dreg/ ; "
                "tail -n 3 {out}/icl-dreg-*-s*.log; tail -n 30 {out}/icl-dreg-table.log; "
                "test -s {out}/icl-dreg/icl.md")]),
    "graphs-full-resume": dict(
        about="model.cuda_graphs=full before it could become a default: the sync-free guard's captured-"
              "iteration GPU test (DDP built on a side stream as NeMo builds it), then a full-graph ssa run "
              "killed at step 45 and resumed (graphs_default.py's resume check: the re-done step's loss to "
              "the last digit, step 60 reached, held-out at 20/40/60, graphs captured)",
        expect=330, budget=480,
        steps=[("pytest", "tests-guard", 90, ["tests/megatron/test_sync_free.py"], "gpu", 80, 1),
               ("cmd", "full-resume", 380,
                "{py} scripts/device/graphs_default.py --only resume --resume-graphs full --out {out}/full-resume")]),
    "full-mb8-profile": dict(
        about="where the micro-batch-8 step goes under model.cuda_graphs=full (issue 43: mb 8 at 0.73x mb 32 "
              "with full; the host costs the layer graphs left -- argument checks per replay, module walks, "
              "the NaN-check reads -- are inside the one graph there): the main job at micro batch 8 and 32 with "
              "full graphs, profiled at steps 40-42, each trace summarised (GPU busy against the step, host gaps, "
              "syncs by call site)",
        expect=300, budget=420,
        steps=[("cmd", "full-mb8-profile", 170,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=full "
                "profile.start=40 profile.steps=3 run_dir={out}/full-mb8 && {py} -m nemo_ssa.tools.profile_summary "
                "{out}/full-mb8/profile/trace.json.gz > {out}/full-mb8-gaps.md"),
               ("cmd", "full-mb32-profile", 200,
                "{py} scripts/pretrain.py attention=ssa compare_to=[] train=gpu_9min train.max_steps=60 "
                "train.val_check_interval=60 model.cuda_graphs=full profile.start=40 profile.steps=3 "
                "run_dir={out}/full-mb32 && {py} -m nemo_ssa.tools.profile_summary "
                "{out}/full-mb32/profile/trace.json.gz > {out}/full-mb32-gaps.md")]),
    "param-copy-ab": dict(
        about="issue 43: megatron's bf16 main->model parameter copy in one foreach call, the per-tensor no-op "
              "casts and detaches of the norm and the clip skipped (host work outside even the whole-iteration "
              "graph: ~100 dispatches each per step in the full-mb8 profile, 2026-12-02-full-mb8-profile), "
              "against its parent at micro batch 8 with model.cuda_graphs=full, 3 rounds alternated; the parent "
              "tree carried: git archive 95624af nemo_ssa recipes scripts | tar -x -C dev/95624af, carry "
              "[\".bundle\", \"dev/95624af\"]",
        expect=470, budget=540,
        steps=[("cmd", "param-copy-ab", 535,
                "{py} scripts/device/step_ab.py --tree before=dev/95624af --tree after=. --rounds 3 "
                "--out {out}/param-copy --timeout 120 -- attention=ssa train=gpu_9min train.micro_batch_size=8 "
                "train.global_batch_size=8 train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=full")]),
    "host-samples": dict(
        about="issue 43: where the NeMo step's host time goes, sampled from outside the process (py-spy "
              "--idle: torch.profiler's with_stack inflates the Python it measures): the main job under "
              "model.cuda_graphs=full at micro batch 8 (400 steps) and 32 (200), each record summarised by "
              "nemo_ssa.tools.host_samples (hooks, functions, the lines the thread waited on); py-spy carried as "
              "a binary: unzip -j the py-spy 0.4.3 manylinux wheel's py-spy into .cache/pyspy/, carry "
              "[\".bundle\", \".cache/pyspy\"]",
        expect=260, budget=540,
        steps=[("cmd", f"host-samples-mb{mb}", lim,
                "chmod +x .cache/pyspy/py-spy && .cache/pyspy/py-spy record --idle --threads --nonblocking -r 500 "
                f"-f speedscope -o {{out}}/host-mb{mb}.json -- {{py}} scripts/pretrain.py attention=ssa compare_to=[] "
                f"train=gpu_9min train.micro_batch_size={mb} train.global_batch_size={mb} train.max_steps={n} "
                f"train.val_check_interval={n} model.cuda_graphs=full run_dir={{out}}/host-mb{mb} && "
                f"{{py}} -m nemo_ssa.tools.host_samples {{out}}/host-mb{mb}.json --top 40 > {{out}}/host-mb{mb}.md")
               for mb, n, lim in ((8, 400, 270), (32, 200, 240))]),
    "pbar-ab": dict(
        about="issue 43: train.progress_bar_values=drop (NeMo's values logged without prog_bar when no "
              "progress bar reads them: Lightning's on_batch_end read each from the device every batch, half "
              "the mb-8 step's host time waiting there by host-samples) against keep at micro batch 8 with "
              "model.cuda_graphs=full, one tree, 2 rounds alternated after a 10-step warm-up, first/last loss "
              "per run; first the GPU tests of the two things it rests on (no device read at a batch's end, "
              "the whole-iteration graph's static-buffer copy ordered after the running step)",
        expect=420, budget=540,
        steps=[("pytest", "pbar-gpu-tests", 80, ["tests/nemo/test_lightning_log.py", "tests/megatron/test_cuda_graphs.py"],
                "gpu", 60, 1),
               ("cmd", "pbar-ab", 455, _keep_drop("pbar-mb8", 2, "train.micro_batch_size=8 train.global_batch_size=8 "
                                                  "train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=full"))]),
    "pbar-parity": dict(
        about="issue 43: train.progress_bar_values=drop's 1,000-step loss parity at micro batch 8 under "
              "model.cuda_graphs=full (where the host running ahead had raced): keep, keep again (the spread "
              "the gate is judged against) and drop, one tree, then the compare tool on the three curves at EMA "
              "0.9: drop gated against keep at 0.05, keep again and drop against keep again shown beside it",
        expect=480, budget=540,
        steps=[("cmd", "pbar-parity", 535,
                "{py} scripts/device/step_ab.py --tree keep=. --tree keep_again=. --tree drop=. "
                "--arm keep=train.progress_bar_values=keep --arm keep_again=train.progress_bar_values=keep "
                "--arm drop=train.progress_bar_values=drop --rounds 1 --warmup-steps 20 --warmup-per tree --out {out}/pbar-parity "
                "--timeout 140 -- attention=ssa train=gpu_9min train.micro_batch_size=8 train.global_batch_size=8 "
                "train.max_steps=1000 train.val_check_interval=500 model.cuda_graphs=full && {py} -m "
                "nemo_ssa.tools.compare keep={out}/pbar-parity/keep-r0 keep_again={out}/pbar-parity/keep_again-r0 "
                "drop={out}/pbar-parity/drop-r0 --ema 0.9 --max-delta 0.05 --gate drop=keep --pair keep_again=keep "
                "--pair drop=keep_again --out {out}/pbar-parity/compare")]),
    "pbar-ab-mb32": dict(
        about="issue 43: pbar-ab on the README's main job as printed (micro batch 32, model.cuda_graphs=auto: "
              "the layer graphs), 2 rounds alternated, first/last loss per run",
        expect=420, budget=540,
        steps=[("cmd", "pbar-ab-mb32", 535, _keep_drop("pbar-mb32", 2, "train.max_steps=80 train.val_check_interval=80"))]),
    "metrics-defer-ab": dict(
        about="issue 43: MetricsCallback reading each block of rows behind a CUDA event (pinned copy, written "
              "once the device has passed it) against its parent's blocking read every 10 steps (py-spy: the "
              "mb-8 thread's only wait, 6 ms a step on average; the step 21.0 ms against 19.15 of GPU work, "
              "2026-12-03-pbar-sync), at micro batch 8 with model.cuda_graphs=full, 2 rounds alternated, "
              "first/last loss per run; first the GPU test that closing a block does not synchronize; the "
              "parent tree carried: git archive 95a5fec nemo_ssa recipes scripts | tar -x -C dev/95a5fec, "
              "carry [\".bundle\", \"dev/95a5fec\"]",
        expect=470, budget=540,
        steps=[("pytest", "metrics-gpu-test", 60, ["tests/test_metrics_callback.py"], "gpu", 45, 1),
               ("cmd", "metrics-defer-ab", 470,
                _metrics_defer("metrics-defer", "train.micro_batch_size=8 train.global_batch_size=8 "
                               "train.max_steps=60 train.val_check_interval=60 model.cuda_graphs=full"))]),
    "metrics-defer-mb32": dict(
        about="issue 43: metrics-defer-ab on the README's main job as printed (micro batch 32, the layer graphs), "
              "2 rounds alternated, 60 steps; the parent tree as there: git archive 95a5fec nemo_ssa recipes scripts | "
              "tar -x -C dev/95a5fec, carry [\".bundle\", \"dev/95a5fec\"]",
        expect=420, budget=540,
        steps=[("cmd", "metrics-defer-mb32", 535,
                _metrics_defer("metrics-defer-mb32", "train.max_steps=60 train.val_check_interval=60"))]),
    "attn-pair-mb32": dict(
        about="issue 43: softmax_triton against ssa on the README's main job (micro batch 32, the layer graphs, "
              "train.progress_bar_values=drop by default), one tree, 2 rounds alternated after a 10-step warm-up: "
              "the ssa >= 0.98x softmax target (0.922x at 80 steps, 2026-12-03-attn-pair), 60 steps",
        expect=420, budget=540,
        steps=[("cmd", "attn-pair-mb32", 535, _attn_pair("attn-pair-mb32", "train.max_steps=60 "
                                                         "train.val_check_interval=60"))]),
    "attn-sdpa-mb32": dict(
        about="issue 43: attn-pair-mb32 with torch SDPA (attention=softmax, cuDNN/flash: the softmax path a "
              "user runs without the plugin's kernels; no layer graphs, which it does not take) against ssa",
        expect=420, budget=540,
        steps=[("cmd", "attn-sdpa-mb32", 535, _attn_pair("attn-sdpa-mb32", "train.max_steps=60 "
                                                         "train.val_check_interval=60", base="softmax"))]),
    "attn-pair-mb8": dict(
        about="issue 43: attn-pair-mb32 at micro batch 8 under model.cuda_graphs=full (60 steps): the two "
              "attentions where the step is now GPU-bound to ~9 % (2026-12-03-pbar-sync)",
        expect=420, budget=540,
        steps=[("cmd", "attn-pair-mb8", 535, _attn_pair("attn-pair-mb8", "train.micro_batch_size=8 "
                                                        "train.global_batch_size=8 train.max_steps=60 "
                                                        "train.val_check_interval=60 model.cuda_graphs=full"))]),
    "icl-outlier-a": dict(
        about="issue 44: the paper's linear in-context task retrained for its outlier_after grid, first half: "
              "softmax and ssa seed 1 (one process, 2 at once) beside softmax seed 2, 50,000 steps each, TF32, "
              "graphs; 2 calls and a short third back to back on one warm machine (each resumes the last's "
              "checkpoints; a finished run is reused), then the run JSONs",
        expect=535, budget=540,
        steps=[("cmd", "icl-outlier-a", 535, _icl_linear([("softmax,ssa", 1), ("softmax", 2)], ICL_BUDGET_S))]),
    "icl-outlier-b": dict(
        about="issue 44: the second half of icl-outlier-a: ssa seed 2 beside softmax and ssa seed 3",
        expect=535, budget=540,
        steps=[("cmd", "icl-outlier-b", 535, _icl_linear([("ssa", 2), ("softmax,ssa", 3)], ICL_BUDGET_S))]),
    "icl-deterministic": dict(
        about="issue 44: icl_paper --deterministic on CUDA (two fresh ssa runs equal to the last bit, the "
              "two-kernel backward noted; the default single pass adds dQ with fp32 atomics, which is why a "
              "retrained ssa run left the pinned one at step 22,100: 2026-12-02-icl-outlier-after)",
        expect=120, budget=200,
        steps=[("pytest", "tests-icl-paper", 150, ["tests/test_icl_paper.py"], "gpu", 140, 1)]),
    "graphs-default": dict(
        about="the checks model.cuda_graphs=auto (local where they passed) rests on, on two GPUs "
              "(scripts/device/graphs_default.py): softmax_triton's 1,000-step parity through NeMo, a graphed "
              "run killed and resumed, data parallel 2 with graphs",
        expect=460, budget=540,
        steps=[("cmd", "graphs-default", 530, "{py} scripts/device/graphs_default.py --out {out}/graphs-default")]),
}


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_command(files, marker, timeout, workers: int, log: str, extra: str = "") -> str:
    """The pytest command line of a preset step (xdist / timeout only when installed)."""
    parts = [shlex.quote(sys.executable), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
             "--durations=25", "--durations-min=1.0"]
    if marker:
        parts += ["-m", shlex.quote(marker)]
    if workers > 1 and _have("xdist"):
        parts += ["-n", str(workers), "--dist", "loadgroup"]
    if timeout and _have("pytest_timeout"):
        parts += ["--timeout", str(int(timeout))]
    parts += [shlex.quote(f) for f in files]
    if extra:
        parts.append(extra)
    return f"NEMO_SSA_TEST_LOG={shlex.quote(log)} " + " ".join(parts)


def install_bundle(out: str) -> str:
    """Install ``.whl/*.whl`` (offline bundle) to a site dir on PYTHONPATH, or the wheels of
    ``.bundle/bundle.tar.xz`` (scripts/device/pack_bundle.py) where there is no ``.whl/``."""
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))
    packed = os.path.join(REPO, ".bundle", "bundle.tar.xz")
    if not wheels and os.path.isfile(packed):
        unpacked = tempfile.mkdtemp(prefix="nemo-ssa-wheels-")
        with tarfile.open(packed) as tar:
            tar.extractall(unpacked)
        wheels = sorted(glob.glob(os.path.join(unpacked, "*.whl")))
    if not wheels:
        return "no .whl/ or .bundle/ bundle: skipped"
    site = "/tmp/nemo-ssa-site"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", site, *wheels],
                          capture_output=True, text=True)
    with open(os.path.join(out, "bundle.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return f"bundle install FAILED (rc {proc.returncode}, see bundle.log)"
    os.environ["PYTHONPATH"] = site + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return f"installed {len(wheels)} wheels to {site} in {time.time() - t0:.0f} s"


#: what the archive leaves out: a run's checkpoints (a 50-step NeMo run writes ~2 GB of them;
#: packing two took a call's last 230 s and the archive could not come back anyway) and any
#: file over this size; ``left-out.txt`` in the archive names each
PACK_SKIP_DIRS = ("checkpoints",)
PACK_MAX_FILE = 32 << 20


#: what every preset's steps import beyond torch and triton (the device image has those)
STACK_MODULES = ("megatron.core",)


def missing_stack(modules=None) -> list:
    """The modules of ``modules`` that do not import in a fresh interpreter (with this process's
    PYTHONPATH, so after ``install_bundle``)."""
    missing = []
    for m in STACK_MODULES if modules is None else modules:
        proc = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            missing.append(m)
    return missing


def pack(out: str) -> list:
    """``{out}/session.tgz`` of everything under ``out`` but checkpoints and large files (named
    in ``left-out.txt``); returns the top-level entries packed."""
    tgz = os.path.join(out, "session.tgz")
    entries = [e for e in sorted(os.listdir(out)) if e != "session.tgz"]
    left = []

    def keep(info):
        parts = info.name.split("/")
        if info.isdir() and parts[-1] in PACK_SKIP_DIRS or info.isfile() and info.size > PACK_MAX_FILE:
            left.append(f"{info.name} ({'a checkpoint folder' if info.isdir() else f'{info.size:,} bytes'})")
            return None
        return info

    with tarfile.open(tgz, "w:gz") as tar:
        for entry in entries:
            tar.add(os.path.join(out, entry), arcname=entry, filter=keep)
        if left:
            data = ("\n".join(left) + "\n").encode()
            info = tarfile.TarInfo("left-out.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return entries


def _device_info() -> dict:
    code = ("import json, torch, triton; d = torch.cuda.is_available(); print(json.dumps(dict("
            "device=torch.cuda.get_device_name() if d else 'no CUDA device', torch=torch.__version__, "
            "triton=triton.__version__, cuda=torch.version.cuda)))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - the report must still be written
        return {"device": f"unknown ({type(e).__name__})"}


def _commit(arg) -> str:
    """The commit the results file names: ``--commit``, else git's HEAD, marked where the tree
    differs from it (the device's copy of a checkout can sit on main's landed head with the
    session's commits as changes: its HEAD alone named a tree that did not run)."""
    if arg:
        return arg
    try:
        git = ["git", "-C", REPO]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        if not head:
            return "unknown (pass --commit)"
        changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=30).stdout.strip()
        return f"{head} with uncommitted changes (pass --commit)" if changed else head
    except Exception:  # noqa: BLE001
        return "unknown (pass --commit)"


def read_test_log(path: str):
    """(collected ids in order, {id: record}) from a NEMO_SSA_TEST_LOG file."""
    collected, results = [], {}
    if not os.path.isfile(path):
        return collected, results
    for line in open(path, errors="replace"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "collected" in rec:
            for t in rec["collected"]:
                if t not in results and t not in collected:
                    collected.append(t)
        elif "test" in rec:
            results[rec["test"]] = rec
    for t in results:  # a result for an id no collection line listed (should not happen)
        if t not in collected:
            collected.append(t)
    return collected, results


def results_markdown(preset: str, logs, info: dict, commit: str, commands, rows, bundle: str) -> str:
    """The results file: header (device, date, commit, versions, commands), totals, one row per test."""
    lines = [f"# GPU tests, preset `{preset}` ({info.get('device', '?')}, {time.strftime('%Y-%m-%d')})", "",
             f"- commit: `{commit}`; torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
             f"CUDA {info.get('cuda', '?')}",
             f"- command: `python scripts/device/gpu_session.py --preset {preset}` ({PRESETS[preset]['about']})",
             f"- bundle: {bundle}"]
    for name, rc, secs in rows:
        lines.append(f"- step `{name}`: exit {rc}, {secs:.0f} s")
    for cmd in commands:
        lines.append(f"  - `{cmd}`")
    table, totals, failures = [], {}, []
    for log in logs:
        collected, results = read_test_log(log)
        for t in collected:
            r = results.get(t)
            outcome = r["outcome"] if r else "not run (time limit)"
            secs = f"{r['seconds']:.1f}" if r else ""
            totals[outcome] = totals.get(outcome, 0) + 1
            table.append(f"| `{t}` | {outcome} | {secs} |")
            if r and r["outcome"] in ("failed", "error"):
                failures.append(f"- `{t}`: {r.get('message', '')}")
    total_s = sum(r["seconds"] for log in logs for r in read_test_log(log)[1].values())
    lines += ["", "**" + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())) +
              f"** ({len(table)} tests, {total_s:.0f} s of test time)", ""]
    if failures:
        lines += ["## Failures", ""] + failures + [""]
    lines += ["| test | outcome | seconds |", "|---|---|---|"] + table
    return "\n".join(lines) + "\n"


def run_steps(steps, out: str, budget: float, t0: float):
    rows = []
    for name, secs, cmd in steps:
        left = budget - (time.time() - t0)
        if left < 5:
            rows.append((name, "skipped (budget)", 0.0))
            continue
        limit = min(secs, left)
        log_path = os.path.join(out, f"{name}.log")
        start = time.time()
        with open(log_path, "w") as log:
            log.write(f"$ {cmd}\n")
            log.flush()
            proc = subprocess.Popen(cmd.replace("{out}", out), shell=True, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"killed at {limit:.0f} s"
        rows.append((name, rc, time.time() - start))
        print(f"[session] {time.time() - t0:6.0f}s {name}: {rc} ({time.time() - start:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="*", metavar="NAME:SECONDS:COMMAND")
    ap.add_argument("--out", help="output folder (the device's $OUT)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named step list (the GPU test plan)")
    ap.add_argument("--list-presets", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all steps together "
                    "(default 560, or the preset's)")
    ap.add_argument("--tail", type=int, default=25, help="log lines shown per step")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers of a preset (GPU memory: "
                    "the largest references take ~15 GB; 4 fit an 80 GB card)")
    ap.add_argument("--commit", default=None, help="commit recorded in the results file (default: git, if any)")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments of a preset (e.g. \"-k nsa\")")
    ap.add_argument("--no-bundle", action="store_true", help="do not install .whl/ even if present")
    args = ap.parse_args(argv)
    if args.list_presets:
        for name, p in PRESETS.items():
            print(f"{name:7s} ~{p['expect']} s (budget {p['budget']} s): {p['about']}")
        return 0
    if not args.out:
        ap.error("--out is required")
    if bool(args.preset) == bool(args.steps):
        ap.error("give either --preset NAME or NAME:SECONDS:COMMAND steps")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    steps, logs, commands, bundle, results_name = [], [], [], "", None
    # free-form steps too: a step that imports the stack (or fla, a baseline) needs the bundle
    # as much as a preset does
    bundle = "--no-bundle" if args.no_bundle else install_bundle(out)
    print(f"[session] bundle: {bundle}", flush=True)
    missing = [] if args.no_bundle else missing_stack()
    if missing:
        # every preset and the recipe import the stack: without it each step fails in seconds
        # and the call's start-up is spent for nothing
        print(f"[session] stopped before any step: {', '.join(missing)} does not import (bundle: {bundle}). "
              "Carry the offline bundle (bash scripts/build_offline_bundle.sh && python3 "
              "scripts/device/pack_bundle.py, then carry [\".bundle\"]) or pass --no-bundle to run anyway.",
              flush=True)
        return 2
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ.setdefault(var, os.path.join(REPO, ".cache", sub))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.preset:
        preset = PRESETS[args.preset]
        budget = preset["budget"] if args.budget is None else args.budget
        for step in preset["steps"]:
            if step[0] == "pytest":
                _, name, secs, files, marker, timeout = step[:6]
                workers = step[6] if len(step) > 6 else args.workers
                log = os.path.join(out, f"{name}.jsonl")
                if os.path.exists(log):
                    os.remove(log)
                logs.append(log)
                cmd = pytest_command(files, marker, timeout, workers, log, args.pytest_args)
            else:
                _, name, secs, cmd = step
                cmd = cmd.replace("{py}", shlex.quote(sys.executable))
            commands.append(cmd.replace(out, "$OUT"))
            steps.append((name, secs, cmd))
        results_name = f"gpu-tests-{args.preset}.md"
    else:
        budget = 560.0 if args.budget is None else args.budget
        for spec in args.steps:
            try:
                name, secs, cmd = spec.split(":", 2)
                steps.append((name, float(secs), cmd))
            except ValueError:
                raise SystemExit(f"step {spec!r} is not NAME:SECONDS:COMMAND") from None
    rows = run_steps(steps, out, budget, t0)
    if results_name:
        md = results_markdown(args.preset, logs, _device_info(), _commit(args.commit), commands, rows, bundle)
        with open(os.path.join(out, results_name), "w") as f:
            f.write(md)
    tails = {}
    for name, _, _ in rows:
        path = os.path.join(out, f"{name}.log")
        if os.path.isfile(path):
            tails[name] = open(path, errors="replace").read().splitlines()[-args.tail:]
    entries = pack(out)
    for entry in entries:  # only the archive (and a preset's results file) goes back
        if entry == results_name:
            continue
        path = os.path.join(out, entry)
        (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
    for name, lines in tails.items():
        print(f"\n===== {name} (last {args.tail} lines)\n" + "\n".join(lines))
    if results_name:
        md = open(os.path.join(out, results_name)).read().splitlines()
        head = [ln for ln in md if not ln.startswith("| `")]
        print(f"\n===== {results_name} (tests listed in the file)\n" + "\n".join(head[:60]))
    print("\n| step | exit | seconds |\n|---|---|---|")
    for name, rc, secs in rows:
        print(f"| {name} | {rc} | {secs:.0f} |")
    return 0 if all(rc == 0 for _, rc, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
