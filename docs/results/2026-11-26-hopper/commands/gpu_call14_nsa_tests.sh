# Issue 28: the NSA GPU file and the NSA/ELSA op tests on CUDA (full-2's first step, without the
# N=4088 gpu_big cases and the fuzz) on the final code: query-major forward, new selection defaults
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r14; mkdir -p $R
timeout 280 python3 -m pytest -q -p no:cacheprovider -rfEs -m "not gpu_big" tests/ops/nsa/test_nsa_gpu.py tests/ops/nsa/test_nsa.py tests/ops/elsa/test_elsa.py > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -6 $R/tests.txt
tar czf $OUT/call14.tgz -C $R .
