# Issue 28, second device call: TMA tests + flash GPU gates on the new tables, single-pass TMA sweep,
# the four D64/D128 shapes (two-kernel TMA backward), NSA beside fla
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r2; mkdir -p $R
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/attention/test_flash_tma.py tests/ops/attention/test_flash_gpu.py > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -4 $R/tests.txt
for tr in softmax ssa; do
  timeout 100 python3 -m benchmarks.tune_tiles --tma --transform $tr --kernels bwd_single --shapes d64-n8k,d128 --out $R/tune_single_$tr.md > $R/tune_single_$tr.log 2>&1; echo "tune $tr rc=$?"; grep -E "best|precompiled" $R/tune_single_$tr.log
done
timeout 120 python3 -m benchmarks.bench_attention --wide --out $R/bench_wide.md > $R/bench_wide.log 2>&1; echo "bench rc=$?"; grep -E "^\|" $R/bench_wide.md | head -30
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --only sdpa_flash,nsa_layer,fla_nsa --out $R/nsa_fla.md > $R/nsa_fla.log 2>&1; echo "nsa rc=$?"; grep -E "^\|" $R/nsa_fla.md | head -20
tar czf $OUT/call2.tgz -C $R .
