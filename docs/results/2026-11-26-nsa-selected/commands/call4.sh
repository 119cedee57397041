set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r4; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt; git diff --stat >> $R/commit.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/test_tiny_shapes.py -k nsa > $R/tiny.txt 2>&1; echo "tiny rc=$?"; tail -1 $R/tiny.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa.py -k "selected or row_delta or layer" > $R/nsa_cuda.txt 2>&1; echo "nsa rc=$?"; tail -1 $R/nsa_cuda.txt
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 24 --hkv 8 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,selected,window,compressed,selection --out $R/d64_gqa3.md > $R/g3_64.log 2>&1; echo "g3d64 rc=$?"
grep -E "^\| [0-9]" $R/d64_gqa3.md
timeout 120 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 24 --hkv 8 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/d128_gqa3.md > $R/g3_128.log 2>&1; echo "g3d128 rc=$?"
grep -E "^\| [0-9]" $R/d128_gqa3.md
timeout 110 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --transform ssa --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/ssa_d64_gqa16.md > $R/ssa.log 2>&1; echo "ssa rc=$?"
grep -E "^\| [0-9]" $R/ssa_d64_gqa16.md
tar czf $OUT/call4.tgz -C $R .
