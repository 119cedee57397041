# Issue 28 (NSA), call 12: GQA 3 through the query-major selected schedules (probe_gqa3.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r12; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
PYTHONPATH=$PWD:$PYTHONPATH timeout 400 python3 docs/results/2026-11-26-nsa-qmajor-dq/commands/probe_gqa3.py > $R/probe.txt 2>&1; echo "rc=$?"
grep -E "^\|" $R/probe.txt; grep -E "Error|error" $R/probe.txt | head -5
