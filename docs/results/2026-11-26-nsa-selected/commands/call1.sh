set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r1; mkdir -p $R
timeout 320 python3 docs/results/2026-11-26-nsa-selected/commands/probe_q.py A > $R/probeA.log 2>&1; echo "A rc=$?"
timeout 220 python3 docs/results/2026-11-26-nsa-selected/commands/probe_q.py B > $R/probeB.log 2>&1; echo "B rc=$?"
grep -E "^\||^###|Error" $R/probeA.log $R/probeB.log | tail -100
tar czf $OUT/call1.tgz -C $R .
