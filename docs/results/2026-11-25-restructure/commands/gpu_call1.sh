set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P="train=gpu_9min train.max_steps=300 compare_to=[]"
python3 scripts/gpu_session.py --out $OUT --budget 545 \
 "bench:110:python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash --out {out}/bench_attention.md > {out}/bench.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench.txt" \
 "tiny-crash:45:python3 benchmarks/tiny_shapes.py --ops flash --dtypes bf16 --dims 32 --lengths 1,2 --out {out}/tiny_default.md" \
 "tiny-nospec:45:python3 benchmarks/tiny_shapes.py --ops flash --dtypes bf16 --dims 32 --lengths 1,2 --no-specialize ALL --out {out}/tiny_nospec_all.md" \
 "nemo-softmax:170:python3 scripts/pretrain.py attention=softmax $P run_dir=/tmp/runs/sm > {out}/nemo-softmax.txt 2>&1; cp /tmp/runs/sm/summary.json {out}/nemo_softmax_summary.json; grep -E 'metrics\]|Error' {out}/nemo-softmax.txt | tail -2" \
 "nemo-ssa:170:python3 scripts/pretrain.py attention=ssa $P run_dir=/tmp/runs/ssa > {out}/nemo-ssa.txt 2>&1; cp /tmp/runs/ssa/summary.json {out}/nemo_ssa_summary.json; grep -E 'metrics\]|Error' {out}/nemo-ssa.txt | tail -2"
