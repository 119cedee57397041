set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p $OUT/c3
python3 benchmarks/attention_overhead.py --cprofile 300 > $OUT/c3/cprofile.txt 2>&1; grep -E "^## |^\|" $OUT/c3/cprofile.txt
python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash --out $OUT/c3/bench.md > $OUT/c3/bench.txt 2>&1; grep -E "x cuDNN" $OUT/c3/bench.txt
python3 scripts/gpu_session.py --preset quick --out $OUT/c3/q --commit cbbd933 2>&1 | tail -15
