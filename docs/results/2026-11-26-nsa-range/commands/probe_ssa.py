"""Probe: NSA range kernels with the SSA transform (nsa_ssa), D64 GQA16 N=64K and 16K, bf16:
main (HEAD) against score_bwd_parts with the dK/dV kernel's three stages or one masked loop
on the TMA path, and SSA backward tiles. Checks gradients (q, k, v, n, b) against HEAD's."""
import importlib.util, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = {"HEAD": load("scratch/ra_head.py", "ra_head"), "parts, 3 stages": load("scratch/ra_3loop.py", "ra_3"),
        "parts, 1 loop": load("scratch/ra_1loop.py", "ra_1")}
L, S, W = 32, 16, 512
def inputs(n, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    nk = (n - L) // S + 1
    return r(1, 64, n, d), r(1, 4, nk, d), r(1, 4, nk, d), r(1, 4, n, d), r(1, 4, n, d)
nn = torch.tensor([1.5], device="cuda"); bb = torch.tensor([0.8], device="cuda")
def run(m, branch, ins, bwd=True):
    q, kc, vc, k, v = ins
    xs = [t.detach().requires_grad_(bwd) for t in ((q, kc, vc) if branch == "compressed" else (q, k, v))]
    n_, b_ = nn.clone().requires_grad_(bwd), bb.clone().requires_grad_(bwd)
    if branch == "compressed":
        o = m.compressed_attention(*xs, L, S, transform="ssa", n=n_, b=b_)[0]
    else:
        o = m.window_attention(*xs, W, transform="ssa", n=n_, b=b_)
    if not bwd:
        return o, []
    o.backward(torch.full_like(o, 0.01))
    return o, [x.grad for x in xs] + [n_.grad, b_.grad]
print("| N | branch | variant | tiles bwd | fwd+bwd ms | max rel diff vs HEAD (q,k,v) | dn, db vs HEAD |\n|---|---|---|---|---|---|---|")
for n in (65536, 16384):
    ins = inputs(n, 64)
    for branch in ("compressed", "window"):
        o0, g0 = run(mods["HEAD"], branch, ins)
        for name, m in mods.items():
            for tiles in ([None] if name == "HEAD" else [None, (32, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 3)]):
                if tiles is None:
                    m.TILE_OVERRIDE.pop("bwd", None)
                else:
                    m.TILE_OVERRIDE["bwd"] = tiles
                try:
                    o1, g1 = run(m, branch, ins)
                    err = max(((a.float() - b.float()).abs().max() / a.float().abs().max()).item() for a, b in zip(g0[:3], g1[:3]))
                    sc = ", ".join(f"{a.item():.4g}/{b.item():.4g}" for a, b in zip(g0[3:], g1[3:]))
                    t = do_bench(lambda: run(m, branch, ins), warmup=10, rep=50)
                except Exception as e:
                    t, err, sc = float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:80]}"
                print(f"| {n} | {branch} | {name} | {tiles or 'default'} | {t:.3f} | {err:.1e} | {sc} |", flush=True)
                m.TILE_OVERRIDE.pop("bwd", None)
    del ins; torch.cuda.empty_cache()
