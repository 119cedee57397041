"""Issue 28, SSA at D64: where does the Gluon backward's time go? Patched copies of
hopper_bwd.py (each a wrong-math or no-output probe, timed only): without the dq bulk reduce,
without the reciprocal, without the log2, softmax math in the pipelined kernel; fwd+bwd ms
against SDPA cuDNN and the package, the package timed first and last."""
import importlib.util
import os
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import nemo_ssa.ops.common.bwd as B
import nemo_ssa.ops.common.hopper_bwd as H
from nemo_ssa.ops.attention.flash import softmax_attention_triton, ssa_attention_triton

SRC = open(H.__file__).read()
PATCHES = {
    "no dq reduce": [("            _tma_reduce_add(dq_desc, [z, h0 + g, start_m, 0], dq_smem.index(b))\n", "")],
    "no rcp (ds = dz)": [("            dsT = dzT * rcp_mixed(t, RCP_FMA)", "            dsT = dzT")],
    "no lg2 (smag = t)": [("            z2, smag, t = ssa_parts(sT, c0, c1)",
                           "            t = sT * c0 + 1.0\n            smag = t\n            z2 = c1 * smag")],
    "no dn sum": [("                dnk += gl.sum(dzT * (smag - gl.expand_dims(c_row, 0)), axis=1)", "")],
}


def variant(name):
    s = SRC
    for a, b in PATCHES[name]:
        assert s.count(a) == 1, (name, a)
        s = s.replace(a, b)
    path = f"/tmp/hb_{abs(hash(name))}.py"
    open(path, "w").write(s)
    spec = importlib.util.spec_from_file_location(f"hb_{abs(hash(name))}", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def bench(f):
    f()
    torch.cuda.synchronize()
    return triton.testing.do_bench(f, rep=300, return_mode="median")


rows = []
for label, Bz, Hh, N, D in [("D64 B2 N8192", 2, 16, 8192, 64), ("D64 B8 N4096", 8, 16, 4096, 64)]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(Bz, Hh, N, D, device="cuda", dtype=torch.bfloat16)
    n = torch.tensor([1.5], device="cuda", requires_grad=True)
    b = torch.tensor([0.8], device="cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        c_fb = bench(lambda: torch.autograd.grad(sd(), [q, k, v], go))
    ssa = lambda: torch.autograd.grad(ssa_attention_triton(q, k, v, n, b, causal=True), [q, k, v, n], go)  # noqa: E731
    soft = lambda: torch.autograd.grad(softmax_attention_triton(q, k, v, causal=True), [q, k, v], go)  # noqa: E731
    rows.append((label, "package SSA (first)", bench(ssa), c_fb))
    rows.append((label, "package softmax", bench(soft), c_fb))
    saved = dict(H.GLUON_BWD)
    H.GLUON_BWD[(64, "softmax")] = H.GLUON_BWD[(64, "ssa")]
    rows.append((label, "softmax through SSA's pipelined tiles", bench(soft), c_fb))
    H.GLUON_BWD.clear()
    H.GLUON_BWD.update(saved)
    for name in PATCHES:
        m = variant(name)
        B.launch_gluon_bwd = m.launch_gluon_bwd
        try:
            rows.append((label, name, bench(ssa), c_fb))
        except Exception as e:  # noqa: BLE001
            print(name, type(e).__name__, str(e)[:400])
        B.launch_gluon_bwd = H.launch_gluon_bwd
    rows.append((label, "package SSA (last)", bench(ssa), c_fb))
    for r in rows[-9:]:
        print(r, flush=True)
    del q, k, v, go
    torch.cuda.empty_cache()

print("\n| shape | variant | fwd+bwd ms | x cuDNN |")
print("|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[2] / r[3]:.3f} |")
