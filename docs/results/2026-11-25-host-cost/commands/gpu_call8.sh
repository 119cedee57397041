set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c8 --budget 420 \
 "tests:120:python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_flash_single_pass.py tests/ops/test_flash_fastpath.py tests/ops/test_ssa_flash_gpu.py -k 'single or postprocess or fastpath or cached or launch or fixed_b or test_single' 2>&1 | tail -3" \
 "bench:60:python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_quick.md > {out}/bench.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench.txt" \
 "model:200:python3 benchmarks/bench_model.py --attentions softmax,softmax_triton,ssa_triton --micro-batches 32 --profile {out}/model_prof_mb32.txt --profile-mb 32 --out {out}/model_mb32.md > {out}/model.txt 2>&1; grep -E 'tok/s' {out}/model.txt; grep -E '_attn_|cudnn_generated' {out}/model_prof_mb32.txt | grep -v aten | awk '{print \$1, \$(NF-4), \$(NF-1), \$NF}' | sort -u"
