# Issue 28 (NSA), call 1: the selected backward's dq query-major -- GPU tests of the selected
# kernels, then probe_dq.py A (kernel level, 64K) and B (layer rows, off/on alternated).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r1; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa.py -k "selected_kernel" -rA > $R/test_selected.txt 2>&1; echo "tests rc=$?"; tail -1 $R/test_selected.txt; grep -E "^FAILED" $R/test_selected.txt | head
PYTHONPATH=$PWD:$PYTHONPATH timeout 230 python3 docs/results/2026-11-26-nsa-qmajor-dq/commands/probe_dq.py A > $R/probeA.txt 2>&1; echo "A rc=$?"
grep -E "^\|" $R/probeA.txt; grep -E "Error|error" $R/probeA.txt | head -5
PYTHONPATH=$PWD:$PYTHONPATH timeout 240 python3 docs/results/2026-11-26-nsa-qmajor-dq/commands/probe_dq.py B > $R/probeB.txt 2>&1; echo "B rc=$?"
grep -E "^\|" $R/probeB.txt; grep -E "Error|error" $R/probeB.txt | head -5
