# Issue 28, call 12: NSA's compressed branch backward through the warp-specialised Gluon
# single pass (kstride/koff visibility): the new GPU test and the range-kernel tests that pin
# their own backward; then bench_nsa at D64 GQA16 (16K, 64K) with the Gluon kernels on and off.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/r12; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/nsa/test_nsa_gpu.py -k "gluon or dkv_split or tma_matches" -rA > $R/test_nsa_gluon.txt 2>&1; echo "tests rc=$?"; tail -1 $R/test_nsa_gluon.txt; grep -E "^FAILED|Error" $R/test_nsa_gluon.txt | head -20
for g in 1 0; do
  NEMO_SSA_GLUON=$g timeout 150 python3 benchmarks/bench_nsa.py --ns 16384,65536 --dims 64 --hq 64 --hkv 4 --compress mean --rep-ms 60 --warmup-ms 20 --only sdpa_flash,nsa_layer --out $R/d64_gqa16_gluon$g.md > $R/b64_gluon$g.log 2>&1; echo "gluon=$g rc=$?"; grep -E "^\| [0-9]" $R/d64_gqa16_gluon$g.md
done
