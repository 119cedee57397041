# Issue 28: the GPU suite's full-1 preset on the final code (flash incl. the TMA defaults, flex,
# ELSA -- whose backward shares the TMA tables --, extreme logits, tiny lengths, RoPE, CE, MLP)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=/tmp/r13; mkdir -p $R
timeout 560 python3 scripts/gpu_session.py --preset full-1 --out $R/full1 --commit $(git rev-parse --short HEAD 2>/dev/null || echo b709fa7) > $R/full1.log 2>&1; echo "full-1 rc=$?"; tail -8 $R/full1.log
grep -E "passed|failed" $R/full1/*.md | head -5
tar czf $OUT/call13.tgz -C $R .
