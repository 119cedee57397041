set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r14; mkdir -p $R
T="--ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --transform ssa --rep-ms 60 --warmup-ms 20"
timeout 150 python3 benchmarks/bench_nsa.py $T --only sdpa_flash,nsa_layer,compressed,selection,selected,window --out $R/ssa_fastlog2.md > $R/bench.log 2>&1; echo "bench rc=$?"
grep -E "^\| [0-9]" $R/ssa_fastlog2.md
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "ssa and not 4088" -rA > $R/gpu_ssa.txt 2>&1; echo "tests rc=$?"; grep -E "PASSED|FAILED|passed|failed" $R/gpu_ssa.txt | tail -6
tar czf $OUT/call14.tgz -C $R .
