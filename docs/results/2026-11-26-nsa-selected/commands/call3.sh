set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r3; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt; git diff --stat >> $R/commit.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "selected_qmajor or tma_matches or fp32_at_4k or dkv_split or int64" -rA > $R/gpu_tests.txt 2>&1; echo "tests rc=$?"; grep -E "FAILED|SKIPPED|passed|failed|Error" $R/gpu_tests.txt | tail -8
timeout 200 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,fla_nsa,selected,window,compressed --out $R/d64_gqa16.md > $R/b64.log 2>&1; echo "b64 rc=$?"
grep -E "^\| [0-9]" $R/d64_gqa16.md
timeout 220 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 128 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,fla_nsa --out $R/d128_gqa16.md > $R/b128.log 2>&1; echo "b128 rc=$?"
grep -E "^\| [0-9]" $R/d128_gqa16.md
tar czf $OUT/call3.tgz -C $R .
