# Issue 28, call 8: the SSA forward at D64, Gluon variants (probe_fwd64.py); then the GPU
# full-1 preset on main b6fec95 (+ the forward's maxnreg field).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r8; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 110 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_fwd64.py > $R/probe_fwd64.txt 2>&1; echo "probe rc=$?"; tail -16 $R/probe_fwd64.txt
timeout 470 python3 scripts/gpu_session.py --preset full-1 --out $R/full1 > $R/full1.log 2>&1; echo "full-1 rc=$?"; tail -6 $R/full1.log
