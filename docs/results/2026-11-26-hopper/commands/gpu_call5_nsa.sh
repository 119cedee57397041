# Issue 28 item 1: the query-major selected-attention forward (GQA >= 16) and the importance tiles
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r5; mkdir -p $R
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa.py -k "selected_kernel or worklist" > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -2 $R/tests.txt
timeout 200 python3 docs/results/2026-11-26-hopper/commands/probe_nsa.py > $R/probe_nsa.txt 2>&1; echo "probe rc=$?"; grep -E "^\|" $R/probe_nsa.txt
timeout 200 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 100 --warmup-ms 25 --only sdpa_flash,nsa_layer,selected,fla_nsa --out $R/d64_gqa16.md > $R/bench.log 2>&1; echo "bench rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa16.md
tar czf $OUT/call5.tgz -C $R .
