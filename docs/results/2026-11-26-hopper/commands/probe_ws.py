"""Probe (issue 28, item 2): does Triton 3.6's Hopper warp specialisation pay for an
attention forward? A minimal non-causal softmax forward (one loop, TMA descriptors),
pointer vs TMA vs TMA + ``warp_specialize=True``, against SDPA cuDNN / flash in the same
process. Triton 3.6's Hopper warp-specialisation pass compiles only kernels with a single
loop (a second loop, before or after, fails the pass), so the real kernels (unmasked +
masked stage) cannot use it as they are; this says whether restructuring them would pay.

    python docs/results/2026-11-26-hopper/commands/probe_ws.py
"""
import math
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _probe(Q, K, V, O, s_z, s_h, s_s, H, N, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           BD: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    zh = tl.program_id(1)
    z = zh // H
    h = zh % H
    offs_m = pid * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    base = z.to(tl.int64) * s_z + h.to(tl.int64) * s_h
    if MODE == 0:
        q = tl.load(Q + base + offs_m[:, None] * s_s + offs_d[None, :])
    else:
        q = Q.load([z, h, pid * BM, 0]).reshape(BM, BD)
    acc = tl.zeros([BM, BD], tl.float32)
    m_i = tl.full([BM], -float("inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        if MODE == 0:
            kT = tl.load(K + base + (start + offs_n)[None, :] * s_s + offs_d[:, None])
            v = tl.load(V + base + (start + offs_n)[:, None] * s_s + offs_d[None, :])
        else:
            kT = tl.trans(K.load([z, h, start, 0]).reshape(BN, BD))
            v = V.load([z, h, start, 0]).reshape(BN, BD)
        qk = tl.dot(q, kT)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    o = (acc / l_i[:, None]).to(tl.bfloat16)
    if MODE == 0:
        tl.store(O + base + offs_m[:, None] * s_s + offs_d[None, :], o)
    else:
        O.store([z, h, pid * BM, 0], o.reshape(1, 1, BM, BD))


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for (B, H, N, D) in [(2, 8, 8192, 128), (2, 16, 8192, 64)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        qs = (q.float() * (math.log2(math.e) / math.sqrt(D))).to(torch.bfloat16)
        flops = 4 * B * H * N * N * D
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel([be]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                ref = f()
                ms = do_bench(f, warmup=10, rep=100, return_mode="median")
            rows.append((f"D{D}", name, "-", ms, flops / ms / 1e9))
        base_ms = rows[-2][3]
        for mode, ws, (bm, bn, w, s) in [(0, False, (64, 64, 4, 3)), (0, False, (128, 64, 8, 3)),
                                         (1, False, (64, 64, 4, 3)), (1, False, (128, 64, 8, 3)),
                                         (1, False, (128, 128, 8, 2)), (1, True, (64, 64, 4, 3)),
                                         (1, True, (64, 64, 4, 2)), (1, True, (64, 128, 4, 2)),
                                         (1, True, (128, 64, 4, 2)), (1, True, (64, 64, 8, 3))]:
            o = torch.full_like(q, float("nan"))
            a = [qs, k, v, o] if mode == 0 else [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bb, D])
                                                 for t, bb in ((qs, bm), (k, bn), (v, bn), (o, bm))]
            fn = lambda: _probe[(N // bm, B * H)](*a, q.stride(0), q.stride(1), q.stride(2), H, N, MODE=mode, BM=bm,  # noqa: E731
                                                  BN=bn, BD=D, WS=ws, num_warps=w, num_stages=s)
            tag = f"{'tma' if mode else 'ptr'}{'+ws' if ws else ''} {bm}x{bn}/{w}w/{s}s"
            try:
                fn()
                torch.cuda.synchronize()
                err = (o.float() - ref.float()).abs().max().item()
                ms = do_bench(fn, warmup=10, rep=100, return_mode="median")
                rows.append((f"D{D}", tag, f"{err:.3g}", ms, flops / ms / 1e9))
            except Exception as e:  # noqa: BLE001
                rows.append((f"D{D}", tag, "FAIL " + str(e).strip().splitlines()[-1][:60] if str(e).strip() else repr(e)[:60], float("nan"), float("nan")))
        rows.append(("", "", "", float("nan"), float("nan")))
    print("| shape | kernel (non-causal fwd) | max err vs cuDNN | ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r[0]:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.0f} |")


if __name__ == "__main__":
    main()
