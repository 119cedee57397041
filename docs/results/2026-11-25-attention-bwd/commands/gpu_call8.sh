set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c8 --budget 300 \
 "tests:110:python3 -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_ssa_flash_gpu.py tests/ops/test_elsa_gpu.py -m gpu_quick > {out}/tests.txt 2>&1; python3 -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_ssa_flash_gpu.py -k 'bf16_within or fp32_ieee or dn_db or varlen or strided' >> {out}/tests.txt 2>&1; grep -E '^E |passed|failed' {out}/tests.txt | head" \
 "old:40:cd .ab_old && python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/old.md > {out}/old.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/old.txt" \
 "new:40:python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/new.md > {out}/new.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/new.txt" \
 "old2:40:cd .ab_old && python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/old2.md > {out}/old2.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/old2.txt" \
 "new2:40:python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/new2.md > {out}/new2.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/new2.txt"
