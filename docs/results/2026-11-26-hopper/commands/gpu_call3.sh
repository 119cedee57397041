# Issue 28, third device call: TMA tests on the GPU (incl. the default tables above MIN_SCORES and
# the single pass's dq tile reduce), the GPU quick preset, the four D64/D128 shapes with the
# single pass for SSA D64 and the poly-log2 row, and the D=32 shapes (no change expected)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r3; mkdir -p $R
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/ops/attention/test_flash_tma.py > $R/test_tma.txt 2>&1; echo "tma tests rc=$?"; tail -3 $R/test_tma.txt
timeout 230 python3 scripts/gpu_session.py --preset quick --out $R/quick > $R/quick.log 2>&1; echo "quick rc=$?"; tail -5 $R/quick.log
timeout 110 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,ssa_triton_poly,sdpa_cudnn --out $R/bench_wide.md > $R/bench_wide.log 2>&1; echo "bench wide rc=$?"; grep -E "^\|" $R/bench_wide.md | cut -d'|' -f2,8,9,10,16,17 | head -20
timeout 80 python3 -m benchmarks.bench_attention --quick --out $R/bench_quick.md > $R/bench_quick.log 2>&1; echo "bench quick rc=$?"; grep -E "^\|" $R/bench_quick.md | cut -d'|' -f2,8,9,10,16,17 | head -16
tar czf $OUT/call3.tgz -C $R .
