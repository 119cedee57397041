"""Probe (issue 28, NSA selected backward): dq query-major (one program per token and kv head,
no atomics) + the KV-major kernel without dq, against the KV-major kernel with dq atomics.
A: kernel level at N=64K GQA16 (correctness against the atomic path, tile sweeps);
B: bench_nsa's layer and selected rows, qmajor_dq off/on alternated, x SDPA flash."""
import os, sys, math, time
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as S, selected_attn as A
from nemo_ssa.ops.nsa.naive import compress_kv
from nemo_ssa.ops.nsa._common import ssa_scalars, row_delta
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


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bench(f):
    return do_bench(f, warmup=10, rep=60)


if "A" in part:
    print("### A: selected backward at N=64K, GQA16 (ms)")
    rows = []
    for tr, d in (("softmax", 64), ("softmax", 128), ("ssa", 64)):
        q, k, v, idx, ssa = setup(d, 65536, transform=tr)
        tid, n_t, b_t = ssa_scalars(tr, ssa.get("n"), ssa.get("b"), q.device)
        sc = 1 / math.sqrt(d)
        A.TILE_OVERRIDE.clear()
        o, lse = A._sel_fwd_qmajor(q, k, v, idx, n_t, b_t, tid, sc, 64)
        do = torch.randn_like(o)
        ns = 65536 // 64
        bq0 = A._block_q(d, tid, True)
        t = time.perf_counter()
        wl = A.build_worklist(idx, ns, bq0)
        t_wl = bench(lambda: A.build_worklist(idx, ns, bq0))
        base = A._sel_bwd(q, k, v, o, lse, do, wl, n_t, b_t, tid, sc, 64, ns)
        t_base = bench(lambda: A._sel_bwd(q, k, v, o, lse, do, wl, n_t, b_t, tid, sc, 64, ns))
        rows.append((tr, d, f"atomic dq, KV-major bq{bq0} (before)", t_base, "", ""))
        print(rows[-1], f"worklist {t_wl:.3f} ms", flush=True)
        new = A._sel_bwd(q, k, v, o, lse, do, wl, n_t, b_t, tid, sc, 64, ns, block_idx=idx)
        errs = " ".join(f"{nm} {rel(a, b):.1e}" for nm, a, b in zip(("dq", "dk", "dv", "dnb"), new, base))
        fin = all(torch.isfinite(x).all().item() for x in new)
        t_new = bench(lambda: A._sel_bwd(q, k, v, o, lse, do, wl, n_t, b_t, tid, sc, 64, ns, block_idx=idx))
        rows.append((tr, d, "qmajor dq + KV-major (defaults)", t_new, errs + ("" if fin else " NONFINITE"), ""))
        print(rows[-1], flush=True)
        delta = row_delta(o, do)
        for tma, w, st in ((1, 1, 2), (1, 1, 3), (1, 2, 2), (1, 4, 2), (0, 1, 2)):
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(qmajor_dq_tma=tma, qmajor_dq_warps=w, qmajor_dq_stages=st)
            try:
                dq = A._sel_bwd_dq_qmajor(q, k, v, do, lse, delta, idx, n_t, b_t, tid, sc, 64)
                e = rel(dq, base[0])
                tt = bench(lambda: A._sel_bwd_dq_qmajor(q, k, v, do, lse, delta, idx, n_t, b_t, tid, sc, 64))
                rows.append((tr, d, f"dq only: {'tma' if tma else 'ptr'} w{w} st{st}", tt, f"dq {e:.1e}", ""))
            except Exception as ex:
                rows.append((tr, d, f"dq only: {'tma' if tma else 'ptr'} w{w} st{st}", float("nan"), f"FAIL {type(ex).__name__}: {str(ex)[:60]}", ""))
            print(rows[-1], flush=True)
        for bq, w, st in ((64, 4, 3), (32, 4, 3), (64, 4, 2), (64, 8, 2), (128, 8, 2)):
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(num_warps=w, num_stages=st)
            try:
                wlb = A.build_worklist(idx, ns, bq)
                out = A._sel_bwd(q, k, v, o, lse, do, wlb, n_t, b_t, tid, sc, 64, ns, block_idx=idx)
                e = " ".join(f"{nm} {rel(a, b):.1e}" for nm, a, b in zip(("dk", "dv", "dnb"), out[1:], base[1:]))
                tt = bench(lambda: A._sel_bwd(q, k, v, o, lse, do, wlb, n_t, b_t, tid, sc, 64, ns, block_idx=idx))
                rows.append((tr, d, f"qmajor dq (default) + KV-major bq{bq} w{w} st{st}", tt, e, ""))
            except Exception as ex:
                rows.append((tr, d, f"qmajor dq + KV-major bq{bq} w{w} st{st}", float("nan"), f"FAIL {type(ex).__name__}: {str(ex)[:60]}", ""))
            print(rows[-1], flush=True)
        A.TILE_OVERRIDE.clear()
        del q, k, v, idx, o, lse, do, base, new, wl
        torch.cuda.empty_cache()
    print("\n| transform | D | variant | ms | rel. error against the atomic path |\n|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_[0]} | {r_[1]} | {r_[2]} | {r_[3]:.3f} | {r_[4]} |")

if "B" in part:
    sys.argv = [sys.argv[0], "--compress", "mean", "--hq", "64", "--hkv", "4", "--rep-ms", "60", "--warmup-ms", "20"]
    import benchmarks.bench_nsa as BN
    args = BN.parse_args(sys.argv[1:])
    out = []
    for D in (64, 128):
        for N in (16384, 65536):
            for qd in ((0, 1, 0, 1) if N > 16384 else (0, 1)):
                A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(qmajor_dq=bool(qd))
                for r_ in BN.run_case(args, D, N, {"sdpa_flash", "nsa_layer", "selected"}):
                    if r_["what"] in ("nsa_layer", "selected", "sdpa_flash"):
                        out.append((D, N, "qmajor dq" if qd else "atomic dq", r_["what"], r_["mode"], r_["ms"], r_["x_sdpa"]))
    A.TILE_OVERRIDE.clear()
    print("\n| D | N | dq | row | mode | ms | x SDPA flash |\n|---|---|---|---|---|---|---|")
    for o in out:
        print(f"| {o[0]} | {o[1]} | {o[2]} | {o[3]} | {o[4]} | {o[5]:.2f} | {o[6]:.2f} |")
