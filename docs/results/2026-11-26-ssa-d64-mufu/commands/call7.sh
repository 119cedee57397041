# Issue 28 (SSA D64), call 7: the Gluon SSA forward with 128-key blocks under the new backward,
# interleaved three rounds (probe_fwd128.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r7; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_fwd128.py > $R/probe_fwd128.txt 2>&1; echo "probe rc=$?"
tail -9 $R/probe_fwd128.txt
