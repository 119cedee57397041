set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r11; mkdir -p $R
timeout 280 python3 benchmarks/tune_tiles.py --kernels nsa_compressed_bwd,nsa_window_fwd --shapes nsa-d32 --rep 10 --out $R/tune_nsa.md > $R/tune.log 2>&1; echo "tune rc=$?"
tail -25 $R/tune.log
tar czf $OUT/call11.tgz -C $R .
