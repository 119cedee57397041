# Issue 28 (NSA), call 3: the dq query-major backward at its final tiles -- the GPU tests of the
# selected branch, the 32-row sweep against fp32 (probe_dq3.py), then bench_nsa (layer, fla) at
# GQA 16 twice and GQA 3 once.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r3; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "selected_backward_gqa16 or qmajor_tma" -rA > $R/test_gpu.txt 2>&1; echo "gpu tests rc=$?"; tail -1 $R/test_gpu.txt; grep -E "^FAILED" $R/test_gpu.txt | head
PYTHONPATH=$PWD:$PYTHONPATH timeout 100 python3 docs/results/2026-11-26-nsa-qmajor-dq/commands/probe_dq3.py > $R/probe3.txt 2>&1; echo "probe rc=$?"
grep -E "^\|" $R/probe3.txt; grep -E "Error|error" $R/probe3.txt | head -5
for run in 1 2; do
timeout 140 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 64 --hkv 4 --compress mean --only nsa_layer,fla_nsa --rep-ms 100 --out $R/bench_gqa16_run$run.md > $R/bench_gqa16_run$run.log 2>&1; echo "bench gqa16 run$run rc=$?"
grep -E "nsa_layer|fla" $R/bench_gqa16_run$run.log | grep -v skipped
done
timeout 90 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 24 --hkv 8 --compress mean --only nsa_layer --rep-ms 100 --out $R/bench_gqa3.md > $R/bench_gqa3.log 2>&1; echo "bench gqa3 rc=$?"
grep -E "nsa_layer" $R/bench_gqa3.log
