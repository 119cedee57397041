set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r10; mkdir -p $R
timeout 100 python3 scratch/probe_sel2.py > $R/sel2.log 2>&1; echo "sel2 rc=$?"; grep "^|" $R/sel2.log; grep -i error $R/sel2.log | head -3
timeout 200 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,selection,fla_nsa --out $R/d64_gqa16.md > $R/a.log 2>&1; echo "a rc=$?"
grep -E "^\| [0-9]" $R/d64_gqa16.md
tar czf $OUT/call10.tgz -C $R .
