"""Probe: the selection's importance pass with unmasked whole-visible chunks against the
previous kernel (scratch/select_old.py = git show a4a2f53:nemo_ssa/ops/nsa/select.py),
same process; selections must be identical."""
import importlib.util, os, sys
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from nemo_ssa.ops.nsa import NSAConfig
from nemo_ssa.ops.nsa import range_attn as R, select as NEW
spec = importlib.util.spec_from_file_location("select_old", "scratch/select_old.py")
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD)
cfg = NSAConfig(block_len=32, stride=16, select_block=64, top_n=16, window=512, compress="mean")
print("| D | N | Hq/Hkv | previous ms | unmasked chunks ms | ratio | identical selection |\n|---|---|---|---|---|---|---|")
for d, n, hq, hkv in ((64, 65536, 64, 4), (64, 16384, 64, 4), (128, 65536, 64, 4), (64, 65536, 24, 8)):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    nk = (n - 32) // 16 + 1
    q, kc = r(1, hq, n, d), r(1, hkv, nk, d)
    _, lse = R.compressed_attention(q, kc, kc, 32, 16)
    a = OLD.select_blocks_triton(q, kc, lse, cfg)
    b = NEW.select_blocks_triton(q, kc, lse, cfg)
    ta = do_bench(lambda: OLD.select_blocks_triton(q, kc, lse, cfg), warmup=10, rep=60)
    tb = do_bench(lambda: NEW.select_blocks_triton(q, kc, lse, cfg), warmup=10, rep=60)
    print(f"| {d} | {n} | {hq}/{hkv} | {ta:.3f} | {tb:.3f} | {ta / tb:.2f} | {torch.equal(a, b)} |", flush=True)
