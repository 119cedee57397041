# Issue 28, call 6: the backward table with SSA D128, softmax D64 and SSA D64 (pipelined):
# GPU tests of both Gluon files; bench_attention --wide with the Gluon kernels off / on; the
# forward alone (probe_fwd.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r6; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_gluon.py -rA > $R/test_gluon.txt 2>&1; echo "gluon tests rc=$?"; tail -1 $R/test_gluon.txt; grep -E "^FAILED|Error" $R/test_gluon.txt | head -20
for g in 1 0; do
  NEMO_SSA_GLUON=$g timeout 110 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_cudnn --out $R/bench_wide_gluon$g.md > $R/bench_wide_gluon$g.log 2>&1; echo "gluon=$g rc=$?"
  grep -E "^\|" $R/bench_wide_gluon$g.md | cut -d'|' -f2,8,9,10,16,17 | head -14
done
PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_fwd.py > $R/probe_fwd.txt 2>&1; echo "fwd probe rc=$?"; tail -6 $R/probe_fwd.txt
