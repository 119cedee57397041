set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
df -h /dev/shm | tail -1
X="train.val_check_interval=1000 train.limit_val_batches=1"
U="model.fused_mlp=false,model.fused_cross_entropy=false"
timeout 250 python3 scripts/parity.py train --runs softmax:1234 --steps 1000 --time-limit 240 --out $OUT/fused --scratch /tmp/pA --extra $X > $OUT/fused.log 2>&1 &
sleep 40
timeout 250 python3 scripts/parity.py train --runs softmax:1234:$U,attention.options.fused_rope_layout=false --steps 1000 --time-limit 200 --out $OUT/unfused --scratch /tmp/pB --extra $X > $OUT/unfused.log 2>&1
wait
tail -4 $OUT/fused.log; tail -4 $OUT/unfused.log
T=$(( 560 - SECONDS ))
timeout $T python3 scripts/parity.py train --runs ssa_reference:1234:$U --steps 1000 --time-limit $(( T - 15 )) --out $OUT/ref --scratch /tmp/pC --extra $X > $OUT/ref.log 2>&1
tail -4 $OUT/ref.log
