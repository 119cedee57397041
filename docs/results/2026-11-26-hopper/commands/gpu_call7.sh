# Issue 28: the final code (query-major 1 warp): NSA D64 GQA16 and GQA 3 layer rows, and the
# four D64/D128 dense shapes once more
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r7; mkdir -p $R
T="--rep-ms 100 --warmup-ms 25"
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,selected,fla_nsa --out $R/d64_gqa16.md > $R/a.log 2>&1; echo "a rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa16.md
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa.py -k "selected_kernel" > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -1 $R/tests.txt
timeout 110 python3 -m benchmarks.bench_attention --wide --out $R/bench_wide.md > $R/bench_wide.log 2>&1; echo "bench wide rc=$?"; grep -E "^\|" $R/bench_wide.md | cut -d'|' -f2,8,9,10,14,15,16,17 | head -20
tar czf $OUT/call7.tgz -C $R .
