set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c2 --budget 580 \
 "gp:230:python3 benchmarks/model_grad_parity.py --steps 150 --triton-fp32 --out {out}/grad_parity.md > {out}/gp.txt 2>&1; tail -30 {out}/gp.txt" \
 "gp0:130:python3 benchmarks/model_grad_parity.py --steps 0 --eager same-dtype --out {out}/grad_parity_same_dtype.md > {out}/gp0.txt 2>&1; tail -22 {out}/gp0.txt" \
 "tune-ssa:70:python3 benchmarks/tune_tiles.py --kernels flash_fwd,bwd_dq,bwd_dkv --shapes model,b32 --out {out}/tune_ssa.md > {out}/tune_ssa.txt 2>&1; grep -E 'best' {out}/tune_ssa.txt" \
 "tune-softmax:60:python3 benchmarks/tune_tiles.py --transform softmax --kernels flash_fwd,bwd_dq,bwd_dkv --shapes model,b32 --out {out}/tune_softmax.md > {out}/tune_softmax.txt 2>&1; grep -E 'best' {out}/tune_softmax.txt" \
 "tune-d64-128:90:python3 benchmarks/tune_tiles.py --kernels flash_fwd,bwd_dq,bwd_dkv --shapes d64,d128 --out {out}/tune_d.md > {out}/tune_d.txt 2>&1; grep -E 'best' {out}/tune_d.txt"
