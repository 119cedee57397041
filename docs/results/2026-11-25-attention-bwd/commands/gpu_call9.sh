set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --preset quick --out $OUT/q --commit 967ee9b
