# Issue 28 (SSA D64), call 5: the cost of the pipelined backward's barrier per block (probe_sync.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r5; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_sync.py > $R/probe_sync.txt 2>&1; echo "probe rc=$?"
tail -11 $R/probe_sync.txt
