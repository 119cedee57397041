set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
R=/tmp/r2; mkdir -p $R
ROWS="--quick --rows softmax_triton,ssa_triton,sdpa_cudnn,sdpa_flash"
# A/B of LENGTH_ARGS: B = the kernels specialising on the sequence lengths again (the code before)
timeout 80 python3 -c "
import runpy, sys
import nemo_ssa.ops.attention.flash as f, nemo_ssa.ops.common.bwd_kernels as b
for k in (f._attn_fwd_kernel, b.attn_bwd_kernel_dq, b.attn_bwd_kernel_dkv, b.attn_bwd_preprocess):
    for p in k.params:
        if p.name in ('SEQ_Q', 'SEQ_K'): p.do_not_specialize = False
sys.argv = ['bench_attention'] + '$ROWS --out $R/bench_specialized.md'.split()
runpy.run_module('benchmarks.bench_attention', run_name='__main__')" > $R/bench_specialized.txt 2>&1
timeout 80 python3 -m benchmarks.bench_attention $ROWS --out $R/bench_length_args.md > $R/bench_length_args.txt 2>&1
echo "== specialised (before)"; grep -E 'triton .*x cuDNN' $R/bench_specialized.txt
echo "== LENGTH_ARGS (after)"; grep -E 'triton .*x cuDNN' $R/bench_length_args.txt
(timeout 420 python3 -m nemo_ssa.study.icl_train --attentions softmax,ssa --seeds 3 --out $R/icl > $R/icl.log 2>&1; echo "icl rc=$?" >> $R/icl.log) &
ICL=$!
timeout 250 python3 -m benchmarks.tiny_shapes --dtypes bf16 --dims 32,64,128 --out $R/tiny_bf16.md > $R/tiny_bf16.log 2>&1; echo "tiny bf16 rc=$?"
timeout 80 python3 -m benchmarks.tiny_shapes --ops flash,varlen,elsa --dtypes fp16,fp32 --dims 32,64 --out $R/tiny_fp16_fp32.md > $R/tiny_fp.log 2>&1; echo "tiny fp16/fp32 rc=$?"
wait $ICL
tail -3 $R/icl.log
tar czf $OUT/call2.tgz -C $R .
cat $R/tiny_bf16.md | head -40; cat $R/tiny_fp16_fp32.md | head -30; cat $R/icl/icl.md 2>/dev/null | head -50
