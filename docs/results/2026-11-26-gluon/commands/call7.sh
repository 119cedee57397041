# Issue 28, call 7: a Gluon dK/dV kernel (variants/gluon_dkv_probe.py) inside the two-kernel
# backward, against fp64 gradients, then timed against the Triton backward and cuDNN's.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r7; mkdir -p $R
timeout 300 python3 docs/results/2026-11-26-gluon/commands/probe_gluon_dkv.py > $R/gluon_dkv.log 2>&1; echo "dkv rc=$?"; grep -E "^\||ALL|SOME|Error" $R/gluon_dkv.log | tail -50
