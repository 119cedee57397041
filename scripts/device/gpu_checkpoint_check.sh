#!/usr/bin/env bash
# Checkpoint round trip of the 114M recipe through NeMo on one GPU, attention=ssa:
#   A  distributed optimizer on, checkpoint at step 6: documents megatron-core 0.15.3's
#      failure on [1]-shaped fp32 parameters (expected to fail; the default is off);
#   B  60 steps, checkpoints at 30 and 60;
#   C  resume=true from B's run dir to 90 steps: continues at step 61 from the saved n.
# Writes B/C metrics and a log to OUT.   bash scripts/device/gpu_checkpoint_check.sh [OUT]
set -uo pipefail
out="${1:-${OUT:-runs/gpu_ckpt}}"
mkdir -p "$out" runs
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/nemo-ssa-site .whl/*.whl && export PYTHONPATH=/tmp/nemo-ssa-site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
common="attention=ssa compare_to=[] train=gpu_9min train.warmup_steps=5 train.limit_val_batches=1"
run() {  # name, extra args...
    local name=$1; shift
    python3 scripts/pretrain.py $common "$@" > "runs/ck-$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc" | tee -a "$out/check.log"
    grep -E "\[pretrain\]|AssertionError|Error" "runs/ck-$name.log" | tail -4 | cut -c1-240 | tee -a "$out/check.log"
}
run A run_dir=runs/ckA train.max_steps=12 train.val_check_interval=6 train.ckpt_every_n_steps=6 train.distributed_optimizer=true
run B run_dir=runs/ckB train.max_steps=60 train.val_check_interval=30 train.ckpt_every_n_steps=30
cp runs/ckB/metrics.csv "$out/B_metrics.csv"
run C run_dir=runs/ckB train.max_steps=90 train.val_check_interval=30 train.ckpt_every_n_steps=30 resume=true
cp runs/ckB/metrics.csv "$out/BC_metrics.csv"
find runs/ckB -maxdepth 4 -name "*step*" | head -10 | tee -a "$out/check.log"
