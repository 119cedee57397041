set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c1 --budget 575 \
 "helpers:60:python3 -m pytest -q -p no:cacheprovider tests/ops/test_ssa_flash.py -k 'fixed_b or helpers' 2>&1 | tail -5" \
 "quick:170:python3 -m pytest -q -p no:cacheprovider -m gpu_quick -n 4 --dist loadgroup tests/ops/test_ssa_flash_gpu.py tests/ops/test_ssa_flex_gpu.py tests/ops/test_elsa_gpu.py tests/ops/test_nsa_gpu.py tests/ops/test_extreme_logits.py > {out}/quick.txt 2>&1; grep -E '^E |passed|failed|FAILED' {out}/quick.txt | head -20" \
 "old:60:cd .ab_old && python3 -m benchmarks.bench_attention --quick --rows ssa_triton,sdpa_cudnn --out {out}/old.md > {out}/old.txt 2>&1; tail -8 {out}/old.txt" \
 "new:110:python3 -m benchmarks.bench_attention --out {out}/new.md > {out}/new.txt 2>&1; tail -22 {out}/new.txt" \
 "tune:150:python3 benchmarks/tune_tiles.py --kernels bwd_dq,bwd_dkv,flash_fwd --shapes b32 --out {out}/tune.md > {out}/tune.txt 2>&1; grep -iE 'best|speed|fail' {out}/tune.txt | head -20"
