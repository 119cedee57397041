# Issue 28, call 8: the Gluon forward's GPU tests with the fp16 cases; the TMA-path file and
# the flash GPU file on the final code (D128 table calls now run the Gluon forward).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r8; mkdir -p $R
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/attention/test_flash_gluon.py -rA > $R/test_gluon.txt 2>&1; echo "gluon tests rc=$?"; tail -1 $R/test_gluon.txt; grep FAILED $R/test_gluon.txt | head
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/attention/test_flash_tma.py > $R/test_tma.txt 2>&1; echo "tma tests rc=$?"; tail -1 $R/test_tma.txt
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/ops/attention/test_flash_gpu.py tests/ops/test_tiny_shapes.py > $R/test_flash_gpu.txt 2>&1; echo "flash gpu rc=$?"; tail -1 $R/test_flash_gpu.txt; grep FAILED $R/test_flash_gpu.txt | head
