# Issue 28, call 4: the GPU quick preset on the final kernels (Gluon forward, banded selection
# on), then the NSA layer at GQA 16 (D64, D128) with the banded selection order, fla beside.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r4; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt
timeout 230 python3 scripts/gpu_session.py --preset quick --out $R/quick > $R/quick.log 2>&1; echo "quick rc=$?"; tail -4 $R/quick.log
timeout 170 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,fla_nsa,selection --out $R/d64_gqa16.md > $R/b64.log 2>&1; echo "b64 rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa16.md
timeout 170 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,fla_nsa --out $R/d128_gqa16.md > $R/b128.log 2>&1; echo "b128 rc=$?"; grep -E "^\| [0-9]" $R/d128_gqa16.md
