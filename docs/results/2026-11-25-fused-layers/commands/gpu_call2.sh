set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c2 --budget 580 \
 "tests:100:python3 -m pytest -q -n 4 --tb=short tests/ops/test_mlp_gpu.py tests/ops/test_cross_entropy.py tests/ops/test_rope.py 2>&1 | grep -E '^E |passed|failed' | head -30" \
 "mlp-tiles:70:python3 benchmarks/bench_mlp.py --tiles --tokens 32768 --out {out}/mlp_tiles.md 2>&1 | tail -30" \
 "mlp:150:python3 benchmarks/bench_mlp.py --tokens 8192,32768 --out {out}/mlp.md 2>&1 | tail -25" \
 "ce:80:python3 benchmarks/bench_linear_ce.py --out {out}/linear_ce.md 2>&1 | tail -14" \
 "model:150:python3 benchmarks/bench_model.py --attentions softmax,softmax_triton,ssa_triton --micro-batches 32 --out {out}/model.md 2>&1 | tail -12"
