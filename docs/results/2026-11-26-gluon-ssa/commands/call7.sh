# Issue 28, call 7: main b6fec95 -- the Gluon files' GPU tests (with the D64 SSA forward row
# that writes C); bench_attention --wide (package defaults); SSA D64 ring depths (probe_d64_stages.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r7; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/attention/test_flash_gluon.py -rA > $R/test_flash_gluon.txt 2>&1; echo "fwd tests rc=$?"; tail -1 $R/test_flash_gluon.txt; grep -E "^FAILED|Error" $R/test_flash_gluon.txt | head -20
timeout 120 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_flash,sdpa_cudnn --out $R/bench_wide.md > $R/bench_wide.log 2>&1; echo "bench rc=$?"
grep -E "^\|" $R/bench_wide.md | cut -d'|' -f2,3,8,9,10,16,17 | head -20
PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_d64_stages.py > $R/probe_d64_stages.txt 2>&1; echo "probe rc=$?"; tail -6 $R/probe_d64_stages.txt
