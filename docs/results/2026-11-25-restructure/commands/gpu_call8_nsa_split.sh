set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r8; mkdir -p $R
A="--ns 65536 --dims 64 --hq 64 --hkv 4 --compress mean"
timeout 150 python3 benchmarks/bench_nsa.py $A --only sdpa_flash,nsa_layer,compressed --out $R/nsa_auto.md > $R/auto.log 2>&1; echo "auto rc=$?"
for s in 1 16; do timeout 60 python3 benchmarks/bench_nsa.py $A --only compressed --dkv-split $s --out $R/nsa_split$s.md > $R/split$s.log 2>&1; echo "split $s rc=$?"; done
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k split > $R/split_test.log 2>&1; echo "split test rc=$?"; tail -2 $R/split_test.log
tar czf $OUT/call8.tgz -C $R .
for f in $R/nsa_auto.md $R/nsa_split1.md $R/nsa_split16.md; do echo "== $f"; grep -E "^\| 64" $f; done
