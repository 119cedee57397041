# Issue 28, call 1: the Gluon forward probe (variants/gluon_fwd_probe.py; first tilings, 128 rows on
# two warpgroups) -- correctness and timing; the banded selection order against fp64; the NSA
# layer at D128 GQA16 64K with the banded order.
# (probe_gluon.py here is the version call 2 ran; call 1 ran its first version, which timed only
# 128-row, two-warpgroup tiles: block_n 64/128, stages 2-4.)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r1; mkdir -p $R
git log --oneline | head -1 > $R/commit.txt
timeout 170 python3 docs/results/2026-11-26-gluon/commands/probe_gluon.py > $R/gluon.log 2>&1; echo "gluon rc=$?"; grep -E "^\||ALL|SOME|fail" $R/gluon.log | tail -60
timeout 200 python3 docs/results/2026-11-26-gluon/commands/probe_banded.py > $R/banded.log 2>&1; echo "banded rc=$?"; grep -E "^\|" $R/banded.log | tail -7
BANDED=1 timeout 120 python3 docs/results/2026-11-26-gluon/commands/bench_banded.py --ns 65536 --dims 128 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/d128_gqa16_banded.md > $R/b128.log 2>&1; echo "b128 rc=$?"; grep -E "^\|" $R/b128.log | tail -4
