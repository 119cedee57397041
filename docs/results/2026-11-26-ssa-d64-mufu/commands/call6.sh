# Issue 28 (SSA D64), call 6: the table with fold_rcp and ds_smem for SSA D64 -- the Gluon
# backward's GPU tests (with the variants outside the table) and the single-pass file;
# bench_attention --wide (package defaults), twice (cuDNN moves between runs).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r6; mkdir -p $R
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_single_pass.py -rA > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -1 $R/tests.txt; grep -E "^FAILED|Error" $R/tests.txt | head -20
for i in 1 2; do
timeout 120 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_flash,sdpa_cudnn --out $R/bench_wide$i.md > $R/bench_wide$i.log 2>&1; echo "bench $i rc=$?"
grep -E "^\|" $R/bench_wide$i.md | cut -d'|' -f2,3,8,9,10,16,17 | head -20
done
