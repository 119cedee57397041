# Issue 28: the importance defaults before/after at the recipe's GQA 3 (Hq24/Hkv8) and at GQA 16,
# then the NSA layer on the final code (D64: GQA 16 beside fla, and GQA 3)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r12; mkdir -p $R
PROBE_OLD_NEW=1 PROBE_HQ=24 PROBE_HKV=8 timeout 120 python3 docs/results/2026-11-26-hopper/commands/probe_nsa.py > $R/probe_gqa3.txt 2>&1; echo "probe gqa3 rc=$?"; grep -E "^\|" $R/probe_gqa3.txt
T="--rep-ms 100 --warmup-ms 25"
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean $T --only sdpa_flash,nsa_layer,selection,fla_nsa --out $R/d64_gqa16.md > $R/a.log 2>&1; echo "a rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa16.md
timeout 100 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 24 --hkv 8 --compress mean $T --only sdpa_flash,nsa_layer --out $R/d64_gqa3.md > $R/b.log 2>&1; echo "b rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa3.md
tar czf $OUT/call12.tgz -C $R .
