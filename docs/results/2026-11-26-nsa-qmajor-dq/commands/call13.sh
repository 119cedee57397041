# Issue 28 (NSA), call 13: tiny lengths (N = 1, 2, 3, 15, 17) at GQA 16 -- the query-major
# forward and dq, fwd+bwd against the references (tests/ops/test_tiny_shapes.py, new cases).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r13; mkdir -p $R
git rev-parse HEAD > $R/commit.txt; git diff HEAD > $R/diff.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/ops/test_tiny_shapes.py -k "16x1" -rA > $R/test_tiny.txt 2>&1; echo "rc=$?"; tail -1 $R/test_tiny.txt; grep -E "^FAILED|^PASSED" $R/test_tiny.txt | head -12
