set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r2; mkdir -p $R
PARTS=A,B timeout 330 python3 scratch/probe_range2.py > $R/probeAB.log 2>&1; echo "AB rc=$?"
PARTS=C,D timeout 200 python3 scratch/probe_range2.py > $R/probeCD.log 2>&1; echo "CD rc=$?"
grep -E "^\||^###|failed|Error" $R/probeAB.log $R/probeCD.log | cut -c1-220
tar czf $OUT/call2.tgz -C $R .
