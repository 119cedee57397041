"""Issue 28: the SSA forward at D64 (with and without the row means C) -- the Triton kernel
and Gluon variants: registers capped for more programs per SM (maxnreg 128: four), ring
depth 2 / 3 / 4; SDPA cuDNN's forward in the same process."""
import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.attention.hopper as HF
from nemo_ssa.ops.attention import flash as fl

G = HF.GluonFwdConfig
VARIANTS = {"triton": None, "g_s3": G(64, 64, 3, 4), "g_s3_r128": G(64, 64, 3, 4, maxnreg=128),
            "g_s2_r128": G(64, 64, 2, 4, maxnreg=128), "g_s4_r128": G(64, 64, 4, 4, maxnreg=128),
            "g_s4": G(64, 64, 4, 4)}
SHAPES = [("D64", 2, 16, 8192, 64), ("D64 B8", 8, 16, 4096, 64)]
SAVED = dict(HF.GLUON_FWD)
rows = []
for label, B, H, N, D in SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    n = torch.tensor([1.5], device="cuda")
    b = torch.tensor([0.8], device="cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                        rep=200, return_mode="median")
    r = dict(shape=label, cudnn=cudnn)
    ref = {}
    for name, cfg in VARIANTS.items():
        HF.GLUON_FWD.clear()
        if cfg is not None:
            HF.GLUON_FWD[(D, "ssa")] = cfg
        for save_c in (False, True):
            f = lambda: fl._flash_fwd(q, k, v, n, b, None, None, None, "ssa", True, D ** -0.5, 0.0, N, N,  # noqa: E731
                                      "ieee", True, save_c=save_c)
            o, M, C = f()
            if name == "triton":
                ref[save_c] = (o, C)
            else:
                err = ((o.float() - ref[save_c][0].float()).abs().max().item())
                assert err < 2e-2, (name, save_c, err)
                if save_c:
                    assert (C - ref[True][1]).abs().max().item() < 1e-3, name
            r[f"{name}{'_C' if save_c else ''}"] = triton.testing.do_bench(f, rep=200, return_mode="median")
    HF.GLUON_FWD.clear()
    HF.GLUON_FWD.update(SAVED)
    print(r, flush=True)
    rows.append(r)
keys = [k for k in rows[0] if k not in ("shape", "cudnn")]
print("\n| variant | " + " | ".join(r["shape"] for r in rows) + " |")
print("|---|" + "---|" * len(rows))
print("| cuDNN | " + " | ".join(f"{r['cudnn']:.3f}" for r in rows) + " |")
for key in keys:
    print(f"| {key} | " + " | ".join(f"{r[key]:.3f} ({r[key] / r['cudnn']:.2f})" for r in rows) + " |")
