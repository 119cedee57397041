set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 scripts/gpu_session.py --out $OUT/c5 --budget 300 \
 "gp0:150:python3 benchmarks/model_grad_parity.py --steps 0 --no-learnable-b --out {out}/grad_parity_pinned.md > {out}/gp0.txt 2>&1; grep -E 'L[0-9]+.n |VERDICT|worst|ratio' {out}/gp0.txt | head -20" \
 "gp0det:120:NEMO_SSA_BWD=deterministic python3 benchmarks/model_grad_parity.py --steps 0 --no-learnable-b --out {out}/grad_parity_pinned_det.md > {out}/gp0det.txt 2>&1; grep -E 'VERDICT' {out}/gp0det.txt"
