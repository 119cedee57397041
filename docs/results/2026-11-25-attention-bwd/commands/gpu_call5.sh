set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P="train=gpu_9min train.max_steps=300 compare_to=[]"
python3 scripts/gpu_session.py --out $OUT/c5 --budget 585 \
 "bench:110:python3 -m benchmarks.bench_attention --out {out}/bench_attention.md > {out}/bench.txt 2>&1; grep -E 'x cuDNN' {out}/bench.txt" \
 "overhead:60:python3 benchmarks/attention_overhead.py --out {out}/overhead.md > {out}/overhead.txt 2>&1; tail -8 {out}/overhead.txt" \
 "nemo-softmax:150:python3 scripts/pretrain.py attention=softmax $P run_dir=runs/sm > {out}/nemo-softmax.txt 2>&1; cp runs/sm/summary.json {out}/softmax_summary.json; grep -E 'metrics\]|Error' {out}/nemo-softmax.txt | tail -2" \
 "nemo-ssa:150:python3 scripts/pretrain.py attention=ssa $P run_dir=runs/ssa > {out}/nemo-ssa.txt 2>&1; cp runs/ssa/summary.json {out}/ssa_summary.json; grep -E 'metrics\]|Error' {out}/nemo-ssa.txt | tail -2"
