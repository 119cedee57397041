"""Probe (issue 28, NSA selected backward), call 5: the query-major dq on a second CUDA stream
(beside the inverted index's sort and the KV-major dK/dV kernel) against one stream. A: the
backward alone at N=64K GQA16 (index build included), results compared bitwise; B: bench_nsa's
layer and selected rows, alternated."""
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

if "A" in part:
    rows = []
    for tr, d in (("softmax", 64), ("softmax", 128), ("ssa", 64), ("ssa", 128)):
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v = r(1, 64, 65536, d), r(1, 4, 65536, d), r(1, 4, 65536, d)
        ssa = dict(n=torch.tensor([1.5], device="cuda"), b=torch.tensor([0.8], device="cuda")) if tr == "ssa" else {}
        with torch.no_grad():
            kc = compress_kv(k, cfg)
            _, lse = R.compressed_attention(q, kc, kc, 32, 16, transform=tr, **ssa)
            idx = S.select_blocks_triton(q, kc, lse, cfg, transform=tr, **ssa)
        tid, n_t, b_t = ssa_scalars(tr, ssa.get("n"), ssa.get("b"), q.device)
        sc = 1 / math.sqrt(d)
        o, lse = A._sel_fwd_qmajor(q, k, v, idx, n_t, b_t, tid, sc, 64)
        do = torch.randn_like(o)
        f = lambda: A._sel_bwd_split(q, k, v, o, lse, do, idx, n_t, b_t, tid, sc, 64, 1024)
        res = {}
        for name, st in (("one stream", False), ("dq on a side stream", True), ("one stream (again)", False),
                         ("dq on a side stream (again)", True)):
            A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(dq_stream=st)
            out = f(); torch.cuda.synchronize()
            res.setdefault(st, out)
            same = all(torch.equal(a, b) for a, b in zip(out[:1], res[False][:1]))
            rows.append((tr, d, name, do_bench(f, warmup=10, rep=100), "dq bitwise equal" if same else "dq DIFFERS"))
            print(rows[-1], flush=True)
        A.TILE_OVERRIDE.clear()
        del q, k, v, o, lse, do, idx
        torch.cuda.empty_cache()
    print("\n| transform | D | backward | ms | dq |\n|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_[0]} | {r_[1]} | {r_[2]} | {r_[3]:.3f} | {r_[4]} |")

if "B" in part:
    sys.argv = [sys.argv[0], "--compress", "mean", "--hq", "64", "--hkv", "4", "--rep-ms", "80", "--warmup-ms", "20"]
    import benchmarks.bench_nsa as BN
    args = BN.parse_args(sys.argv[1:])
    out = []
    for D in (64, 128):
        for N in (16384, 65536):
            for st in (0, 1, 0, 1):
                A.TILE_OVERRIDE.clear(); A.TILE_OVERRIDE.update(dq_stream=bool(st))
                for r_ in BN.run_case(args, D, N, {"sdpa_flash", "nsa_layer", "selected"}):
                    if r_["mode"] == "fwd+bwd":
                        out.append((D, N, "side stream" if st else "one stream", r_["what"], r_["ms"], r_["x_sdpa"]))
    A.TILE_OVERRIDE.clear()
    print("\n| D | N | dq | row | fwd+bwd ms | x SDPA flash |\n|---|---|---|---|---|---|")
    for o in out:
        print(f"| {o[0]} | {o[1]} | {o[2]} | {o[3]} | {o[4]:.2f} | {o[5]:.2f} |")
