# Issue 28: query-major warps (1 vs 2), NSA D64 GQA16 layer with the defaults, D128 GQA16 (the
# call-4 run timed out), and the flash GPU gates on the final code (quick preset)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r6; mkdir -p $R
PROBE_SELECTED_ONLY=1 PROBE_NS=65536 timeout 60 python3 docs/results/2026-11-26-hopper/commands/probe_nsa.py > $R/probe_warps.txt 2>&1; echo "probe rc=$?"; grep -E "^\|" $R/probe_warps.txt
T="--rep-ms 100 --warmup-ms 25"
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,fla_nsa --out $R/d64_gqa16.md > $R/a.log 2>&1; echo "a rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa16.md
timeout 220 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,fla_nsa --out $R/d128_gqa16.md > $R/b.log 2>&1; echo "b rc=$?"; grep -E "^\| [0-9]" $R/d128_gqa16.md
tar czf $OUT/call6.tgz -C $R .
