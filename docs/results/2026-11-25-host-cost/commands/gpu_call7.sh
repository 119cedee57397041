set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p $OUT/c7
timeout 280 python3 benchmarks/bench_model.py --attentions softmax,ssa_triton --micro-batches 32 --profile $OUT/c7/model_prof_mb32.txt --profile-mb 32 --out $OUT/c7/model_mb32.md > $OUT/c7/model.txt 2>&1
grep -E "^\[|tok/s" $OUT/c7/model.txt; grep -A14 "GPU kernel time" $OUT/c7/model_prof_mb32.txt | head -40
