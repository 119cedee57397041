"""Device probe: Gluon Hopper forward (variants/gluon_fwd_probe.py) -- correctness against fp64 /
bf16 eager / the Triton forward, then timing against SDPA cuDNN/flash and the Triton forward."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants"))
from gluon_fwd_probe import hopper_fwd
from nemo_ssa.ops.attention.naive import attention_naive
from nemo_ssa.ops.attention.flash import flash_attention_fwd

dev = "cuda"
print(torch.cuda.get_device_name(), flush=True)
rows = []
NB = torch.tensor([1.5], device=dev), torch.tensor([0.8], device=dev)

def params(tr):
    return dict(n=NB[0], b=NB[1]) if tr == "ssa" else {}

cases = [("softmax", True, 1, 4, 2, 1000, 1000, 64), ("ssa", True, 2, 4, 1, 777, 777, 128),
         ("softmax", False, 1, 2, 2, 300, 1000, 128), ("ssa", True, 1, 2, 2, 300, 1000, 64),
         ("softmax", True, 1, 2, 2, 1000, 300, 64), ("ssa", False, 1, 2, 1, 1, 1, 64),
         ("softmax", True, 1, 2, 1, 17, 17, 128), ("ssa", True, 1, 3, 3, 2048, 2048, 128)]
ok_all = True
for tr, causal, B, HQ, HKV, SQ, SK, D in cases:
    for bm, bn, st, w in ((128, 128, 2, 8), (64, 128, 2, 4)) if D == 64 else ((128, 64, 2, 8), (64, 64, 3, 4)):
        g = torch.Generator(device=dev).manual_seed(SQ * 7 + D)
        q = torch.randn(B, HQ, SQ, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, HKV, SK, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, HKV, SK, D, device=dev, dtype=torch.bfloat16, generator=g)
        pr = params(tr)
        ref = attention_naive(q.double(), k.double(), v.double(), transform=tr, causal=causal,
                              **{a: t.double() for a, t in pr.items()})
        eager = attention_naive(q, k, v, transform=tr, causal=causal, upcast=False, **pr)
        try:
            o, M = hopper_fwd(q, k, v, transform=tr, causal=causal, block_m=bm, block_n=bn, stages=st, num_warps=w, poison=True, **pr)
            torch.cuda.synchronize()
        except Exception as e:  # noqa
            rows.append(f"| {tr} c={int(causal)} B{B} H{HQ}/{HKV} {SQ}x{SK} D{D} bm{bm} bn{bn} st{st} w{w} | FAIL {str(e).splitlines()[-1][:100]} |")
            ok_all = False
            continue
        ot, Mt = flash_attention_fwd(q, k, v, transform=tr, causal=causal, **pr)
        ref = torch.nan_to_num(ref, nan=0.0)
        e_g = (o.double() - ref).abs().max().item()
        e_e = (torch.nan_to_num(eager.double(), nan=0.0) - ref).abs().max().item()
        e_t = (ot.double() - ref).abs().max().item()
        fin = torch.isfinite(Mt)
        dM = (M[fin] - Mt[fin]).abs().max().item() if fin.any() else 0.0
        inf_same = torch.equal(torch.isinf(M), torch.isinf(Mt))
        ok = (not torch.isnan(o).any().item()) and e_g <= 2 * e_e + 1e-6 and dM < 1e-3 and inf_same
        ok_all &= ok
        rows.append(f"| {tr} c={int(causal)} B{B} H{HQ}/{HKV} {SQ}x{SK} D{D} bm{bm} bn{bn} st{st} w{w} | {'ok' if ok else 'BAD'} gluon {e_g:.2e} triton {e_t:.2e} eager {e_e:.2e} max|dM| {dM:.1e} inf same {inf_same} |")
print("| case | result |\n|---|---|")
print("\n".join(rows), flush=True)
print("ALL OK" if ok_all else "SOME BAD", flush=True)

if os.environ.get("PROBE_SKIP_TIME"):
    sys.exit(0)
tab = []
for B, N, H, D in [(2, 8192, 16, 64), (2, 8192, 8, 128), (8, 4096, 16, 64), (8, 4096, 8, 128)]:
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * B * H * N * N * D / 2
    res = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([be]):
            res[name] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=25, rep=100, return_mode="median")
    for tr in ("softmax", "ssa"):
        pr = params(tr)
        res[f"triton {tr}"] = do_bench(lambda: flash_attention_fwd(q, k, v, transform=tr, causal=True, **pr), warmup=25, rep=100, return_mode="median")
        for bm, bn, st, w in ([(128, 128, 2, 8), (64, 128, 2, 4), (64, 64, 3, 4), (64, 128, 3, 4)] if D == 64 else
                              [(128, 128, 2, 8), (64, 64, 2, 4), (64, 128, 2, 4), (64, 64, 3, 4)]):
            try:
                res[f"gluon {tr} bm{bm} bn{bn} st{st} w{w}"] = do_bench(lambda: hopper_fwd(q, k, v, transform=tr, causal=True, block_m=bm, block_n=bn, stages=st, num_warps=w, **pr), warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa
                print("time fail", tr, bn, st, str(e).splitlines()[-1][:120], flush=True)
    for name, ms in res.items():
        tab.append(f"| B{B} N{N} H{H} D{D} | {name} | {ms:.3f} | {ms / res['cudnn']:.3f} | {flops / ms / 1e9:.0f} |")
    print("\n".join(tab[-len(res):]), flush=True)
print("| shape | what | fwd ms | x cuDNN | TFLOP/s |\n|---|---|---|---|---|")
print("\n".join(tab))
