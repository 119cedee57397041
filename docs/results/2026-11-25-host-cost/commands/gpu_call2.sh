set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p $OUT/c2
python3 -m pytest -q -p no:cacheprovider -x tests/ops/test_flash_single_pass.py tests/ops/test_flash_fastpath.py -n 8 > $OUT/c2/tests.txt 2>&1; tail -4 $OUT/c2/tests.txt
python3 benchmarks/attention_overhead.py --cprofile 300 > $OUT/c2/cprofile.txt 2>&1; grep -E "^## |^\|" $OUT/c2/cprofile.txt
timeout 150 python3 benchmarks/attention_overhead.py --out $OUT/c2/overhead.md > $OUT/c2/overhead.txt 2>&1; tail -9 $OUT/c2/overhead.md
python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash --out $OUT/c2/bench.md > $OUT/c2/bench.txt 2>&1; grep -E "x cuDNN" $OUT/c2/bench.txt
