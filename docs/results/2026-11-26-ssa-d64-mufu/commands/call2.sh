# Issue 28 (SSA D64), call 2: where the Gluon backward's time goes (probe_where.py: patched
# copies without the dq reduce, the reciprocal, the log2 or the dn sum); then the Gluon GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r2; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_where.py > $R/probe_where.txt 2>&1; echo "probe rc=$?"
PYTHONPATH=$PWD:$PYTHONPATH timeout 240 python3 -m pytest -q tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_gluon.py -p no:cacheprovider > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -3 $R/tests.txt
tail -22 $R/probe_where.txt
