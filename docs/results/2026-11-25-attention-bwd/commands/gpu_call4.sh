set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --preset full-2 --out $OUT/f2 --commit 25cad59
