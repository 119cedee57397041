# Issue 28 (NSA), call 4: where the layer's time goes with the query-major dq -- bench_nsa's
# branch rows at 64K, D128 GQA 16 and D64/D128 GQA 3.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r4; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
O=nsa_layer,compressed,selection,selected,window
timeout 200 python3 benchmarks/bench_nsa.py --ns 65536 --dims 128 --hq 64 --hkv 4 --compress mean --only $O --rep-ms 100 --out $R/parts_d128_gqa16.md > $R/parts_d128_gqa16.log 2>&1; echo "rc=$?"
grep -E "ms" $R/parts_d128_gqa16.log
timeout 200 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 24 --hkv 8 --compress mean --only $O --rep-ms 100 --out $R/parts_gqa3.md > $R/parts_gqa3.log 2>&1; echo "rc=$?"
grep -E "ms" $R/parts_gqa3.log
