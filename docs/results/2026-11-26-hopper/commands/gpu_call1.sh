# Issue 28 item 2, first device call: WS probe, TMA-path GPU tests, TMA tile sweep (softmax, SSA)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r1; mkdir -p $R
timeout 80 python3 docs/results/2026-11-26-hopper/commands/probe_ws.py > $R/probe_ws.txt 2>&1; echo "probe rc=$?"; tail -25 $R/probe_ws.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/attention/test_flash_tma.py > $R/test_tma.txt 2>&1; echo "tma tests rc=$?"; tail -3 $R/test_tma.txt
for tr in softmax ssa; do
  timeout 170 python3 -m benchmarks.tune_tiles --tma --transform $tr --kernels flash_fwd,bwd_dq,bwd_dkv --shapes d64-n8k,d128 --out $R/tune_tma_$tr.md > $R/tune_tma_$tr.log 2>&1; echo "tune $tr rc=$?"; grep -E "best|precompiled" $R/tune_tma_$tr.log
done
tar czf $OUT/call1.tgz -C $R .
