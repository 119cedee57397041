set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 scripts/gpu_session.py --out $OUT/c4 --budget 480 \
 "quick:200:python3 scripts/gpu_session.py --preset quick --commit e01dab9 --out {out}/quick > {out}/quick.txt 2>&1; tail -6 {out}/quick.txt" \
 "gp0:140:python3 benchmarks/model_grad_parity.py --steps 0 --out {out}/grad_parity.md > {out}/gp0.txt 2>&1; tail -24 {out}/gp0.txt"
