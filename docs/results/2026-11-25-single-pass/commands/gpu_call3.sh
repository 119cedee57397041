set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
X="train.val_check_interval=1000 train.limit_val_batches=1"
timeout 330 python3 scripts/parity.py train --runs ssa_triton:1234 --steps 1000 --time-limit 320 --out $OUT/single --scratch /tmp/pA --extra $X > $OUT/single.log 2>&1 &
sleep 30
NEMO_SSA_BWD=deterministic timeout 330 python3 scripts/parity.py train --runs ssa_triton:1234 --steps 1000 --time-limit 290 --out $OUT/det --scratch /tmp/pB --extra $X > $OUT/det.log 2>&1
wait
tail -5 $OUT/single.log; tail -5 $OUT/det.log
ls $OUT/single $OUT/det
