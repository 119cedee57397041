"""Probe 2 (issue 28, NSA): range kernels' Hopper path (TMA) against pointers, tile sweeps
per branch at D64/D128 GQA16 N=64K, GQA 3 against the previous kernels; selected backward
block_q/warps at GQA16."""
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from nemo_ssa.ops.nsa import range_attn as NEW  # noqa: E402

spec = importlib.util.spec_from_file_location("range_attn_old", "scratch/range_attn_old.py")
OLD = importlib.util.module_from_spec(spec)
spec.loader.exec_module(OLD)
L, S, W = 32, 16, 512
REP = int(os.environ.get("REP", "50"))
PARTS = os.environ.get("PARTS", "A,B,C,D").split(",")
T0 = time.time()


def inputs(n, d, hq=64, hkv=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    nk = (n - L) // S + 1
    return r(1, hq, n, d), r(1, hkv, nk, d), r(1, hkv, nk, d), r(1, hkv, n, d), r(1, hkv, n, d)


def run(mod, branch, q, kc, vc, k, v, bwd):
    xs = [t.detach().requires_grad_(bwd) for t in ((q, kc, vc) if branch == "compressed" else (q, k, v))]
    o = mod.compressed_attention(*xs, L, S)[0] if branch == "compressed" else mod.window_attention(*xs, W)
    if bwd:
        o.backward(torch.full_like(o, 0.01))
        return o, [x.grad for x in xs]
    return o, None


def bench(mod, branch, ins, bwd):
    return do_bench(lambda: run(mod, branch, *ins, bwd), warmup=15, rep=REP)


def table(title, hdr, rows):
    print(f"\n### {title}\n| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in rows:
        print("| " + " | ".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in r) + " |")


FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4)]
BWD = [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 4, 3)]


def sweep(d, fwd_c, bwd_c, tmas=(1,)):
    ins = inputs(65536, d)
    rows = []
    for tma in tmas:
        NEW.TILE_OVERRIDE["tma"] = tma
        for kind, cands in (("fwd", fwd_c), ("bwd", bwd_c)):
            for c in cands:
                NEW.TILE_OVERRIDE[kind] = c
                for branch in ("compressed", "window"):
                    try:
                        t = bench(NEW, branch, ins, kind == "bwd")
                    except Exception as e:  # noqa: BLE001
                        t = float("nan")
                        print("failed", d, tma, kind, c, branch, type(e).__name__, str(e)[:300], flush=True)
                    rows.append((d, tma, kind, str(c), branch, t))
                    print(rows[-1], round(time.time() - T0), flush=True)
            NEW.TILE_OVERRIDE.pop(kind)
    NEW.TILE_OVERRIDE.pop("tma")
    table(f"tiles D{d} GQA16 N=64K (fwd: fwd ms; bwd: fwd+bwd ms with the default fwd)",
          ["D", "tma", "kind", "tiles", "branch", "ms"], rows)
    del ins
    torch.cuda.empty_cache()


if "A" in PARTS:  # default tiles: pointers vs TMA vs the previous kernels, with correctness
    rows = []
    for d, n, hq, hkv in ((64, 65536, 64, 4), (64, 16384, 64, 4), (128, 65536, 64, 4), (64, 32768, 24, 8)):
        ins = inputs(n, d, hq, hkv)
        for branch in ("compressed", "window"):
            o0, g0 = run(OLD, branch, *ins, True)
            res = {}
            for tma in (0, 1):
                NEW.TILE_OVERRIDE["tma"] = tma
                o1, g1 = run(NEW, branch, *ins, True)
                err = max([(o0.float() - o1.float()).abs().max().item()] +
                          [(a.float() - b.float()).abs().max().item() / (a.float().abs().max().item() + 1e-9)
                           for a, b in zip(g0, g1)])
                res[tma] = (bench(NEW, branch, ins, False), bench(NEW, branch, ins, True), err,
                            any(torch.isnan(t).any().item() for t in [o1] + g1))
            NEW.TILE_OVERRIDE.pop("tma")
            old = (bench(OLD, branch, ins, False), bench(OLD, branch, ins, True))
            rows.append((d, n, f"{hq}/{hkv}", branch, old[0], res[0][0], res[1][0], old[1], res[0][1], res[1][1],
                         f"{max(res[0][2], res[1][2]):.1e}", res[0][3] or res[1][3]))
            print(rows[-1], round(time.time() - T0), flush=True)
        del ins
        torch.cuda.empty_cache()
    table("default tiles: previous kernels vs split (pointers) vs split + TMA",
          ["D", "N", "Hq/Hkv", "branch", "prev fwd", "ptr fwd", "tma fwd", "prev f+b", "ptr f+b", "tma f+b",
           "max rel diff", "nan"], rows)

if "B" in PARTS:
    sweep(64, FWD, BWD)
if "C" in PARTS:
    sweep(128, [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3)],
          [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2)])
if "D" in PARTS:  # selected attention backward at GQA16: block_q x warps
    from nemo_ssa.ops.nsa import NSAConfig, compress_kv  # noqa: F401
    from nemo_ssa.ops.nsa import selected_attn as SA
    from nemo_ssa.ops.nsa.select import select_blocks_triton
    cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")
    n, d = 65536, 64
    q, kc, vc, k, v = inputs(n, d)
    _, lse = NEW.compressed_attention(q, kc, vc, L, S)
    idx = select_blocks_triton(q, kc, lse, cfg)
    rows = []
    for bq in (32, 64, 128):
        for w in (4, 8):
            SA.TILE_OVERRIDE.update(block_q=bq, num_warps=w)

            def f():
                xs = [t.detach().requires_grad_() for t in (q, k, v)]
                o = SA.selected_attention(*xs, idx, 64)
                o.backward(torch.full_like(o, 0.01))
            try:
                t = do_bench(f, warmup=10, rep=REP)
            except Exception as e:  # noqa: BLE001
                t = float("nan")
                print("failed", bq, w, type(e).__name__, str(e)[:300])
            rows.append((bq, w, t))
            print(rows[-1], round(time.time() - T0), flush=True)
    table("selected fwd+bwd D64 GQA16 N=64K (query-major fwd; KV-major bwd block_q x warps)",
          ["block_q", "warps", "ms"], rows)
