set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c7 --budget 400 \
 "tests:90:python3 -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_ssa_flash_gpu.py -k 'bf16_within or fp32_ieee or dn_db or varlen' > {out}/tests.txt 2>&1; grep -E '^E |passed|failed' {out}/tests.txt | head" \
 "old:50:cd .ab_old && python3 -m benchmarks.bench_attention --quick --rows ssa_triton,sdpa_cudnn --out {out}/old.md > {out}/old.txt 2>&1; grep -E 'ssa_triton .*x cuDNN' {out}/old.txt" \
 "new:50:python3 -m benchmarks.bench_attention --quick --rows ssa_triton,sdpa_cudnn --out {out}/new.md > {out}/new.txt 2>&1; grep -E 'ssa_triton .*x cuDNN' {out}/new.txt" \
 "new-fd:50:NEMO_SSA_FUSED_DELTA=1 python3 -m benchmarks.bench_attention --quick --rows ssa_triton,sdpa_cudnn --out {out}/new_fd.md > {out}/new_fd.txt 2>&1; grep -E 'ssa_triton .*x cuDNN' {out}/new_fd.txt" \
 "overhead:40:python3 benchmarks/attention_overhead.py --out {out}/overhead.md > {out}/overhead.txt 2>&1; grep -E 'ssa_triton |sdpa_cudnn ' {out}/overhead.md | head -9" \
 "tune:60:python3 benchmarks/tune_tiles.py --kernels bwd_dq --shapes b32,model --out {out}/tune_dq.md > {out}/tune.txt 2>&1; grep best {out}/tune.txt"
