"""Probe (issue 28): the selection with the banded importance order and the in-kernel sorted
top-n, against the previous select.py (scratch/select_old.py = git show 577d8b9:nemo_ssa/ops/nsa/select.py),
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
print("| D | N | Hq/Hkv | variant | ms | x previous | identical selection |\n|---|---|---|---|---|---|---|")
variants = [("tiles (banded off), sorted top-n", dict(banded=False)),
            ("banded bc64 w4", dict(banded=True, importance=(64, 64, 128, 4))),
            ("banded bc64 w8", dict(banded=True, importance=(64, 64, 128, 8))),
            ("banded bm128 bc64 w8", dict(banded=True, importance=(128, 64, 128, 8))),
            ("banded bc128 w8", dict(banded=True, importance=(64, 128, 128, 8)))]
for d, n, hq, hkv in ((64, 65536, 64, 4), (64, 65536, 24, 8), (128, 65536, 64, 4), (64, 16384, 64, 4), (128, 65536, 24, 8)):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    nk = (n - 32) // 16 + 1
    q, kc = r(1, hq, n, d), r(1, hkv, nk, d)
    _, lse = R.compressed_attention(q, kc, kc, 32, 16)
    a = OLD.select_blocks_triton(q, kc, lse, cfg)
    ta = do_bench(lambda: OLD.select_blocks_triton(q, kc, lse, cfg), warmup=10, rep=60)
    print(f"| {d} | {n} | {hq}/{hkv} | previous | {ta:.3f} | 1.00 | - |", flush=True)
    for name, ov in variants:
        NEW.TILE_OVERRIDE.clear(); NEW.TILE_OVERRIDE.update(ov)
        try:
            b = NEW.select_blocks_triton(q, kc, lse, cfg)
            tb = do_bench(lambda: NEW.select_blocks_triton(q, kc, lse, cfg), warmup=10, rep=60)
            print(f"| {d} | {n} | {hq}/{hkv} | {name} | {tb:.3f} | {ta / tb:.2f} | {torch.equal(a, b)} |", flush=True)
        except Exception as e:
            print(f"| {d} | {n} | {hq}/{hkv} | {name} | FAIL {type(e).__name__}: {str(e)[:60]} | | |", flush=True)
    NEW.TILE_OVERRIDE.clear()
