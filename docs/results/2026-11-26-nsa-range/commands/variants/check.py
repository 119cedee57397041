"""One variant of the range kernels, one process: D128 (and D64) compressed + window fwd+bwd
at N=64K GQA16 against the previous kernels; prints ok / the error."""
import importlib.util, os, sys
sys.path.insert(0, os.getcwd())
import torch
name, d, n, tma, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def load(path, mod):
    spec = importlib.util.spec_from_file_location(mod, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
NEW = load(f"scratch/var/{name}.py", "v_" + name)
OLD = load("scratch/range_attn_old.py", "old")
NEW.TILE_OVERRIDE["tma"] = tma
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
nk = (n - 32) // 16 + 1
q, kc, vc = r(1, 64, n, d), r(1, 4, nk, d), r(1, 4, nk, d)
def run(mod, kern):
    xs = [t.detach().requires_grad_() for t in (q, kc, vc)]
    o = mod.compressed_attention(*xs, 32, 16)[0]
    if mode == "fwd":
        torch.cuda.synchronize(); return o, []
    if kern == "dq":  # only dq needed: k, v without grad
        xs[1].requires_grad_(False)
    o.backward(torch.full_like(o, 0.01)); torch.cuda.synchronize()
    return o, [x.grad for x in xs if x.grad is not None]
try:
    o0, g0 = run(OLD, mode)
    o1, g1 = run(NEW, mode)
    err = max([(o0.float() - o1.float()).abs().max().item()] + [((a.float() - b.float()).abs().max() / a.float().abs().max()).item() for a, b in zip(g0, g1)])
    print(f"RESULT {name} D{d} N{n} tma{tma} {mode}: ok err {err:.1e}")
except Exception as e:
    print(f"RESULT {name} D{d} N{n} tma{tma} {mode}: FAIL {type(e).__name__} {str(e)[:120]}")
