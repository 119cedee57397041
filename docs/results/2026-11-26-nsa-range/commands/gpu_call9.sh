set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r9; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "tma_matches_pointers or dkv_split or fp32_at_4k" -rA > $R/gpu_range.txt 2>&1; echo "range rc=$?"; grep -E "PASSED|FAILED|SKIPPED|passed|failed|Error" $R/gpu_range.txt | tail -15
tar czf $OUT/call9.tgz -C $R .
