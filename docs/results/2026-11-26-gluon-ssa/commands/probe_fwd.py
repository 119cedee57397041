"""Issue 28: the flash forward alone, SSA and softmax at D64 and D128 -- Triton kernel, Gluon
kernel (the D64 rows patched into the table), each with and without the row means C (SSA:
what the single-pass backward needs); SDPA cuDNN's forward in the same process."""
import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.attention.hopper as HF
from nemo_ssa.ops.attention import flash as fl

SHAPES = [("D128", 2, 8, 8192, 128), ("D128 B8", 8, 8, 4096, 128), ("D64", 2, 16, 8192, 64), ("D64 B8", 8, 16, 4096, 64)]
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
    for tr in ("softmax", "ssa"):
        for gl_on in (False, True):
            HF.GLUON_FWD.clear()
            if gl_on:
                HF.GLUON_FWD.update(SAVED)
                HF.GLUON_FWD.setdefault((D, tr), HF.GluonFwdConfig(64, 64, 3, 4))
            for save_c in ((False, True) if tr == "ssa" else (False,)):
                f = lambda: fl._flash_fwd(q, k, v, n if tr == "ssa" else None, b if tr == "ssa" else None, None, None,  # noqa: E731
                                          None, tr, True, D ** -0.5, 0.0, N, N, "ieee", True, save_c=save_c)
                f()
                r[f"{tr}_{'gluon' if gl_on else 'triton'}{'_C' if save_c else ''}"] = triton.testing.do_bench(
                    f, rep=200, return_mode="median")
    HF.GLUON_FWD.clear()
    HF.GLUON_FWD.update(SAVED)
    print(r, flush=True)
    rows.append(r)
keys = [k for k in rows[0] if k not in ("shape", "cudnn")]
print("\n| shape | cuDNN fwd ms | " + " | ".join(keys) + " |")
print("|---|---|" + "---|" * len(keys))
for r in rows:
    print(f"| {r['shape']} | {r['cudnn']:.3f} | " + " | ".join(f"{r[k]:.3f} ({r[k] / r['cudnn']:.2f})" for k in keys) + " |")
