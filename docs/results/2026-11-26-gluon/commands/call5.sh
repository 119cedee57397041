# Issue 28, call 5: the NSA layer at the recipe's GQA 3 (D64, D128) with the banded selection
# order; the attention benchmark's default shapes (D32 recipe shape: no slower).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r5; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt
timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 24 --hkv 8 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,selection --out $R/d64_gqa3.md > $R/g3_64.log 2>&1; echo "g3d64 rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa3.md
timeout 120 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 24 --hkv 8 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/d128_gqa3.md > $R/g3_128.log 2>&1; echo "g3d128 rc=$?"; grep -E "^\| [0-9]" $R/d128_gqa3.md
timeout 75 python3 -m benchmarks.bench_attention --quick --out $R/bench_quick.md > $R/bench_quick.log 2>&1; echo "bench quick rc=$?"; grep -E "^\|" $R/bench_quick.md | cut -d'|' -f2,8,9,10,16,17 | head -16
timeout 140 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/d128_gqa16.md > $R/b128.log 2>&1; echo "b128 rc=$?"; grep -E "^\| [0-9]" $R/d128_gqa16.md
BANDED=0 timeout 85 python3 docs/results/2026-11-26-gluon/commands/bench_banded.py --ns 65536 --dims 64 --hq 24 --hkv 8 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/d64_gqa3_tile_order.md > $R/g3_64_tile.log 2>&1; echo "g3d64 tile order rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa3_tile_order.md
