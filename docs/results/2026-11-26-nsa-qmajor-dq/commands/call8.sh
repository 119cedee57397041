# Issue 28 (NSA), call 8: the final defaults (query-major dq, wide importance tiles at GQA >= 16)
# -- the NSA GPU tests, then bench_nsa: GQA 16 (with fla's parallel_nsa) and GQA 3.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r8; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -rA > $R/test_nsa_gpu.txt 2>&1; echo "gpu tests rc=$?"; tail -1 $R/test_nsa_gpu.txt; grep -E "^FAILED" $R/test_nsa_gpu.txt | head
timeout 230 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 64 --hkv 4 --compress mean --only nsa_layer,fla_nsa --rep-ms 100 --out $R/bench_gqa16.md > $R/bench_gqa16.log 2>&1; echo "bench gqa16 rc=$?"
grep -E "nsa_layer|fla" $R/bench_gqa16.log | grep -v skipped
timeout 110 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 24 --hkv 8 --compress mean --only nsa_layer --rep-ms 100 --out $R/bench_gqa3.md > $R/bench_gqa3.log 2>&1; echo "bench gqa3 rc=$?"
grep -E "nsa_layer" $R/bench_gqa3.log
