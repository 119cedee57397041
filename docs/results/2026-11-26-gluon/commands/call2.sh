# Issue 28, call 2: the Gluon single-pass backward probe (variants/gluon_bwd_probe.py) against
# fp64 gradients, then timed against the Triton backward and cuDNN's; the Gluon forward probe with
# one-warpgroup tilings.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r2; mkdir -p $R
BWD_CFGS=8:2,4:2 timeout 240 python3 docs/results/2026-11-26-gluon/commands/probe_gluon_bwd.py > $R/gluon_bwd.log 2>&1; echo "bwd rc=$?"; grep -E "^\||ALL|SOME|fail|Error" $R/gluon_bwd.log | tail -45
timeout 200 python3 docs/results/2026-11-26-gluon/commands/probe_gluon.py > $R/gluon_fwd.log 2>&1; echo "fwd rc=$?"; grep -E "ALL|SOME|fail" $R/gluon_fwd.log; grep -E "^\| B" $R/gluon_fwd.log | tail -48
