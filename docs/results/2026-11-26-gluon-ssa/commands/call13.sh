# Issue 28, call 13: is SSA's D64 forward MUFU-bound? (probe_mufu.py: the Gluon forward with
# its lg2 / ex2 on the FMA pipes, or without the lg2)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r13; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_mufu.py > $R/probe_mufu.txt 2>&1; echo "probe rc=$?"; tail -9 $R/probe_mufu.txt
