# Issue 28 item 1, measurements: NSA per-branch breakdown (D64 GQA16), D128 GQA16 and the recipe's
# GQA 3 (Hq24/Hkv8) beside SDPA flash (and fla where it runs), and phi (mlp) vs mean compression
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r4; mkdir -p $R
T="--rep-ms 100 --warmup-ms 25"
timeout 170 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,compressed,selection,selected,window,fla_nsa --out $R/d64_gqa16_branches.md > $R/a.log 2>&1; echo "a rc=$?"
timeout 130 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,fla_nsa --out $R/d128_gqa16.md > $R/b.log 2>&1; echo "b rc=$?"
timeout 110 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64,128 --hq 24 --hkv 8 --compress mean $T --only sdpa_flash,nsa_layer,fla_nsa --out $R/gqa3.md > $R/c.log 2>&1; echo "c rc=$?"
timeout 80 python3 benchmarks/bench_nsa.py --ns 65536 --dims 64 --hq 64 --hkv 4 --compress mlp $T --only nsa_layer,compressed --out $R/d64_phi.md > $R/d.log 2>&1; echo "d rc=$?"
for f in $R/*.md; do echo "== $f"; grep -E "^\| [0-9]" $f; done
tar czf $OUT/call4.tgz -C $R .
