# Issue 28: the Hopper path on and off in one process pair on one machine (NEMO_SSA_TMA=0: the
# pointer kernels with their own table rows), the four D64/D128 shapes
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r8; mkdir -p $R
for tma in 0 1; do
  NEMO_SSA_TMA=$tma timeout 110 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_cudnn --out $R/bench_wide_tma$tma.md > $R/bench_wide_tma$tma.log 2>&1; echo "tma=$tma rc=$?"
  grep -E "^\|" $R/bench_wide_tma$tma.md | cut -d'|' -f2,8,9,10,16,17 | head -14
done
tar czf $OUT/call8.tgz -C $R .
