set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
X="train.val_check_interval=1000 train.limit_val_batches=1"
# A: the defaults (fused RoPE+layout, fused MLP, chunked linear+CE)
timeout 560 python3 scripts/parity.py train --runs softmax:1234 ssa_triton:1234 --steps 1000 --per-gpu 2 --stagger 30 \
  --time-limit 520 --out $OUT/fused --scratch /tmp/pA --extra $X > $OUT/fused.log 2>&1 &
sleep 45
# B: megatron's layers (its RoPE + copies, its MLP, its output layer + CE); ssa_reference is unfused throughout
timeout 515 python3 scripts/parity.py train --runs softmax:1234:model.fused_mlp=false,model.fused_cross_entropy=false,attention.options.fused_rope_layout=false \
  ssa_reference:1234:model.fused_mlp=false,model.fused_cross_entropy=false --steps 1000 --per-gpu 2 --stagger 30 \
  --time-limit 470 --out $OUT/unfused --scratch /tmp/pB --extra $X > $OUT/unfused.log 2>&1
wait
tail -8 $OUT/fused.log; tail -8 $OUT/unfused.log
ls -la $OUT/fused $OUT/unfused
