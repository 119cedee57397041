"""Device probe: the Gluon dK/dV kernel (variants/gluon_dkv_probe.py) inside the two-kernel backward
(Triton dQ kernel first) -- gradients against fp64 autograd (2x bf16 eager), then the whole
backward against the Triton one and cuDNN's (fwd+bwd minus fwd)."""
import os, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants"))
import torch
from triton.testing import do_bench
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
import gluon_dkv_probe as G  # noqa: E402
import nemo_ssa.ops.common.bwd as B
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.ops.attention.flash import flash_attention_fwd

dev = "cuda"
print(torch.cuda.get_device_name(), flush=True)
ORIG = B._launch_dkv
CFG = dict(D64=(64, 64, 3, 4), D128=(32, 64, 3, 4))
def cfg_for(d):
    bm, bn, st, w = CFG[f"D{d}"]
    return dict(block_m=bm, block_n=bn, stages=st, num_warps=w)

def bwd(do, q, k, v, o, M, tr, causal, nb, gluon, det=True):
    B._launch_dkv = ORIG
    if gluon:
        G.patch_bwd(**cfg_for(q.shape[-1]))
    try:
        return B.attention_bwd(do, q, k, v, o, M, transform=tr, causal=causal, deterministic=det, **nb)
    finally:
        B._launch_dkv = ORIG

NB = dict(n=torch.tensor([1.5], device=dev), b=torch.tensor([0.8], device=dev))
cases = [(tr, c, B_, HQ, HKV, SQ, SK, D) for tr in ("softmax", "ssa") for (c, B_, HQ, HKV, SQ, SK, D) in
         [(True, 1, 4, 2, 1000, 1000, 64), (True, 2, 4, 1, 777, 777, 128), (False, 1, 2, 2, 300, 1000, 128),
          (True, 1, 2, 2, 300, 1000, 64), (True, 1, 2, 2, 1000, 300, 128), (False, 1, 2, 1, 1, 1, 64),
          (True, 1, 2, 1, 17, 17, 128), (True, 1, 6, 2, 2048, 2048, 128)]]
rows, ok_all = [], True
for tr, causal, B_, HQ, HKV, SQ, SK, D in cases:
    g = torch.Generator(device=dev).manual_seed(SQ * 3 + D)
    q = torch.randn(B_, HQ, SQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B_, HKV, SK, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B_, HKV, SK, D, device=dev, dtype=torch.bfloat16, generator=g)
    do = torch.randn(B_, HQ, SQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    nb = NB if tr == "ssa" else {}
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    attention_naive(qr, kr, vr, transform=tr, causal=causal, **{a: t.double() for a, t in nb.items()}).backward(do.double())
    ref = [torch.nan_to_num(t.grad, nan=0.0) for t in (qr, kr, vr)]
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    attention_naive(qe, ke, ve, transform=tr, causal=causal, upcast=False, **nb).backward(do)
    eag = [torch.nan_to_num(t.grad.double(), nan=0.0) for t in (qe, ke, ve)]
    o, M = flash_attention_fwd(q, k, v, transform=tr, causal=causal, **nb)
    try:
        got = bwd(do, q, k, v, o, M, tr, causal, nb, True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa
        rows.append(f"| {tr} c={int(causal)} B{B_} H{HQ}/{HKV} {SQ}x{SK} D{D} | FAIL {str(e).splitlines()[-1][:100]} |"); ok_all = False; continue
    tri = bwd(do, q, k, v, o, M, tr, causal, nb, False)
    parts, ok = [], True
    for name, gt, rf, eg, trr in zip("q k v".split(), got[:3], ref, eag, tri[:3]):
        e_g = (gt.double() - rf).abs().max().item(); e_e = (eg - rf).abs().max().item(); e_t = (trr.double() - rf).abs().max().item()
        good = (not torch.isnan(gt).any().item()) and e_g <= 2 * e_e + 1e-6
        ok &= good
        parts.append(f"d{name} {e_g:.1e}/{e_t:.1e}/{e_e:.1e}{'' if good else ' BAD'}")
    if tr == "ssa":
        parts.append(f"dn {got[3].item():.4g}/{tri[3].item():.4g}")
    ok_all &= ok
    rows.append(f"| {tr} c={int(causal)} B{B_} H{HQ}/{HKV} {SQ}x{SK} D{D} | {'ok' if ok else 'BAD'} | {'; '.join(parts)} |")
print("| case | result | gluon / triton / eager max err |\n|---|---|---|")
print("\n".join(rows), flush=True)
print("ALL OK" if ok_all else "SOME BAD", flush=True)
tab = []
for Bz, N, H, D in [(2, 8192, 8, 128), (8, 4096, 8, 128), (2, 8192, 16, 64), (8, 4096, 16, 64)]:
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v, do = (torch.randn(Bz, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    res = {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        def fb():
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(do)
        def fo():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        res["cudnn bwd"] = do_bench(fb, warmup=25, rep=100, return_mode="median", grad_to_none=[qq, kk, vv]) - do_bench(fo, warmup=25, rep=100, return_mode="median")
    for tr in ("softmax", "ssa"):
        nb = NB if tr == "ssa" else {}
        o, M = flash_attention_fwd(q, k, v, transform=tr, causal=True, **nb)
        res[f"{tr} triton two-kernel"] = do_bench(lambda: bwd(do, q, k, v, o, M, tr, True, nb, False), warmup=25, rep=100, return_mode="median")
        if tr == "ssa" and D == 64:
            res[f"{tr} triton single pass"] = do_bench(lambda: bwd(do, q, k, v, o, M, tr, True, nb, False, det=False), warmup=25, rep=100, return_mode="median")
        res[f"{tr} triton dq + gluon dkv"] = do_bench(lambda: bwd(do, q, k, v, o, M, tr, True, nb, True), warmup=25, rep=100, return_mode="median")
    for name, ms in res.items():
        tab.append(f"| B{Bz} N{N} H{H} D{D} | {name} | {ms:.3f} | {ms / res['cudnn bwd']:.3f} |")
    print("\n".join(tab[-len(res):]), flush=True)
print("| shape | what | bwd ms | x cuDNN bwd |\n|---|---|---|---|")
print("\n".join(tab))
