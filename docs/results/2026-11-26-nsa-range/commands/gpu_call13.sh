set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r13; mkdir -p $R
rm -rf /tmp/oldrepo && mkdir -p /tmp/oldrepo && cp -r nemo_ssa benchmarks /tmp/oldrepo/ && cp scratch/ra_head.py /tmp/oldrepo/nemo_ssa/ops/nsa/range_attn.py
T="--ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --transform ssa --rep-ms 60 --warmup-ms 20"
timeout 200 python3 /tmp/oldrepo/benchmarks/bench_nsa.py $T --only nsa_layer,compressed,window --out $R/ssa_before.md > $R/before.log 2>&1; echo "before rc=$?"
timeout 200 python3 benchmarks/bench_nsa.py $T --only sdpa_flash,nsa_layer,compressed,window --out $R/ssa_after.md > $R/after.log 2>&1; echo "after rc=$?"
for f in $R/ssa_before.md $R/ssa_after.md; do echo "== $f"; grep -E "^\| [0-9]" $f; done
tar czf $OUT/call13.tgz -C $R .
