# Issue 28, call 1: SSA through the warp-specialised Gluon single pass (D128 in the table, the
# Gluon forward writes C): the GPU tests of both Gluon files; the probe (fwd+bwd, SSA Gluon
# off / on / D64 patched, softmax and SDPA cuDNN in the same process).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r1; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_gluon.py -rA -x > $R/test_gluon.txt 2>&1; echo "gluon tests rc=$?"; tail -1 $R/test_gluon.txt; grep -E "FAILED|Error|assert" $R/test_gluon.txt | head -20
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_ssa.py > $R/probe_ssa.txt 2>&1; echo "probe rc=$?"; tail -12 $R/probe_ssa.txt
