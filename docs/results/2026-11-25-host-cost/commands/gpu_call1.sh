set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; lscpu | grep -E "Model name|MHz" | head -3
mkdir -p $OUT/c1
python3 benchmarks/attention_overhead.py --cprofile 300 > $OUT/c1/cprofile.txt 2>&1; tail -12 $OUT/c1/cprofile.txt
timeout 200 python3 benchmarks/attention_overhead.py --out $OUT/c1/overhead.md > $OUT/c1/overhead.txt 2>&1; tail -12 $OUT/c1/overhead.md
