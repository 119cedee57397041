#!/usr/bin/env bash
# GPU proof for the foundation: the 114M recipe through NeMo on one H100/H200 for STEPS
# steps with attention=softmax and attention=ssa (local corpus, micro batch 8, seq 1024,
# bf16). Writes <attention>_metrics.csv, <attention>_summary.json and proof.log to OUT.
#
#   bash scripts/device/gpu_proof.sh [STEPS] [OUT]
#
# On a node without internet, install the offline bundle first (docs/offline-bundle.md);
# this script does it when .whl/ is present.
set -uo pipefail
steps="${1:-200}"
out="${2:-${OUT:-runs/gpu_proof}}"
mkdir -p "$out" runs
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/nemo-ssa-site .whl/*.whl && export PYTHONPATH=/tmp/nemo-ssa-site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/proof.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/proof.log"
for att in softmax ssa; do
    echo "=== attention=$att ($steps steps) ===" | tee -a "$out/proof.log"
    start=$(date +%s)
    # model.cuda_graphs=none: the README main job's story runs both without graphs (softmax has none)
    python3 scripts/pretrain.py attention=$att compare_to=[] train=gpu_9min model.cuda_graphs=none train.max_steps=$steps \
        train.warmup_steps=$(( steps / 10 )) train.val_check_interval=$steps train.limit_val_batches=2 \
        run_dir=runs/proof-$att > "runs/proof-$att.log" 2>&1
    rc=$?
    grep -E "\[pretrain\]|Error|error:|Traceback|out of memory" "runs/proof-$att.log" | tail -20 | tee -a "$out/proof.log"
    tail -40 "runs/proof-$att.log" > "$out/${att}_tail.log"
    echo "rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/proof.log"
    cp runs/proof-$att/metrics.csv "$out/${att}_metrics.csv" 2>/dev/null
    cp runs/proof-$att/summary.json "$out/${att}_summary.json" 2>/dev/null
done
python3 - "$out" <<'PY' | tee -a "$out/proof.log"
import json, sys, os
out = sys.argv[1]
print(f"{'attention':12s} {'tok/s':>10s} {'peak GiB':>9s} {'loss@100':>9s} {'loss@200':>9s}")
for att in ("softmax", "ssa"):
    p = os.path.join(out, f"{att}_summary.json")
    if not os.path.exists(p):
        print(f"{att:12s} (no summary)"); continue
    s = json.load(open(p)); loss = s["loss"]
    g = lambda k: loss.get(str(k), float("nan"))
    print(f"{att:12s} {s['tokens_per_s_median'] or float('nan'):10.0f} {s['peak_memory_gib'] or float('nan'):9.2f} {g(100):9.4f} {g(200):9.4f}")
PY
