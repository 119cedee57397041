# Issue 28 (SSA D64), call 4: the pipelined backward's operands from shared memory (probe_smem.py),
# then the Gluon backward's GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r4; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_smem.py > $R/probe_smem.txt 2>&1; echo "probe rc=$?"
tail -20 $R/probe_smem.txt
