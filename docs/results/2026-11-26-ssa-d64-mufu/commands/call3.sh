# Issue 28 (SSA D64), call 3: fold_rcp, dq_late, the 128-key SSA forward at D64 (probe_fold.py),
# at D64 and D128, softmax and SSA; then the Gluon backward's GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r3; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 330 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_fold.py > $R/probe_fold.txt 2>&1; echo "probe rc=$?"
PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 -m pytest -q tests/ops/attention/test_flash_single_pass.py -p no:cacheprovider > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -2 $R/tests.txt
tail -42 $R/probe_fold.txt
