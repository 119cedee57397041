set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r8; mkdir -p $R
timeout 230 python3 -m pytest -q -p no:cacheprovider -m "gpu and not gpu_big" tests/ops/nsa/test_nsa_gpu.py -x > $R/gpu_small.txt 2>&1; echo "small rc=$?"; tail -4 $R/gpu_small.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_tiny_shapes.py -k nsa > $R/tiny.txt 2>&1; echo "tiny rc=$?"; tail -3 $R/tiny.txt
timeout 220 python3 -m pytest -q -p no:cacheprovider -m "gpu_big" tests/ops/nsa/test_nsa_gpu.py > $R/gpu_big.txt 2>&1; echo "big rc=$?"; tail -4 $R/gpu_big.txt
tar czf $OUT/call8.tgz -C $R .
