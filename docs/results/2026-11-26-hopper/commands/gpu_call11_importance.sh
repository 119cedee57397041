# Issue 28 item 1: the importance kernel's loop order (heads summed per compressed chunk, one
# overlap dot per chunk) and its tiles, the hi-lo split (two tf32 dots) for the overlap product, rows against an fp64 reference selection
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r11; mkdir -p $R
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa.py -k "selection_kernels_match" > $R/tests.txt 2>&1; echo "tests rc=$?"; tail -1 $R/tests.txt
PROBE_HEADS_INNER=1 PROBE_W_PREC=split,tf32 timeout 300 python3 docs/results/2026-11-26-hopper/commands/probe_nsa.py > $R/probe_importance.txt 2>&1; echo "probe rc=$?"; grep -E "^\|" $R/probe_importance.txt
tar czf $OUT/call11.tgz -C $R .
