# Issue 28 (NSA), call 9: the compressed branch's backward through the Gluon single pass with
# the query range split over programs -- its GPU test and the range tests that pin their own
# backward; then probe_nsa_split.py (layer and compressed rows, split sizes, range bwd first/last).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r9; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "gluon or dkv_split or tma_matches" -rA > $R/test_nsa_gluon.txt 2>&1; echo "tests rc=$?"; tail -1 $R/test_nsa_gluon.txt; grep -E "^FAILED|Error" $R/test_nsa_gluon.txt | head -20
PYTHONPATH=$PWD:$PYTHONPATH timeout 330 python3 docs/results/2026-11-26-ssa-d64-mufu/commands/probe_nsa_split.py > $R/probe_nsa_split.txt 2>&1; echo "probe rc=$?"
tail -44 $R/probe_nsa_split.txt
