"""Issue 28: is SSA's D64 forward bound by the MUFU pipe? The Gluon forward (with C, the table
row at D64) with its lg2 and/or ex2 moved to polynomials on the FMA pipes, and without the lg2
at all (wrong math: its cost), from the probe copy variants/hopper_fwd_mufu.py; the shipped
kernel and SDPA cuDNN's forward in the same process. Outputs of the polynomial variants are
checked against the shipped kernel's."""
import importlib.util
import os

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

spec = importlib.util.spec_from_file_location(
    "hopper_fwd_mufu", os.path.join(os.path.dirname(__file__), "variants", "hopper_fwd_mufu.py"))
HV = importlib.util.module_from_spec(spec)
spec.loader.exec_module(HV)

MODES = {0: "MUFU lg2 + ex2 (shipped)", 1: "poly lg2", 2: "no lg2 (wrong math)", 3: "poly ex2", 4: "poly lg2 + ex2"}
cfg = HV.GluonFwdConfig(64, 64, 3, 4)
rows = []
for label, B, H, N, D in [("D64 B2 N8192 H16", 2, 16, 8192, 64), ("D64 B8 N4096 H16", 8, 16, 4096, 64)]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    n = torch.tensor([1.5], device="cuda")
    b = torch.tensor([0.8], device="cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                        rep=300, return_mode="median")
    r = dict(shape=label, cudnn=cudnn)
    ref = None
    for mode in MODES:
        o = torch.empty_like(q)
        M = torch.empty(B, H, N, device="cuda")
        C = torch.empty_like(M)
        f = lambda: HV.gluon_fwd(q, k, v, o, M, n, b, transform_id=1, causal=True, scale=D ** -0.5,  # noqa: E731
                                 config=cfg, cstat=C, mufu=mode)
        f()
        torch.cuda.synchronize()
        if mode == 0:
            ref = (o.float().clone(), C.clone())
        elif mode != 2:
            err = ((o.float() - ref[0]).abs().max().item(), (C - ref[1]).abs().max().item())
            r[f"err{mode}"] = err
            assert err[0] < 2e-2 and err[1] < 1e-3, (mode, err)
        r[mode] = triton.testing.do_bench(f, rep=300, return_mode="median")
    print(r, flush=True)
    rows.append(r)
print("\n| variant | " + " | ".join(r["shape"] for r in rows) + " |")
print("|---|" + "---|" * len(rows))
print("| SDPA cuDNN forward | " + " | ".join(f"{r['cudnn']:.3f}" for r in rows) + " |")
for mode, name in MODES.items():
    print(f"| {name} | " + " | ".join(f"{r[mode]:.3f} ({r[mode] / r['cudnn']:.2f}×, {r[mode] / r[0]:.3f} of shipped)"
                                      for r in rows) + " |")
