# Issue 28, call 5: the software-pipelined consumers of the warp-specialised backward
# (probe_pp.py: Triton / unpipelined / pipelined with 2 and 3 stages; D128, D64; softmax, SSA).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r5; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 500 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_pp.py > $R/probe_pp.txt 2>&1; echo "probe rc=$?"; tail -22 $R/probe_pp.txt
