# ssa_reference x 3 seeds for the study (same overrides as the study's runs, plus checkpoints
# every 75 steps so a second call resumes; micro batch 4 x 8 accumulation = global 32, so three
# fit one H200). Usage: bash gpu_ssa_reference.sh LIMIT_SECONDS
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
S=/tmp/study; mkdir -p $S
O="train.val_check_interval=75 train.limit_val_batches=4 train.ckpt_every_n_steps=75 attention.max_micro_batch_size=4"
one() {  # seed
  d=$S/ssa_reference-s$1; r=false
  [ -f $d/metrics.csv ] && [ ! -f $d/complete.json ] && r=true
  timeout $LIMIT python3 scripts/pretrain.py attention=ssa_reference seed=$1 run_dir=$d compare_to=[] \
    reuse_if_complete=true resume=$r $O >> $S/ssa_reference-s$1.log 2>&1
  echo "seed $1 exit $? resume=$r"
}
LIMIT=${1:-540}
if [ "$MEM" -gt 120000 ]; then one 1234 & one 1235 & one 1236 & wait
else one 1234 & one 1235 & wait; one 1236; fi
for s in 1234 1235 1236; do d=$S/ssa_reference-s$s; echo "$s: $(tail -1 $d/metrics.csv 2>/dev/null | cut -c1-60) complete=$(test -f $d/complete.json && echo yes || echo no)"; grep -h "metrics\]" $S/ssa_reference-s$s.log | tail -1; done
mkdir -p /tmp/pack; for s in 1234 1235 1236; do d=$S/ssa_reference-s$s; mkdir -p /tmp/pack/ssa_reference-s$s; cp $d/*.csv $d/*.json /tmp/pack/ssa_reference-s$s/ 2>/dev/null; cp $S/ssa_reference-s$s.log /tmp/pack/; done
tar czf $OUT/ssa_reference.tgz -C /tmp/pack .
