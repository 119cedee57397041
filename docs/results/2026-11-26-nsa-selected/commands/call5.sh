set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r5; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "T1000" -rA > $R/gpu_t1000.txt 2>&1; echo "t1000 rc=$?"; grep -E "PASSED|FAILED|passed|failed" $R/gpu_t1000.txt | tail -6
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa.py -k "selected or row_delta or layer" -x > $R/nsa_cuda.txt 2>&1; echo "nsa rc=$?"; tail -2 $R/nsa_cuda.txt
tar czf $OUT/call5.tgz -C $R .
