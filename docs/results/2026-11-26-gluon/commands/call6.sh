# Issue 28, call 6: the backward tiles at D128 on both target shapes (B2 N8192 and B8 N4096;
# the tables were tuned on B2 N8192 only), softmax and SSA, Hopper path; SSA's single pass at D64
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r6; mkdir -p $R
for tr in softmax ssa; do
  timeout 170 python3 -m benchmarks.tune_tiles --tma --transform $tr --kernels bwd_dq,bwd_dkv --shapes d128,d128-b8 --out $R/tune_bwd_$tr.md > $R/tune_bwd_$tr.log 2>&1; echo "tune $tr rc=$?"; grep -E "best|precompiled" $R/tune_bwd_$tr.log
done
timeout 150 python3 -m benchmarks.tune_tiles --tma --transform ssa --kernels bwd_single --shapes d64-n8k,d64-b8 --out $R/tune_single_ssa.md > $R/tune_single_ssa.log 2>&1; echo "tune single rc=$?"; grep -E "best|precompiled" $R/tune_single_ssa.log
