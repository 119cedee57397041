set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c4 --budget 560 \
 "tail-tests:70:python3 -m pytest -q -p no:cacheprovider tests/ops/test_flash_single_pass.py -k postprocess -n 6 2>&1 | tail -3" \
 "bench:170:python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash --out {out}/bench_attention.md > {out}/bench.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench.txt" \
 "bench-repeat:70:python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_attention_quick_repeat.md > {out}/bench2.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench2.txt" \
 "overhead:120:python3 benchmarks/attention_overhead.py --out {out}/attention_overhead.md > {out}/overhead.txt 2>&1; tail -9 {out}/attention_overhead.md" \
 "model:140:python3 benchmarks/bench_model.py --attentions softmax,softmax_triton,ssa_triton --micro-batches 8 --out {out}/model.md 2>&1 | tail -8"
