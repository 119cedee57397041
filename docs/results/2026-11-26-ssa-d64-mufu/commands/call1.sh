# Issue 28 (SSA D64), call 1: MUFU work moved to the FMA pipes (ex2 in the forward, rcp in the
# backward), 128-key forward blocks, dq scaled in the cast; then the Gluon GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r1; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 330 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_mix.py > $R/probe_mix.txt 2>&1; echo "probe rc=$?"
PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 -m pytest -q -x tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_gluon.py -p no:cacheprovider > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -3 $R/tests.txt
tail -32 $R/probe_mix.txt
