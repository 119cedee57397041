# Issue 28, call 10: the warp-specialised Gluon backward in the package (softmax D128, single
# pass where the backward may be non-deterministic): its GPU tests, the Gluon forward's and the
# flash files; the four D64/D128 shapes with both Gluon kernels off and on.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r10; mkdir -p $R
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/common/test_hopper_bwd.py tests/ops/attention/test_flash_gluon.py -rA > $R/test_gluon.txt 2>&1; echo "gluon tests rc=$?"; tail -1 $R/test_gluon.txt; grep -E "FAILED|Error" $R/test_gluon.txt | head
for g in 1 0; do
  NEMO_SSA_GLUON=$g timeout 110 python3 -m benchmarks.bench_attention --wide --rows softmax_triton,ssa_triton,sdpa_cudnn --out $R/bench_wide_gluon$g.md > $R/bench_wide_gluon$g.log 2>&1; echo "gluon=$g rc=$?"
  grep -E "^\|" $R/bench_wide_gluon$g.md | cut -d'|' -f2,8,9,10,16,17 | head -14
done
timeout 160 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/ops/attention/test_flash_gpu.py tests/ops/attention/test_flash_single_pass.py tests/ops/test_tiny_shapes.py > $R/test_flash_gpu.txt 2>&1; echo "flash gpu rc=$?"; tail -1 $R/test_flash_gpu.txt; grep FAILED $R/test_flash_gpu.txt | head
