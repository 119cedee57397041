# Issue 28, call 3: the Gluon forward's GPU tests; the four D64/D128 shapes with the Gluon
# forward on and off. The first two bench runs had the dQ kernel's programs in reverse
# order (variants/bwd_kernels_dq_reversed.py, then in the working tree); the third run is
# the committed dQ kernel with the Gluon forward on: the reversal measured no effect.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r3; mkdir -p $R
C=docs/results/2026-11-26-gluon/commands
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/ops/attention/test_flash_gluon.py -rA > $R/test_gluon.txt 2>&1; echo "gluon tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/test_gluon.txt | tail -16
cp $C/variants/bwd_kernels_dq_reversed.py nemo_ssa/ops/common/bwd_kernels.py
for g in 1 0; do
  NEMO_SSA_GLUON=$g timeout 110 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_cudnn --out $R/bench_wide_gluon$g.md > $R/bench_wide_gluon$g.log 2>&1; echo "gluon=$g rc=$?"
  grep -E "^\|" $R/bench_wide_gluon$g.md | cut -d'|' -f2,8,9,10,16,17 | head -14
done
git checkout nemo_ssa/ops/common/bwd_kernels.py
NEMO_SSA_GLUON=1 timeout 110 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_cudnn --out $R/bench_wide_olddq.md > $R/bench_wide_olddq.log 2>&1; echo "committed dq rc=$?"
grep -E "^\|" $R/bench_wide_olddq.md | cut -d'|' -f2,8,9,10,16,17 | head -14
