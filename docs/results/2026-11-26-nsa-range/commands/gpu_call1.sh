set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r1; mkdir -p $R
timeout 330 python3 scratch/probe_range.py > $R/probe.log 2>&1; echo "probe rc=$?"
timeout 200 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 100 --warmup-ms 25 --only sdpa_flash,nsa_layer,compressed,window,fla_nsa --out $R/d64_gqa16.md > $R/bench.log 2>&1; echo "bench rc=$?"
grep -E "^\|" $R/probe.log; grep -E "^\| [0-9]" $R/d64_gqa16.md
tar czf $OUT/call1.tgz -C $R .
