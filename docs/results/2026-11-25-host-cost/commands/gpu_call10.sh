set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p $OUT/c10
timeout 400 python3 benchmarks/bench_model.py --attentions softmax,softmax_triton,ssa_triton --micro-batches 8 --gaps $OUT/c10/gaps_mb8.txt --profile-mb 8 --out $OUT/c10/model_mb8.md > $OUT/c10/model.txt 2>&1
echo rc=$?
grep -E 'tok/s' $OUT/c10/model.txt
cat $OUT/c10/gaps_mb8.txt
