"""Probe (issue 28, selected branch): the query-major forward through tensor descriptors
(TMA, branch-free, pipelined) against the pointer kernel, warps x stages; then the KV-major
backward's block_q x warps x stages. Hq64/Hkv4 (GQA16), B1, bf16, real selections."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as S, selected_attn as A
from nemo_ssa.ops.nsa.naive import compress_kv
from nemo_ssa.ops.nsa._common import ssa_scalars
part = sys.argv[1] if len(sys.argv) > 1 else "AB"
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")

def setup(d, n, hq=64, hkv=4, transform="softmax"):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = r(1, hq, n, d), r(1, hkv, n, d), r(1, hkv, n, d)
    ssa = dict(n=torch.tensor([1.5], device="cuda"), b=torch.tensor([0.8], device="cuda")) if transform == "ssa" else {}
    with torch.no_grad():
        kc = compress_kv(k, cfg)
        _, lse = R.compressed_attention(q, kc, kc, 32, 16, transform=transform, **ssa)
        idx = S.select_blocks_triton(q, kc, lse, cfg, transform=transform, **ssa)
    return q, k, v, idx, ssa

def fwd(q, k, v, idx, transform, ssa):
    tid, n_t, b_t = ssa_scalars(transform, ssa.get("n"), ssa.get("b"), q.device)
    return A._sel_fwd_qmajor(q, k, v, idx, n_t, b_t, tid, 1 / math.sqrt(q.shape[-1]), 64)

if "A" in part:
    print("### A: query-major forward, GQA16 (ms; max |do|, |dlse| against the pointer kernel)")
    print("| transform | D | N | variant | ms | x pointer | max dO | max dLSE |\n|---|---|---|---|---|---|---|---|")
    for tr, d, n in (("softmax", 64, 65536), ("softmax", 128, 65536), ("softmax", 64, 16384), ("softmax", 128, 16384), ("ssa", 64, 65536)):
        q, k, v, idx, ssa = setup(d, n, transform=tr)
        A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(qmajor_tma=0)
        o0, l0 = fwd(q, k, v, idx, tr, ssa)
        t0 = do_bench(lambda: fwd(q, k, v, idx, tr, ssa), warmup=10, rep=60)
        print(f"| {tr} | {d} | {n} | pointers (default) | {t0:.3f} | 1.00 | 0 | 0 |", flush=True)
        variants = [(0, w, 3) for w in (2, 4)] + [(1, w, st) for w in (1, 2, 4) for st in (2, 3, 4)]
        for tma, w, st in variants:
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(qmajor_tma=tma, qmajor_warps=w, qmajor_stages=st)
            try:
                o1, l1 = fwd(q, k, v, idx, tr, ssa)
                torch.cuda.synchronize()
                do_ = (o1.float() - o0.float()).abs().max().item()
                fin = torch.isfinite(l0)
                dl = (l1[fin] - l0[fin]).abs().max().item() if fin.any() else 0.0
                same_inf = torch.equal(torch.isinf(l0), torch.isinf(l1))
                t1 = do_bench(lambda: fwd(q, k, v, idx, tr, ssa), warmup=10, rep=60)
                print(f"| {tr} | {d} | {n} | {'tma' if tma else 'ptr'} w{w} st{st} | {t1:.3f} | {t0 / t1:.2f} | {do_:.4f} | {dl:.2e}{'' if same_inf else ' INF-MISMATCH'} |", flush=True)
            except Exception as e:
                print(f"| {tr} | {d} | {n} | {'tma' if tma else 'ptr'} w{w} st{st} | FAIL {type(e).__name__}: {str(e)[:80]} | | | |", flush=True)
        del q, k, v, idx
    A.TILE_OVERRIDE.clear()

if "B" in part:
    print("### B: KV-major backward (ms), GQA16 N=64K")
    print("| transform | D | block_q | warps | stages | ms |\n|---|---|---|---|---|---|")
    for tr, d, variants in (("softmax", 64, [(64, 4, 3), (64, 4, 1), (64, 4, 2), (64, 8, 2), (128, 8, 2), (32, 4, 2)]),
                            ("softmax", 128, [(32, 4, 3), (32, 8, 2), (32, 8, 3), (64, 8, 2), (32, 4, 1)]),
                            ("ssa", 64, [(64, 4, 3), (32, 4, 2), (32, 8, 3), (32, 4, 3), (64, 8, 2)])):
        q, k, v, idx, ssa = setup(d, 65536, transform=tr)
        tid, n_t, b_t = ssa_scalars(tr, ssa.get("n"), ssa.get("b"), q.device)
        o, lse = fwd(q, k, v, idx, tr, ssa)
        do = torch.randn_like(o)
        ns = 65536 // 64
        for bq, w, st in variants:
            wl = A.build_worklist(idx, ns, bq)
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(num_warps=w, num_stages=st)
            f = lambda: A._sel_bwd(q, k, v, o, lse, do, wl, n_t, b_t, tid, 1 / math.sqrt(d), 64, ns)
            try:
                f(); torch.cuda.synchronize()
                t = do_bench(f, warmup=10, rep=60)
                print(f"| {tr} | {d} | {bq} | {w} | {st} | {t:.3f} |", flush=True)
            except Exception as e:
                print(f"| {tr} | {d} | {bq} | {w} | {st} | FAIL {type(e).__name__} |", flush=True)
        del q, k, v, idx, o, lse, do
    A.TILE_OVERRIDE.clear()

if "C" in part:
    print("### C: KV-major selected attention, GQA 3 (Hq24/Hkv8), SSA, block_q 64 vs 32 (ms)")
    print("| D | N | block_q | fwd | fwd+bwd |\n|---|---|---|---|---|")
    for d, n in ((32, 32768), (64, 32768)):
        q, k, v, idx, ssa = setup(d, n, hq=24, hkv=8, transform="ssa")
        q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
        do = torch.randn_like(q)
        for bq in (64, 32):
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(block_q=bq)
            def f():
                with torch.no_grad():
                    A.selected_attention(q, k, v, idx, 64, transform="ssa", **ssa)
            def fb():
                o = A.selected_attention(q, k, v, idx, 64, transform="ssa", **ssa)
                torch.autograd.grad(o, (q, k, v), do)
            tf = do_bench(f, warmup=10, rep=60); tb = do_bench(fb, warmup=10, rep=60)
            print(f"| {d} | {n} | {bq} | {tf:.3f} | {tb:.3f} |", flush=True)
    A.TILE_OVERRIDE.clear()
