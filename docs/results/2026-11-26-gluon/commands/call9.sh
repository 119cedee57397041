# Issue 28, call 9: a warp-specialised Gluon single-pass backward (producer warp, dq-writer warp,
# two consumer warpgroups at 240 registers; variants/gluon_bwd_ws_probe.py), softmax
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r9; mkdir -p $R
BWD_CFGS=8:2 timeout 240 python3 docs/results/2026-11-26-gluon/commands/probe_gluon_bwd_ws.py > $R/gluon_bwd_ws.log 2>&1; echo "ws rc=$?"; grep -E "^\||ALL|SOME|fail|Error" $R/gluon_bwd_ws.log | tail -40
