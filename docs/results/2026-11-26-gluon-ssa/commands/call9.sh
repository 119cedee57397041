# Issue 28, call 9: D32 no slower -- bench_attention's three D32 shapes (recipe B8 N1024, B32
# N1024, B2 N4096; H24/Hkv8) with the Gluon kernels on (package default) and off, same machine.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r9; mkdir -p $R
for g in 1 0; do
  NEMO_SSA_GLUON=$g timeout 200 python3 -m benchmarks.bench_attention --quick --rows softmax_triton,ssa_triton,sdpa_flash,sdpa_cudnn --out $R/bench_d32_gluon$g.md > $R/bench_d32_gluon$g.log 2>&1; echo "gluon=$g rc=$?"
  grep -E "^\|" $R/bench_d32_gluon$g.md | cut -d'|' -f2,8,9,10,16,17 | head -14
done
