set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu_session.py --preset full-1 --out $OUT/f1 --commit 25cad59
