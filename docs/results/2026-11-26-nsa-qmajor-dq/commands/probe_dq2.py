"""Probe (issue 28, NSA selected backward), call 2. C: every backward variant (atomic dq;
query-major dq + KV-major dK/dV at 32/64/128 rows) against an fp32 reference from the same
bf16 inputs, beside eager bf16's error (the tolerance base: 2x), GQA16 N=3001, D64/D128,
softmax/SSA. A: tile sweeps at N=64K (D128 softmax, SSA D64/D128). B: bench_nsa's layer
rows with the new defaults, atomic dq alternated."""
import os, sys, math
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as S, selected_attn as A
from nemo_ssa.ops.nsa.naive import compress_kv, masked_attention, selection_keep_mask, select_blocks
from nemo_ssa.ops.nsa._common import ssa_scalars, row_delta
part = sys.argv[1] if len(sys.argv) > 1 else "CAB"
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")


def setup(d, n, hq=64, hkv=4, transform="softmax", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = r(1, hq, n, d), r(1, hkv, n, d), r(1, hkv, n, d)
    ssa = dict(n=torch.tensor([1.5], device="cuda"), b=torch.tensor([0.8], device="cuda")) if transform == "ssa" else {}
    with torch.no_grad():
        kc = compress_kv(k, cfg)
        _, lse = R.compressed_attention(q, kc, kc, 32, 16, transform=transform, **ssa)
        idx = S.select_blocks_triton(q, kc, lse, cfg, transform=transform, **ssa)
    return q, k, v, idx, ssa


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def bench(f):
    return do_bench(f, warmup=10, rep=60)


if "C" in part:
    print("### C: against fp32 (N=3001, Hq32/Hkv2)")
    rows = []
    for tr, d in (("softmax", 64), ("softmax", 128), ("ssa", 64), ("ssa", 128)):
        n = 3001
        q, k, v, idx, ssa = setup(d, n, hq=32, hkv=2, transform=tr, seed=d)
        idx[0, 1, 1500] = -1
        do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
        causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
        keep = (selection_keep_mask(idx, n, cfg) & causal).repeat_interleave(16, 1)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        sk = dict(transform=tr, **ssa)

        def grads(fn, dtype):
            ls = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            o = fn(*ls)
            return [o] + list(torch.autograd.grad(o, ls, do.to(dtype)))
        ref = grads(lambda a, b, c: masked_attention(a, b, c, keep, upcast=True, **sk)[0], torch.float32)
        eager = grads(lambda a, b, c: masked_attention(a, b, c, keep, upcast=False, **sk)[0], torch.bfloat16)
        rows.append((tr, d, "eager bf16", *[rel(x, y) for x, y in zip(eager, ref)]))
        variants = [("atomic dq (before)", dict(qmajor_dq=False))] + [
            (f"qmajor dq + dkv bq{bq}", dict(qmajor_dq=True, block_q=bq)) for bq in (32, 64, 128)] + [
            ("qmajor dq + dkv (defaults)", dict(qmajor_dq=True))]
        for name, ov in variants:
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(ov)
            out = grads(lambda a, b, c: A.selected_attention(a, b, c, idx, 64, **sk), torch.bfloat16)
            fin = all(torch.isfinite(x).all().item() for x in out)
            rows.append((tr, d, name + ("" if fin else " NONFINITE"), *[rel(x, y) for x, y in zip(out, ref)]))
            print(rows[-1], flush=True)
        A.TILE_OVERRIDE.clear()
        del q, k, v, keep, ref, eager, out
        torch.cuda.empty_cache()
    print("\n| transform | D | variant | o | dq | dk | dv |\n|---|---|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_[0]} | {r_[1]} | {r_[2]} | " + " | ".join(f"{x:.2e}" for x in r_[3:]) + " |")

if "A" in part:
    print("### A: N=64K GQA16 tile sweeps (ms)")
    rows = []
    plan = (("softmax", 128, [(1, 2, 2), (1, 2, 3), (1, 4, 3), (1, 2, 1)],
             [(128, 8, 2), (128, 8, 3), (64, 4, 2), (128, 4, 2), (64, 8, 3), (128, 8, 1)]),
            ("ssa", 64, [(1, 1, 3), (1, 1, 2)], [(32, 4, 3), (32, 4, 2), (32, 2, 3), (64, 4, 1), (16, 4, 3)]),
            ("ssa", 128, [(1, 2, 2), (1, 1, 2), (1, 4, 2)], [(32, 4, 3), (32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 8, 2)]))
    for tr, d, dqv, dkvv in plan:
        q, k, v, idx, ssa = setup(d, 65536, transform=tr)
        tid, n_t, b_t = ssa_scalars(tr, ssa.get("n"), ssa.get("b"), q.device)
        sc = 1 / math.sqrt(d)
        A.TILE_OVERRIDE.clear()
        o, lse = A._sel_fwd_qmajor(q, k, v, idx, n_t, b_t, tid, sc, 64)
        do = torch.randn_like(o)
        ns = 65536 // 64
        bq0 = A._block_q(d, tid, True)
        wl = A.build_worklist(idx, ns, bq0)
        t_base = bench(lambda: A._sel_bwd(q, k, v, o, lse, do, wl, n_t, b_t, tid, sc, 64, ns))
        rows.append((tr, d, f"atomic dq, bq{bq0} (before)", t_base))
        print(rows[-1], flush=True)
        delta = row_delta(o, do)
        for tma, w, st in dqv:
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(qmajor_dq_tma=tma, qmajor_dq_warps=w, qmajor_dq_stages=st)
            try:
                tt = bench(lambda: A._sel_bwd_dq_qmajor(q, k, v, do, lse, delta, idx, n_t, b_t, tid, sc, 64))
            except Exception as ex:
                tt = float("nan"); print("FAIL", ex)
            rows.append((tr, d, f"dq only: w{w} st{st}", tt))
            print(rows[-1], flush=True)
        A.TILE_OVERRIDE.clear()
        t_dq = bench(lambda: A._sel_bwd_dq_qmajor(q, k, v, do, lse, delta, idx, n_t, b_t, tid, sc, 64))
        for bq, w, st in dkvv:
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(block_q=bq, num_warps=w, num_stages=st)
            try:
                wlb = A.build_worklist(idx, ns, bq)
                tt = bench(lambda: A._sel_bwd(q, k, v, o, lse, do, wlb, n_t, b_t, tid, sc, 64, ns, block_idx=idx))
            except Exception as ex:
                tt = float("nan"); print("FAIL", ex)
            rows.append((tr, d, f"default dq ({t_dq:.2f}) + dkv bq{bq} w{w} st{st}: total", tt))
            print(rows[-1], flush=True)
        A.TILE_OVERRIDE.clear()
        del q, k, v, idx, o, lse, do, wl
        torch.cuda.empty_cache()
    print("\n| transform | D | variant | ms |\n|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_[0]} | {r_[1]} | {r_[2]} | {r_[3]:.3f} |")

if "B" in part:
    sys.argv = [sys.argv[0], "--compress", "mean", "--hq", "64", "--hkv", "4", "--rep-ms", "60", "--warmup-ms", "20"]
    import benchmarks.bench_nsa as BN
    args = BN.parse_args(sys.argv[1:])
    out = []
    for D in (64, 128):
        for N in (16384, 65536):
            for qd in (0, 1, 0, 1):
                A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(qmajor_dq=bool(qd))
                for r_ in BN.run_case(args, D, N, {"sdpa_flash", "nsa_layer", "selected"}):
                    if r_["mode"] == "fwd+bwd" or r_["what"] == "nsa_layer":
                        out.append((D, N, "qmajor dq" if qd else "atomic dq", r_["what"], r_["mode"], r_["ms"], r_["x_sdpa"]))
    A.TILE_OVERRIDE.clear()
    print("\n| D | N | dq | row | mode | ms | x SDPA flash |\n|---|---|---|---|---|---|---|")
    for o in out:
        print(f"| {o[0]} | {o[1]} | {o[2]} | {o[3]} | {o[4]} | {o[5]:.2f} | {o[6]:.2f} |")
