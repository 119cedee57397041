set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --out $OUT/c9 --budget 400 \
 "bench:150:python3 -m benchmarks.bench_attention --gpu-time --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash --out {out}/bench_attention.md > {out}/bench.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/bench.txt" \
 "repeat1:60:python3 -m benchmarks.bench_attention --quick --gpu-time --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_attention_repeat1.md > {out}/r1.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/r1.txt" \
 "repeat2:60:python3 -m benchmarks.bench_attention --quick --gpu-time --rows softmax_triton,ssa_triton,sdpa_cudnn --out {out}/bench_attention_repeat2.md > {out}/r2.txt 2>&1; grep -E 'triton .*x cuDNN' {out}/r2.txt" \
 "overhead:90:python3 benchmarks/attention_overhead.py --out {out}/attention_overhead.md > {out}/overhead.txt 2>&1; tail -8 {out}/attention_overhead.md; python3 benchmarks/attention_overhead.py --cprofile 300 > {out}/cprofile.txt 2>&1; grep -E '^## |^\|' {out}/cprofile.txt"
