"""Device probe: warp-specialised Gluon single-pass backward (variants/gluon_bwd_ws_probe.py), softmax --
gradients against fp64 autograd (2x bf16 eager), then backward time against the Triton
backward (ops.common.bwd.attention_bwd) and SDPA cuDNN's (fwd+bwd minus fwd)."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants"))
from gluon_bwd_ws_probe import hopper_bwd_ws
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.ops.attention.flash import flash_attention_fwd
from nemo_ssa.ops.common.bwd import attention_bwd

dev = "cuda"
print(torch.cuda.get_device_name(), flush=True)
CFGS = [(int(a), int(b)) for a, b in (x.split(":") for x in os.environ.get("BWD_CFGS", "8:2").split(","))]
cases = [(True, 1, 4, 2, 1000, 1000, 64), (True, 2, 4, 1, 777, 777, 128), (False, 1, 2, 2, 300, 1000, 128),
         (True, 1, 2, 2, 300, 1000, 64), (True, 1, 2, 2, 1000, 300, 64), (False, 1, 2, 1, 1, 1, 64),
         (True, 1, 2, 1, 17, 17, 128), (True, 1, 3, 3, 2048, 2048, 128), (True, 1, 2, 2, 4096, 4096, 64)]
rows, ok_all = [], True
for causal, B, HQ, HKV, SQ, SK, D in cases:
    g = torch.Generator(device=dev).manual_seed(SQ * 3 + D)
    q = torch.randn(B, HQ, SQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, SK, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, SK, D, device=dev, dtype=torch.bfloat16, generator=g)
    do = torch.randn(B, HQ, SQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    attention_naive(qr, kr, vr, transform="softmax", causal=causal).backward(do.double())
    ref = [torch.nan_to_num(t.grad, nan=0.0) for t in (qr, kr, vr)]
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    attention_naive(qe, ke, ve, transform="softmax", causal=causal, upcast=False).backward(do)
    eag = [torch.nan_to_num(t.grad.double(), nan=0.0) for t in (qe, ke, ve)]
    o, M = flash_attention_fwd(q, k, v, transform="softmax", causal=causal)
    tri = attention_bwd(do, q, k, v, o, M, transform="softmax", causal=causal)[:3]
    for w, st in CFGS:
        try:
            got = hopper_bwd_ws(q, k, v, o, do, M, causal=causal, num_warps=w, stages=st, poison=True)
            torch.cuda.synchronize()
        except Exception as e:  # noqa
            rows.append(f"| c={int(causal)} B{B} H{HQ}/{HKV} {SQ}x{SK} D{D} w{w} st{st} | FAIL {str(e).splitlines()[-1][:100]} |"); ok_all = False; continue
        parts = []
        ok = True
        for name, gt, rf, eg, tr in zip("q k v".split(), got, ref, eag, tri):
            e_g = (gt.double() - rf).abs().max().item(); e_e = (eg - rf).abs().max().item(); e_t = (tr.double() - rf).abs().max().item()
            good = (not torch.isnan(gt).any().item()) and e_g <= 2 * e_e + 1e-6
            ok &= good
            parts.append(f"d{name} {e_g:.1e}/{e_t:.1e}/{e_e:.1e}{'' if good else ' BAD'}")
        ok_all &= ok
        rows.append(f"| c={int(causal)} B{B} H{HQ}/{HKV} {SQ}x{SK} D{D} w{w} st{st} | {'ok' if ok else 'BAD'} | {'; '.join(parts)} |")
print("| case | result | gluon / triton / eager max err |\n|---|---|---|")
print("\n".join(rows), flush=True)
print("ALL OK" if ok_all else "SOME BAD", flush=True)
if os.environ.get("PROBE_SKIP_TIME"):
    sys.exit(0)
tab = []
for B, N, H, D in [(2, 8192, 16, 64), (2, 8192, 8, 128), (8, 4096, 16, 64), (8, 4096, 8, 128)]:
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    flops = 2.5 * 4 * B * H * N * N * D / 2
    res = {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        def fb():
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out.backward(do)
        def fo():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t_fb = do_bench(fb, warmup=25, rep=100, return_mode="median", grad_to_none=[qq, kk, vv])
        t_f = do_bench(fo, warmup=25, rep=100, return_mode="median")
        res["cudnn bwd"] = t_fb - t_f
    o, M = flash_attention_fwd(q, k, v, transform="softmax", causal=True)
    res["triton bwd"] = do_bench(lambda: attention_bwd(do, q, k, v, o, M, transform="softmax", causal=True), warmup=25, rep=100, return_mode="median")
    for w, st in CFGS + ([(8, 3)] if D == 64 else []):
        try:
            res[f"gluon ws w{w} st{st}"] = do_bench(lambda: hopper_bwd_ws(q, k, v, o, do, M, causal=True, num_warps=w, stages=st), warmup=25, rep=100, return_mode="median")
        except Exception as e:  # noqa
            print("time fail", w, st, str(e).splitlines()[-1][:120], flush=True)
    for name, ms in res.items():
        tab.append(f"| B{B} N{N} H{H} D{D} | {name} | {ms:.3f} | {ms / res['cudnn bwd']:.3f} | {flops / ms / 1e9:.0f} |")
    print("\n".join(tab[-len(res):]), flush=True)
print("| shape | what | bwd ms | x cuDNN bwd | TFLOP/s |\n|---|---|---|---|---|")
print("\n".join(tab))
