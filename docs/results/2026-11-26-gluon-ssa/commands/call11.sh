# Issue 28, call 11: NSA on the H100 -- the layer's parts and a tile sweep at the paper's
# shape (probe_nsa_tiles.py: D64, Hq64/Hkv4, N=64K, mean compression, softmax).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r11; mkdir -p $R
PYTHONPATH=$PWD:$PYTHONPATH timeout 420 python3 docs/results/2026-11-26-gluon-ssa/commands/probe_nsa_tiles.py > $R/probe_nsa_tiles.txt 2>&1; echo "probe rc=$?"; tail -30 $R/probe_nsa_tiles.txt
