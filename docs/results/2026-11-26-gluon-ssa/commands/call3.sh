# Issue 28, call 3: the Gluon backward at D64 with one consumer warpgroup (64-key blocks, two
# programs per SM) against the Triton backward, SSA and softmax (probe_d64.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r3; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 400 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_d64.py > $R/probe_d64.txt 2>&1; echo "probe rc=$?"; tail -8 $R/probe_d64.txt
