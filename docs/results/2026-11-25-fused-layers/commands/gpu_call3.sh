set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
P="train=gpu_9min train.max_steps=300 compare_to=[]"
python3 scripts/gpu_session.py --out $OUT/c3 --budget 588 \
 "tests:50:python3 -m pytest -q -n 4 --tb=short tests/ops/test_mlp_gpu.py tests/ops/test_cross_entropy.py 2>&1 | grep -E '^E |passed|failed' | head -20" \
 "mlp:60:python3 benchmarks/bench_mlp.py --tokens 32768 --skip max-autotune --out {out}/mlp.md > {out}/mlp.txt 2>&1; tail -16 {out}/mlp.txt" \
 "nemo-softmax:155:python3 scripts/pretrain.py attention=softmax $P run_dir=runs/sm > {out}/nemo-softmax.txt 2>&1; cp runs/sm/summary.json {out}/softmax_summary.json; cp runs/sm/metrics.csv {out}/softmax_metrics.csv; grep -E 'metrics\]|Error' {out}/nemo-softmax.txt | tail -3" \
 "nemo-ssa:155:python3 scripts/pretrain.py attention=ssa $P run_dir=runs/ssa > {out}/nemo-ssa.txt 2>&1; cp runs/ssa/summary.json {out}/ssa_summary.json; cp runs/ssa/metrics.csv {out}/ssa_metrics.csv; grep -E 'metrics\]|Error' {out}/nemo-ssa.txt | tail -3" \
 "nemo-softmax_triton:155:python3 scripts/pretrain.py attention=softmax_triton $P run_dir=runs/st > {out}/nemo-st.txt 2>&1; cp runs/st/summary.json {out}/st_summary.json; cp runs/st/metrics.csv {out}/st_metrics.csv; grep -E 'metrics\]|Error' {out}/nemo-st.txt | tail -3"
