set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r7; mkdir -p $R
timeout 120 python3 scratch/probe7.py > $R/probe7.log 2>&1; echo "p7 rc=$?"
grep "^|" $R/probe7.log
timeout 330 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,fla_nsa --out $R/d128_gqa16.md > $R/b.log 2>&1; echo "b rc=$?"
grep -E "^\| [0-9]" $R/d128_gqa16.md
tar czf $OUT/call7.tgz -C $R .
