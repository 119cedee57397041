set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r2; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt; git diff --stat >> $R/commit.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "selected_qmajor or T1000" -rA > $R/gpu_sel.txt 2>&1; echo "tests rc=$?"; grep -E "PASSED|FAILED|SKIPPED|passed|failed|Error" $R/gpu_sel.txt | tail -12
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_tiny_shapes.py -k nsa > $R/tiny.txt 2>&1; echo "tiny rc=$?"; tail -2 $R/tiny.txt
timeout 80 python3 docs/results/2026-11-26-nsa-selected/commands/probe_q.py C > $R/probeC.log 2>&1; echo "C rc=$?"; grep -E "^\|" $R/probeC.log
timeout 220 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer,fla_nsa,selected,window,compressed,selection --out $R/d64_gqa16.md > $R/b64.log 2>&1; echo "b64 rc=$?"
grep -E "^\| [0-9]" $R/d64_gqa16.md
tar czf $OUT/call2.tgz -C $R .
