# Issue 28, call 2: call 1's probe again with the repository on PYTHONPATH (call 1 ran it from
# its own folder, where nemo_ssa did not import; its tests had passed).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r2; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_ssa.py > $R/probe_ssa.txt 2>&1; echo "probe rc=$?"; tail -12 $R/probe_ssa.txt
