# Issue 28, call 10: the Gluon backward's GPU tests on the final code (adds SSA with n fixed:
# the kernel variant without C and without dn partials).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r10; mkdir -p $R
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_single_pass.py -rA > $R/test_hopper_bwd.txt 2>&1; echo "tests rc=$?"; tail -1 $R/test_hopper_bwd.txt; grep -E "^FAILED|Error" $R/test_hopper_bwd.txt | head -20
