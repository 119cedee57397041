# Issue 28 (NSA), call 2: the dq query-major backward with per-head-dim tiles -- correctness of
# every variant against fp32 (C), tile sweeps at 64K (A), layer rows off/on alternated (B).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r2; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
P=docs/results/2026-11-26-nsa-qmajor-dq/commands/probe_dq2.py
PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 $P C > $R/probeC.txt 2>&1; echo "C rc=$?"
grep -E "^\|" $R/probeC.txt; grep -E "Error|error" $R/probeC.txt | head -5
PYTHONPATH=$PWD:$PYTHONPATH timeout 170 python3 $P A > $R/probeA.txt 2>&1; echo "A rc=$?"
grep -E "^\|" $R/probeA.txt; grep -E "Error|error" $R/probeA.txt | head -5
PYTHONPATH=$PWD:$PYTHONPATH timeout 270 python3 $P B > $R/probeB.txt 2>&1; echo "B rc=$?"
grep -E "^\|" $R/probeB.txt; grep -E "Error|error" $R/probeB.txt | head -5
