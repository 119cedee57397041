set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 scripts/gpu_session.py --preset quick --out $OUT/q --commit 81f7ca0 2>&1 | grep -E "passed|failed|FAIL" | head -20
R="attention=ssa compare_to=[] train=gpu_9min run_dir=runs/r2 train.val_check_interval=10 train.ckpt_every_n_steps=10 train.limit_val_batches=1 train.warmup_steps=5"
python3 scripts/gpu_session.py --out $OUT/s --budget 335 \
 "nsa-big:75:python3 -m pytest -q -p no:cacheprovider -m gpu_big -k 'bf16' tests/ops/test_nsa_gpu.py 2>&1 | grep -E '^E |passed|failed' | head" \
 "resume:255:for n in 20 30 40; do r=\$([ \$n = 20 ] && echo false || echo true); python3 scripts/pretrain.py $R train.max_steps=\$n resume=\$r > {out}/r\$n.txt 2>&1; echo \"launch max_steps=\$n resume=\$r rc=\$?\"; grep -E 'KeyError|Error|\\[pretrain\\]' {out}/r\$n.txt | tail -3 | cut -c1-200; done; cp runs/r2/metrics.csv {out}/r2_metrics.csv; cut -d, -f1-3,6 runs/r2/metrics.csv | tail -45"
