"""Probe (issue 28, NSA forward): selected attention's query-major forward against the
KV-major one, and the selection's importance-kernel tiles, at D64 GQA 16 (Hq 64 / Hkv 4),
N = 16K and 64K, bf16, one process. Checks the query-major (o, lse) against KV-major's and
counts selection rows that change with the tiles (near-ties of fp32 sums).

    python docs/results/2026-11-26-hopper/commands/probe_nsa.py
"""
import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from nemo_ssa.ops.nsa import NSAConfig, compress_kv  # noqa: E402
from nemo_ssa.ops.nsa import select as S  # noqa: E402
from nemo_ssa.ops.nsa import selected_attn as SA  # noqa: E402
from nemo_ssa.ops.nsa.range_attn import compressed_attention  # noqa: E402


def _reference_selection(q, kc, cfg):
    """fp64 selection of kv head 0 (its 16 query heads) at the probe's N: the compressed
    probabilities, summed over the group, times the overlap matrix, then top-n."""
    from nemo_ssa.ops.nsa.naive import compressed_visibility, overlap_matrix, select_blocks

    n_tok, d = q.shape[2], q.shape[3]
    group = q.shape[1] // kc.shape[1]
    vis = compressed_visibility(n_tok, cfg, q.device)
    k64 = kc[0, 0].double()
    psum = torch.zeros(n_tok, k64.shape[0], dtype=torch.float64, device=q.device)
    for h in range(group):
        z = (q[0, h].double() @ k64.T) / d ** 0.5
        z = z.masked_fill(~vis, float("-inf"))
        p = torch.softmax(z, dim=-1)
        psum += torch.nan_to_num(p, nan=0.0)
    imp = psum @ overlap_matrix(n_tok, cfg, device=q.device, dtype=torch.float64)
    return select_blocks(imp[None, None], cfg)[0, 0].to(torch.int32)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for N in [int(x) for x in os.environ.get("PROBE_NS", "16384,65536").split(",")]:
        B, HQ, HKV, D = 1, int(os.environ.get("PROBE_HQ", 64)), int(os.environ.get("PROBE_HKV", 4)), 64
        cfg = NSAConfig(compress="mean")
        g = torch.Generator(device="cuda").manual_seed(N)
        q = torch.randn(B, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            kc = compress_kv(k, cfg, None)
            _, lse_c = compressed_attention(q, kc, kc, cfg.block_len, cfg.stride)
            idx = S.select_blocks_triton(q, kc, lse_c, cfg)
        # selected attention forward: KV-major vs query-major
        outs = {}
        for name, ov in [] if (os.environ.get("PROBE_HEADS_INNER") or os.environ.get("PROBE_OLD_NEW")) else [("kv-major", dict(qmajor=False)), ("q-major w4", dict(qmajor=True, qmajor_warps=4)),
                         ("q-major w2", dict(qmajor=True, qmajor_warps=2)), ("q-major w8", dict(qmajor=True, qmajor_warps=8)),
                         ("q-major w1", dict(qmajor=True, qmajor_warps=1))]:
            SA.TILE_OVERRIDE.clear()
            SA.TILE_OVERRIDE.update(ov)
            with torch.no_grad():
                f = lambda: SA.selected_attention(q, k, v, idx, cfg.select_block, return_lse=True)  # noqa: E731
                outs[name] = f()
                ms = do_bench(f, warmup=10, rep=60, return_mode="median")
            rows.append((N, "selected fwd", name, ms, ""))
        for name in ("q-major w4",) if "kv-major" in outs else ():
            o0, l0 = outs["kv-major"]
            o1, l1 = outs[name]
            fin = torch.isfinite(l0)
            err = (o1.float() - o0.float()).abs().max().item()
            lerr = (l1[fin] - l0[fin]).abs().max().item()
            same_inf = torch.equal(torch.isinf(l0), torch.isinf(l1))
            rows.append((N, "check q-major vs kv-major", name, float("nan"), f"max|do|={err:.3g} max|dlse|={lerr:.3g} inf rows same={same_inf}"))
        SA.TILE_OVERRIDE.clear()
        # selection: importance tiles (and top-n alone)
        base = None
        variants = [((64, 32, 16, 4), False), ((64, 32, 32, 4), False), ((64, 32, 64, 4), False),
                    ((64, 64, 64, 4), False), ((128, 32, 32, 8), False), ((128, 64, 64, 8), False),
                    ((64, 64, 32, 4), False)]
        if os.environ.get("PROBE_OLD_NEW"):  # the previous default against the new one
            variants = [((64, 32, 16, 4), False, "tf32"), ((64, 64, 128, 4), True, "split")]
        elif os.environ.get("PROBE_HEADS_INNER"):  # the importance loop order (heads summed per chunk)
            variants = [((64, 32, 16, 4), False, "tf32")] + [(t, True, w) for t in [
                (64, 64, 64, 4), (64, 64, 128, 4), (64, 128, 64, 4), (128, 64, 64, 8), (64, 64, 32, 4)]
                for w in os.environ.get("PROBE_W_PREC", "tf32,tf32x3").split(",")]
        else:
            variants = [(t, i, "tf32") for t, i in variants]
        ref_idx = (_reference_selection(q, kc, cfg) if N <= 16384 and
                   (os.environ.get("PROBE_HEADS_INNER") or os.environ.get("PROBE_OLD_NEW")) else None)
        for tiles, inner, wp in [] if os.environ.get("PROBE_SELECTED_ONLY") else variants:
            S.TILE_OVERRIDE["importance"] = tiles
            S.TILE_OVERRIDE["heads_inner"] = inner
            S.TILE_OVERRIDE["w_prec"] = wp
            with torch.no_grad():
                f = lambda: S.select_blocks_triton(q, kc, lse_c, cfg)  # noqa: E731
                try:
                    out = f()
                    ms = do_bench(f, warmup=5, rep=60, return_mode="median")
                    fi = lambda: S.importance_scores(q, kc, lse_c, cfg, fill_future=False)  # noqa: E731
                    ms_imp = do_bench(fi, warmup=5, rep=60, return_mode="median")
                except Exception as e:  # noqa: BLE001
                    rows.append((N, "selection", f"{tiles}{' heads-inner' if inner else ''}", float("nan"), "FAIL " + str(e).splitlines()[-1][:80]))
                    continue
            if base is None:
                base = out
            diff = (out != base).any(-1).float().mean().item()
            vs_ref = "" if ref_idx is None else f"; rows != fp64 reference (kv head 0) {(out[0, 0] != ref_idx).any(-1).float().mean().item():.2e}"
            rows.append((N, "selection (importance+top-n)", f"{tiles}{' heads-inner' if inner else ''} {wp}", ms,
                         f"importance alone {ms_imp:.3f} ms; rows changed vs first {diff:.2e}{vs_ref}"))
        S.TILE_OVERRIDE.clear()
    print("| N | what | variant | ms | note |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]} |")


if __name__ == "__main__":
    main()
