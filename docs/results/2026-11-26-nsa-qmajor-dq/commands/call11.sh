# Issue 28 (NSA), call 11: the final defaults through bench_nsa with at least 3 warm-up and 10
# timed calls per row -- GQA 16 (with fla's parallel_nsa), D64/D128, 16K/64K; then GQA 3.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r11; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
timeout 330 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 64 --hkv 4 --compress mean --only nsa_layer,fla_nsa --out $R/bench_gqa16.md > $R/bench_gqa16.log 2>&1; echo "bench gqa16 rc=$?"
grep -E "nsa_layer|fla" $R/bench_gqa16.log | grep -v skipped
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 24 --hkv 8 --compress mean --only nsa_layer --out $R/bench_gqa3.md > $R/bench_gqa3.log 2>&1; echo "bench gqa3 rc=$?"
grep -E "nsa_layer" $R/bench_gqa3.log
