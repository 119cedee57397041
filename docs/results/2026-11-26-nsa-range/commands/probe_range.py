"""Probe (issue 28, NSA): range kernels (compressed + window branches) with the masked /
unmasked tile split against the previous all-masked kernels, same process; then tiles."""
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
REP = int(os.environ.get("REP", "60"))
rows = []


def inputs(n, d, hq=64, hkv=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    nk = (n - L) // S + 1
    kc = torch.randn(1, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(1, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kc, vc, k, v


def run(mod, branch, q, kc, vc, k, v, bwd):
    xs = [t.detach().requires_grad_(bwd) for t in ((q, kc, vc) if branch == "compressed" else (q, k, v))]
    if branch == "compressed":
        o = mod.compressed_attention(xs[0], xs[1], xs[2], L, S)[0]
    else:
        o = mod.window_attention(xs[0], xs[1], xs[2], W)
    if not bwd:
        return o, None
    do = torch.ones_like(o) * 0.01
    o.backward(do)
    return o, [x.grad for x in xs]


def bench(mod, branch, ins, bwd):
    return do_bench(lambda: run(mod, branch, *ins, bwd), warmup=20, rep=REP)


for d, n in ((64, 16384), (64, 65536), (128, 65536)):
    ins = inputs(n, d)
    for branch in ("compressed", "window"):
        o1, g1 = run(OLD, branch, *ins, True)
        o2, g2 = run(NEW, branch, *ins, True)
        err = max([(o1.float() - o2.float()).abs().max().item()] +
                  [(a.float() - b.float()).abs().max().item() / (a.float().abs().max().item() + 1e-9)
                   for a, b in zip(g1, g2)])
        nan = any(torch.isnan(t).any().item() for t in [o2] + g2)
        for bwd in (False, True):
            t_old = bench(OLD, branch, ins, bwd)
            t_new = bench(NEW, branch, ins, bwd)
            rows.append((d, n, branch, "fwd+bwd" if bwd else "fwd", t_old, t_new, err, nan))
            print(rows[-1], flush=True)
    del ins
    torch.cuda.empty_cache()

print("\n| D | N | branch | mode | all-masked ms | split ms | old/new | max rel diff | nan |")
print("|---|---|---|---|---|---|---|---|---|")
for d, n, br, mode, a, b, e, nan in rows:
    print(f"| {d} | {n} | {br} | {mode} | {a:.3f} | {b:.3f} | {a / b:.2f} | {e:.1e} | {nan} |")

# tiles of the new kernels at 64K D64 GQA16 (fwd: both branches fwd; bwd: fwd+bwd)
if os.environ.get("TILES", "1") == "1":
    ins = inputs(65536, 64)
    res = []
    FWD = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2)]
    BWD = [(128, 64, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 8, 2), (128, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3)]
    t0 = time.time()
    for kind, cands in (("fwd", FWD), ("bwd", BWD)):
        for c in cands:
            NEW.TILE_OVERRIDE[kind] = c
            for branch in ("compressed", "window"):
                try:
                    t = bench(NEW, branch, ins, kind == "bwd")
                except Exception as e:  # noqa: BLE001
                    t = float("nan"); print(kind, c, branch, "failed", type(e).__name__, str(e)[:200])
                res.append((kind, c, branch, t))
                print(res[-1], flush=True)
        NEW.TILE_OVERRIDE.pop(kind)
        if time.time() - t0 > 200:
            break
    print("\n| kind | tiles | branch | ms |")
    print("|---|---|---|---|")
    for kind, c, br, t in res:
        print(f"| {kind} | {c} | {br} | {t:.3f} |")
