# call 6 ran with nemo_ssa/ops/nsa/select.py = variants/select_call6.py (not committed as such)
# and scratch/select_old.py = the select.py before it (git show 577d8b9:nemo_ssa/ops/nsa/select.py)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r6; mkdir -p $R
git diff --stat > $R/commit.txt
timeout 170 python3 docs/results/2026-11-26-nsa-selected/commands/probe_sel.py > $R/probe_sel.log 2>&1; echo "probe rc=$?"
grep -E "^\|" $R/probe_sel.log
tar czf $OUT/call6.tgz -C $R .
