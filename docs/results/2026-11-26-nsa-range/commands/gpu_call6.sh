set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r6; mkdir -p $R
T="--rep-ms 60 --warmup-ms 20"
timeout 60 python3 scratch/probe_sel.py > $R/sel.log 2>&1; echo "sel rc=$?"
timeout 190 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,compressed,selection,selected,window,fla_nsa --out $R/d64_gqa16.md > $R/a.log 2>&1; echo "a rc=$?"
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,fla_nsa --out $R/d128_gqa16.md > $R/b.log 2>&1; echo "b rc=$?"
timeout 120 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 24 --hkv 8 --compress mean $T --only sdpa_flash,nsa_layer --out $R/gqa3.md > $R/c.log 2>&1; echo "c rc=$?"
cat $R/sel.log | grep "^|"
for f in $R/*.md; do echo "== $f"; grep -E "^\| [0-9]|^- " $f; done
tar czf $OUT/call6.tgz -C $R .
