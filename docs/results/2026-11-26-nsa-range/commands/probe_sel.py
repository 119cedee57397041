"""Probe: the selected backward's dq atomics at D64 GQA16 N=64K -- the current kernel against
variants that drop the dq add or store it without atomics (wrong results; timing only)."""
import importlib.util, os, sys
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, selected_attn as SA
from nemo_ssa.ops.nsa.select import select_blocks_triton
def load(path, mod):
    spec = importlib.util.spec_from_file_location(mod, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = {"current": SA, "no dq add": load("scratch/var/sel_nodq.py", "nodq"), "dq plain store": load("scratch/var/sel_storedq.py", "stdq")}
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")
n, d = 65536, 64
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
nk = (n - 32) // 16 + 1
q, kc, k, v = r(1, 64, n, d), r(1, 4, nk, d), r(1, 4, n, d), r(1, 4, n, d)
_, lse = R.compressed_attention(q, kc, kc, 32, 16)
idx = select_blocks_triton(q, kc, lse, cfg)
print("| selected | fwd ms | fwd+bwd ms |\n|---|---|---|")
for name, m in mods.items():
    def f(bwd):
        xs = [t.detach().requires_grad_(bwd) for t in (q, k, v)]
        o = m.selected_attention(*xs, idx, 64)
        if bwd:
            o.backward(torch.full_like(o, 0.01))
    print(f"| {name} | {do_bench(lambda: f(False), warmup=10, rep=60):.3f} | {do_bench(lambda: f(True), warmup=10, rep=60):.3f} |", flush=True)
