set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
R=/tmp/r4; mkdir -p $R
# NSA per-branch times at the shape (alone on the GPU)
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --out $R/nsa_d64_gqa16.md > $R/nsa.log 2>&1; echo "nsa rc=$?"
# ICL: seeds 4..10 of both attentions, one process each, beside the 6 runs of call 3
mkdir -p $R/icl/runs; cp docs/results/2026-11-25-study/icl/runs/*.json $R/icl/runs/
for a in softmax ssa; do for s in 4 5 6 7 8 9 10; do
  (timeout 330 python3 -m nemo_ssa.study.icl_train --attentions $a --first-seed $s --seeds 1 --out $R/icl > $R/icl_${a}_$s.log 2>&1) &
done; done
timeout 250 python3 scripts/gpu_session.py --preset quick --out $R/quick --commit $(cat .commit 2>/dev/null || echo unknown) > $R/quick.log 2>&1; echo "quick rc=$?"
tail -12 $R/quick.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/test_tiny_shapes.py -k nsa > $R/tiny_nsa.log 2>&1; echo "tiny nsa rc=$?"; tail -2 $R/tiny_nsa.log
wait
timeout 60 python3 -m nemo_ssa.study.icl_train --attentions softmax,ssa --seeds 10 --out $R/icl > $R/icl_table.log 2>&1; echo "icl table rc=$?"
rm -f $R/icl/icl.json
tar czf $OUT/call4.tgz -C $R .
cat $R/nsa_d64_gqa16.md
sed -n '/Seed-paired/,$p' $R/icl/icl.md
