set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c1 --budget 560 \
 "det:45:NEMO_SSA_BWD=deterministic python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_det.md > {out}/bench_det.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench_det.txt" \
 "atomic:45:NEMO_SSA_BWD=atomic python3 -m benchmarks.bench_attention --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_atomic.md > {out}/bench_atomic.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench_atomic.txt" \
 "tests:130:python3 -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_ssa_flash_gpu.py -m gpu_quick > {out}/tests.txt 2>&1; python3 -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_ssa_flash_gpu.py tests/ops/test_flash_single_pass.py tests/ops/test_flash_fastpath.py -k 'single_pass or fastpath or eager or out_ or cached' >> {out}/tests.txt 2>&1; grep -E '^E |passed|failed' {out}/tests.txt | head -20" \
 "tune:300:python3 -m benchmarks.tune_tiles --kernels bwd_single --shapes b32,model,d64,d128 --rep 20 --workers 16 --out {out}/tune_single.md > {out}/tune_single.txt 2>&1; tail -12 {out}/tune_single.txt"
