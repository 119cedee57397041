# Issue 28, call 11: the GPU full-1 preset on the final code (both Gluon kernels on the default
# path at D128: flash GPU file, the CPU op tests run on CUDA, flex, ELSA, tiny lengths, RoPE,
# CE, MLP, megatron fast paths, the Gluon files)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r11; mkdir -p $R
timeout 560 python3 scripts/gpu_session.py --preset full-1 --out $R/full1 > $R/full1.log 2>&1; echo "full-1 rc=$?"; tail -6 $R/full1.log
