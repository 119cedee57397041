set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P="train=gpu_9min train.max_steps=300 compare_to=[]"
python3 scripts/gpu_session.py --out $OUT/c6 --budget 570 \
 "nemo-softmax:190:python3 scripts/pretrain.py attention=softmax $P run_dir=runs/sm > {out}/nemo-softmax.txt 2>&1; cp runs/sm/summary.json {out}/nemo_softmax_summary.json; grep -E 'metrics\]|Error' {out}/nemo-softmax.txt | tail -2" \
 "nemo-ssa:200:python3 scripts/pretrain.py attention=ssa $P run_dir=runs/ssa > {out}/nemo-ssa.txt 2>&1; cp runs/ssa/summary.json {out}/nemo_ssa_summary.json; grep -E 'metrics\]|Error' {out}/nemo-ssa.txt | tail -2" \
 "model:150:python3 benchmarks/bench_model.py --attentions softmax,softmax_triton,ssa_triton --micro-batches 32 --out {out}/model_mb32.md 2>&1 | tail -6"
