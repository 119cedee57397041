set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P="train=gpu_9min train.max_steps=300 compare_to=[]"
python3 scripts/gpu_session.py --out $OUT/c5 --budget 570 \
 "poly:60:python3 -m benchmarks.bench_attention --rows ssa_triton,ssa_triton_poly,sdpa_cudnn --out {out}/bench_poly.md > {out}/bench_poly.txt 2>&1; grep -E 'triton.*x cuDNN' {out}/bench_poly.txt" \
 "nemo-ssa:160:python3 scripts/pretrain.py attention=ssa $P run_dir=runs/ssa > {out}/nemo-ssa.txt 2>&1; cp runs/ssa/summary.json {out}/nemo_ssa_summary.json; cp runs/ssa/metrics.csv {out}/nemo_ssa_metrics.csv 2>/dev/null; grep -E 'metrics\]|Error' {out}/nemo-ssa.txt | tail -2" \
 "nemo-softmax:160:python3 scripts/pretrain.py attention=softmax $P run_dir=runs/sm > {out}/nemo-softmax.txt 2>&1; cp runs/sm/summary.json {out}/nemo_softmax_summary.json; grep -E 'metrics\]|Error' {out}/nemo-softmax.txt | tail -2" \
 "nemo-softmax-triton:160:python3 scripts/pretrain.py attention=softmax_triton $P run_dir=runs/st > {out}/nemo-st.txt 2>&1; cp runs/st/summary.json {out}/nemo_softmax_triton_summary.json; grep -E 'metrics\]|Error' {out}/nemo-st.txt | tail -2"
