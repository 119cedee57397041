# Issue 28 (NSA), call 9: the final defaults -- the selection and selected-branch GPU tests,
# then bench_nsa's layer row at 64K: D128 twice, D64 once (GQA 16).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r9; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "selection_scores or selected_backward_gqa16 or qmajor_tma" -rA > $R/test_gpu.txt 2>&1; echo "gpu tests rc=$?"; tail -1 $R/test_gpu.txt; grep -E "^FAILED" $R/test_gpu.txt | head
for run in 1 2; do
timeout 120 python3 benchmarks/bench_nsa.py --ns 65536 --dims 128 --hq 64 --hkv 4 --compress mean --only nsa_layer --rep-ms 100 --out $R/bench_d128_64k_run$run.md > $R/bench_d128_64k_run$run.log 2>&1; echo "d128 run$run rc=$?"
grep -E "ms" $R/bench_d128_64k_run$run.log
done
timeout 100 python3 benchmarks/bench_nsa.py --ns 65536 --dims 64 --hq 64 --hkv 4 --compress mean --only nsa_layer --rep-ms 100 --out $R/bench_d64_64k.md > $R/bench_d64_64k.log 2>&1; echo "d64 rc=$?"
grep -E "ms" $R/bench_d64_64k.log
