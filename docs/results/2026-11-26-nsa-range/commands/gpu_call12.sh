set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r12; mkdir -p $R
timeout 300 python3 scratch/probe_ssa.py > $R/ssa.log 2>&1; echo "ssa rc=$?"
grep "^|" $R/ssa.log; grep -i "error" $R/ssa.log | head -3
tar czf $OUT/call12.tgz -C $R .
