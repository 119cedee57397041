# Issue 28, call 4: the warp-specialised backward with the rows' statistics staged by the
# producer (cp.async into shared memory): its GPU tests (softmax and SSA), then probe_ws.py
# (Triton backward / new kernel / a61aa45's kernel, D128 and D64, softmax and SSA).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r4; mkdir -p $R
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/common/test_hopper_bwd.py -rA -x > $R/test_hopper_bwd.txt 2>&1; echo "tests rc=$?"; tail -1 $R/test_hopper_bwd.txt; grep -E "FAILED|Error|assert" $R/test_hopper_bwd.txt | head -20
PYTHONPATH=$PWD:$PYTHONPATH timeout 400 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_ws.py > $R/probe_ws.txt 2>&1; echo "probe rc=$?"; tail -12 $R/probe_ws.txt
