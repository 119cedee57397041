set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P="train=gpu_9min train.max_steps=300 compare_to=[]"
python3 scripts/gpu_session.py --out $OUT/c2 --budget 585 \
 "auto:80:python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash --out {out}/bench_auto.md > {out}/bench_auto.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench_auto.txt" \
 "det:60:NEMO_SSA_BWD=deterministic python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_det.md > {out}/bench_det.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench_det.txt" \
 "auto2:45:python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_auto2.md > {out}/bench_auto2.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench_auto2.txt" \
 "nemo-ssa:150:python3 scripts/pretrain.py attention=ssa $P run_dir=runs/ssa > {out}/nemo-ssa.txt 2>&1; cp runs/ssa/summary.json {out}/ssa_summary.json; grep -E 'metrics\]|Error' {out}/nemo-ssa.txt | tail -2" \
 "nemo-softmax:150:python3 scripts/pretrain.py attention=softmax $P run_dir=runs/sm > {out}/nemo-softmax.txt 2>&1; cp runs/sm/summary.json {out}/softmax_summary.json; grep -E 'metrics\]|Error' {out}/nemo-softmax.txt | tail -2"
