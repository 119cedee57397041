# Issue 28 (SSA D64), call 8: the final tables (the D64 SSA backward with fold_rcp and ds_smem,
# the D64 SSA forward with 128-key blocks) -- the GPU full-1 preset, then bench_attention --wide twice.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r8; mkdir -p $R
for i in 1 2; do
timeout 120 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_flash,sdpa_cudnn --out $R/bench_wide$i.md > $R/bench_wide$i.log 2>&1; echo "bench $i rc=$?"
grep -E "^\|" $R/bench_wide$i.md | cut -d'|' -f2,3,8,9,10,16,17 | head -20
done
timeout 470 python3 scripts/gpu_session.py --preset full-1 --out $R/full1 > $R/full1.log 2>&1; echo "full-1 rc=$?"; tail -6 $R/full1.log
