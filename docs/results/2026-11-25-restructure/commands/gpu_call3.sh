set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
R=/tmp/r3; mkdir -p $R
# the study: softmax vs ssa, 3 seeds, gpu_9min (375 steps), 3 runs at once on this GPU
(timeout 540 python3 scripts/study.py --attentions softmax,ssa --seeds 3 --parallel 3 --out /tmp/study \
   -- train.val_check_interval=75 train.limit_val_batches=4 > $R/study.log 2>&1; echo "study rc=$?" >> $R/study.log) &
ST=$!
# in-context regression: one process per attention, one shared --out (runs saved as they finish)
(timeout 520 python3 -m nemo_ssa.study.icl_train --attentions softmax --seeds 3 --out $R/icl > $R/icl_softmax.log 2>&1; echo "rc=$?" >> $R/icl_softmax.log) &
I1=$!
(timeout 520 python3 -m nemo_ssa.study.icl_train --attentions ssa --seeds 3 --out $R/icl > $R/icl_ssa.log 2>&1; echo "rc=$?" >> $R/icl_ssa.log) &
I2=$!
# tiny lengths, after the for_lengths fix (GPU file: bf16, D32 every op, D64/D128 flash)
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/ops/test_tiny_shapes.py > $R/tiny_tests.log 2>&1; echo "tiny tests rc=$?"
tail -5 $R/tiny_tests.log
wait $I1 $I2
timeout 60 python3 -m nemo_ssa.study.icl_train --attentions softmax,ssa --seeds 3 --out $R/icl > $R/icl_table.log 2>&1
wait $ST
tail -4 $R/study.log
mkdir -p $R/study; cp /tmp/study/*.md /tmp/study/*.png /tmp/study/*.log $R/study/ 2>/dev/null
for d in /tmp/study/*/; do n=$(basename $d); mkdir -p $R/study/$n; cp $d/*.csv $d/*.json $R/study/$n/ 2>/dev/null; done
tar czf $OUT/call3.tgz -C $R .
cat $R/icl/icl.md | head -45
cat /tmp/study/study.md | head -60
