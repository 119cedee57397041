"""Measure candidate tile configs of the Triton attention kernels on one GPU; print the best.

The static tile tables (``ops/attention/flash.py`` ``_FWD_16``, ``ops/common/bwd_config.py``
``_BWD_16``, ``ops/elsa/routing.py`` ``FWD_TILES``) started as register/shared-memory
estimates from offline sm_90 compiles. This script times every candidate on the real
shapes so the tables can be filled with measured winners:

    python benchmarks/tune_tiles.py --out tune.md              # all kernels, all shapes
    python benchmarks/tune_tiles.py --kernels bwd --shapes model

Kernels: ``flash_fwd`` (single-pass flash forward), ``bwd_dq`` / ``bwd_dkv`` (the two
backward kernels; each swept with the other at its table value, so the winner of one
does not depend on the other's timing), ``elsa_fwd`` (ELSA phase 1, one partition at the
benchmark length) -- SSA transform (the heavier epilogue; softmax shares the tables) --
and NSA's ``nsa_{compressed,window}_{fwd,bwd}`` (the banded kernel, one table row per
branch and pass; bwd candidates timed as fwd+bwd; the Hopper path where the GPU takes it)
and ``nsa_selected`` (selected attention fwd+bwd; candidate = (block_q, -, warps, -)),
softmax, at the model's GQA 3 (N = 32K) and the NSA paper's GQA 16 (N = 64K).

Compiling ~40-70 candidates per kernel and shape serially takes minutes, so a pool of
worker processes first compiles every candidate once (populating Triton's on-disk cache;
their timings are discarded), then this process times all of them alone on the GPU
(``triton.testing.do_bench``, median). Candidates that fail to compile or launch (shared
memory, registers) are reported as ``fail``. Output: per (kernel, shape) the best config
and its speed-up over the current table entry, then the full table (``--out`` .md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing as mp
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

SHAPES = {
    # label: (B, Hq, Hkv, N, D) -- the model's attention, and the long-sequence and wide-head benchmark shapes
    "model": (4, 24, 8, 4096, 32),
    "b32": (32, 24, 8, 1024, 32),  # the recipe's attention at micro batch 32
    "elsa16k-d32": (1, 24, 8, 16384, 32),
    "d64": (1, 16, 16, 16384, 64),
    "d128": (2, 8, 8, 8192, 128),
    # the Hopper-path targets (issue 28): B2 N8192 and B8 N4096 at D64 / D128
    "d64-n8k": (2, 16, 16, 8192, 64),
    "d64-b8": (8, 16, 16, 4096, 64),
    "d128-b8": (8, 8, 8, 4096, 128),
}
FWD_CANDS = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
DQ_CANDS = [(bm, bn, w, s) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (1, 2)]
KV_CANDS = [(bm, bn, w, s) for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (1, 2)]
SINGLE_CANDS = [(bm, bn, w, s) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (1, 2)]
NSA_SHAPES = {
    # label: (B, Hq, Hkv, N, D) -- bench_nsa's shapes at N = 32K
    "nsa-d32": (1, 24, 8, 32768, 32),
    "nsa-d128": (1, 24, 8, 32768, 128),
    "nsa-gqa16-d64": (1, 64, 4, 65536, 64),  # the NSA paper's grouping (issue 28's shape)
    "nsa-gqa16-d128": (1, 64, 4, 65536, 128),
}
# --tma: the flash kernels' candidates on the Hopper path (tensor descriptors; 5th field =
# FwdConfig.tma / BwdConfig.tma_dq / tma_kv = 1), compared against the (pointer) table entry
TMA_FWD_CANDS = [(bm, bn, w, s, 1) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
TMA_DQ_CANDS = [(bm, bn, w, s, 1) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
TMA_KV_CANDS = [(bm, bn, w, s, 1) for bm in (16, 32, 64) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
TMA_SINGLE_CANDS = [(bm, bn, w, s, 1) for bm in (32, 64, 128) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
USE_TMA = os.environ.get("NEMO_SSA_TUNE_TMA", "0") == "1"
RANGE_FWD_CANDS = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
RANGE_BWD_CANDS = [(bm, bn, w, s) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (1, 2)]
SELECTED_CANDS = [(bq, 0, w, 0) for bq in (16, 32, 64, 128) for w in (2, 4, 8)]  # (block_q, -, warps, -)
FLASH_KERNELS = ("flash_fwd", "bwd_dq", "bwd_dkv", "bwd_single", "elsa_fwd")
# flash_fwd / bwd_* transform (``--transform``; an env var so the spawned compile workers see it)
TUNE_TRANSFORM = os.environ.get("NEMO_SSA_TUNE_TRANSFORM", "ssa")
NSA_RANGE_KERNELS = ("nsa_compressed_fwd", "nsa_compressed_bwd", "nsa_window_fwd", "nsa_window_bwd")
NSA_KERNELS = NSA_RANGE_KERNELS + ("nsa_selected",)
KERNELS = FLASH_KERNELS + NSA_KERNELS


def _cands(kernel: str):
    if USE_TMA and kernel in ("flash_fwd", "bwd_dq", "bwd_dkv", "bwd_single"):
        return {"flash_fwd": TMA_FWD_CANDS, "bwd_dq": TMA_DQ_CANDS, "bwd_dkv": TMA_KV_CANDS,
                "bwd_single": TMA_SINGLE_CANDS}[kernel]
    return {"flash_fwd": FWD_CANDS, "elsa_fwd": FWD_CANDS, "bwd_dq": DQ_CANDS, "bwd_dkv": KV_CANDS, "bwd_single": SINGLE_CANDS,
            "nsa_compressed_fwd": RANGE_FWD_CANDS, "nsa_window_fwd": RANGE_FWD_CANDS,
            "nsa_compressed_bwd": RANGE_BWD_CANDS, "nsa_window_bwd": RANGE_BWD_CANDS,
            "nsa_selected": SELECTED_CANDS}[kernel]


def _shapes_of(kernel: str, shapes):
    pool = NSA_SHAPES if kernel in NSA_KERNELS else SHAPES
    return [s for s in shapes if s in pool]


class _NsaCase:
    """NSA branch inputs at one shape (paper sizes); candidates go through the modules'
    ``TILE_OVERRIDE`` hooks. ``nsa_<branch>_<pass>`` time one branch of the banded kernel
    (``"<pass>:<branch>"`` overrides); ``nsa_selected`` times selected attention."""

    def __init__(self, shape: str):
        import torch

        from nemo_ssa.ops.nsa import NSAConfig, compress_kv
        from nemo_ssa.ops.nsa import range_attn, selected_attn
        from nemo_ssa.ops.nsa.select import select_blocks_triton

        self.torch, self.ra, self.sa = torch, range_attn, selected_attn
        B, Hq, Hkv, N, D = NSA_SHAPES[shape]
        self.cfg = cfg = NSAConfig(compress="mean")
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h, n=N: torch.randn(B, h, n, D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                        generator=g).requires_grad_()
        self.q, self.k, self.v, self.do = mk(Hq), mk(Hkv), mk(Hkv), torch.randn(B, Hq, N, D, device="cuda",
                                                                               dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            self.kc, self.vc = compress_kv(self.k, cfg).requires_grad_(), compress_kv(self.v, cfg).requires_grad_()
            _, lse = range_attn.compressed_attention(self.q, self.kc, self.vc, cfg.block_len, cfg.stride)
            self.idx = select_blocks_triton(self.q, self.kc, lse, cfg)
        self.D = D

    def table(self, kernel: str):
        old = (dict(self.ra.TILE_OVERRIDE), dict(self.sa.TILE_OVERRIDE))
        self.ra.TILE_OVERRIDE.clear()
        self.sa.TILE_OVERRIDE.clear()
        try:
            if kernel == "nsa_selected":
                return (self.sa._block_q(self.D, 0, True), 0, self.sa._num_warps(), 0)
            _, branch, kind = kernel.split("_")
            tma = self.ra._tma("fwd", self.D, self.k, self.v, scores=1 << 62)
            return tuple(self.ra._blocks(self.D, kind, branch, bool(tma)))
        finally:
            self.ra.TILE_OVERRIDE.update(old[0])
            self.sa.TILE_OVERRIDE.update(old[1])

    def fn(self, kernel: str, cand):
        torch, ra, sa, cfg = self.torch, self.ra, self.sa, self.cfg

        def run():
            ra.TILE_OVERRIDE.clear()
            sa.TILE_OVERRIDE.clear()
            try:
                if kernel == "nsa_selected":
                    sa.TILE_OVERRIDE.update(block_q=cand[0], num_warps=cand[2])
                    o = sa.selected_attention(self.q, self.k, self.v, self.idx, cfg.select_block)
                    torch.autograd.grad(o, [self.q, self.k, self.v], self.do)
                    return
                _, branch, kind = kernel.split("_")
                ra.TILE_OVERRIDE[f"{kind}:{branch}"] = tuple(cand)
                if branch == "compressed":
                    o = ra.compressed_attention(self.q, self.kc, self.vc, cfg.block_len, cfg.stride)[0]
                    leaves = [self.q, self.kc, self.vc]
                else:
                    o = ra.window_attention(self.q, self.k, self.v, cfg.window)
                    leaves = [self.q, self.k, self.v]
                if kind == "bwd":
                    torch.autograd.grad(o, leaves, self.do)
            finally:
                ra.TILE_OVERRIDE.clear()
                sa.TILE_OVERRIDE.clear()
        return run


class _Case:
    """Inputs of one shape and the callables that run one kernel with one candidate."""

    def __init__(self, shape: str, causal: bool = True):
        import torch

        from nemo_ssa.ops.common import bwd as attn_bwd  # attention_bwd and, imported there, the tile tables
        from nemo_ssa.ops.attention import flash

        self.torch, self.flash, self.attn_bwd = torch, flash, attn_bwd
        B, Hq, Hkv, N, D = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h: torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        self.q, self.k, self.v, self.do = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
        self.n = torch.tensor([1.5], device="cuda")
        self.b = torch.tensor([0.8], device="cuda")
        self.nb = dict(n=self.n, b=self.b) if TUNE_TRANSFORM == "ssa" else {}
        self.causal, self.D = causal, D
        self.o, self.M = flash.flash_attention_fwd(self.q, self.k, self.v, transform=TUNE_TRANSFORM, **self.nb,
                                                   causal=causal)
        self.bwd_table = attn_bwd.bwd_config(D, causal, torch.bfloat16)
        self.single_table = attn_bwd.single_config(D, torch.bfloat16)
        # the row means C the single-pass backward's dn needs (SSA, the pinned policy: b fixed)
        self.C = flash._flash_fwd(self.q, self.k, self.v, self.n if TUNE_TRANSFORM == "ssa" else None,
                                  self.b if TUNE_TRANSFORM == "ssa" else None, None, None, None, TUNE_TRANSFORM,
                                  causal, 1.0 / math.sqrt(D), 0.0, N, N, "tf32", True, save_c=True)[2]
        self.fwd_table = flash.fwd_config(D, causal, torch.bfloat16)

    def table(self, kernel: str) -> Tuple[int, int, int, int]:
        if kernel == "flash_fwd":
            return tuple(self.fwd_table) if USE_TMA else tuple(self.fwd_table[:4])
        t = self.bwd_table
        if kernel == "bwd_dq":
            return tuple(t[:4]) + ((t.tma_dq,) if USE_TMA else ())
        if kernel == "bwd_dkv":
            return tuple(t[4:8]) + ((t.tma_kv,) if USE_TMA else ())
        if kernel == "bwd_single":
            return tuple(self.single_table[4:8]) + ((self.single_table.tma_kv,) if USE_TMA else ())
        from nemo_ssa.ops.elsa import routing

        return tuple(routing.FWD_TILES["16bit"][routing.block_d(self.D)])

    def fn(self, kernel: str, cand: Tuple[int, int, int, int]):
        torch, flash, ab = self.torch, self.flash, self.attn_bwd
        if kernel == "flash_fwd":
            cfg = flash.FwdConfig(*cand)
            return lambda: flash.flash_attention_fwd(self.q, self.k, self.v, transform=TUNE_TRANSFORM, **self.nb,
                                                     causal=self.causal, config=cfg)
        if kernel == "bwd_single":
            cfg = ab.BwdConfig(0, 0, 0, 0, *cand[:4], tma_kv=cand[4] if len(cand) > 4 else 0)
            return lambda: ab.attention_bwd(self.do, self.q, self.k, self.v, self.o, self.M, transform=TUNE_TRANSFORM,
                                            **self.nb, causal=self.causal, config=cfg, need_db=False, cstat=self.C,
                                            deterministic=False)
        if kernel in ("bwd_dq", "bwd_dkv"):
            t = self.bwd_table
            tma = cand[4] if len(cand) > 4 else 0
            if kernel == "bwd_dq":
                cfg = ab.BwdConfig(*cand[:4], *t[4:8], tma_dq=tma, tma_kv=t.tma_kv)
            else:
                cfg = ab.BwdConfig(*t[:4], *cand[:4], tma_dq=t.tma_dq, tma_kv=tma)
            # need_db=False: the pinned policy trains n and fixes b (dQ kernel without db sums)
            return lambda: ab.attention_bwd(self.do, self.q, self.k, self.v, self.o, self.M, transform=TUNE_TRANSFORM,
                                            **self.nb, causal=self.causal, config=cfg, need_db=False,
                                            deterministic=True)
        from nemo_ssa.ops.elsa import routing
        from nemo_ssa.ops.elsa.scan import elsa_forward
        from nemo_ssa.ops.common.transforms import transform_id

        def run():
            old = routing.TILE_OVERRIDE
            routing.TILE_OVERRIDE = cand
            try:
                with torch.no_grad():
                    return elsa_forward(self.q, self.k, self.v, self.n, self.b, transform=transform_id("ssa"),
                                        causal=self.causal, scale=1.0 / math.sqrt(self.D), num_partitions=1)
            finally:
                routing.TILE_OVERRIDE = old
        return run


def _compile_worker(jobs: List[Tuple[str, str, Tuple[int, int, int, int]]]) -> int:
    """Run each (shape, kernel, candidate) once: fills Triton's disk cache."""
    import torch

    cases: Dict[str, object] = {}
    ok = 0
    for shape, kernel, cand in jobs:
        try:
            if shape not in cases:
                cases[shape] = _NsaCase(shape) if shape in NSA_SHAPES else _Case(shape)
            cases[shape].fn(kernel, cand)()
            torch.cuda.synchronize()
            ok += 1
        except Exception:  # noqa: BLE001 -- a candidate that cannot run is reported by the timing pass
            torch.cuda.synchronize()
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--shapes", default=",".join(list(SHAPES) + list(NSA_SHAPES)))
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--rep", type=int, default=30, help="do_bench rep (ms) per candidate")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tma", action="store_true",
                    help="flash_fwd/bwd_dq/bwd_dkv: sweep the Hopper path's candidates (tensor descriptors) against "
                         "the table entry")
    ap.add_argument("--transform", default=None, choices=["ssa", "softmax"],
                    help="score transform of flash_fwd/bwd_* (default ssa; the tables are shared)")
    args = ap.parse_args(argv)
    if args.tma:
        global USE_TMA
        USE_TMA = True
        os.environ["NEMO_SSA_TUNE_TMA"] = "1"  # the spawned compile workers read it
    if args.transform:
        global TUNE_TRANSFORM
        TUNE_TRANSFORM = os.environ["NEMO_SSA_TUNE_TRANSFORM"] = args.transform
    import torch
    import triton
    import triton.testing

    if not torch.cuda.is_available():
        print("tune_tiles.py needs a CUDA device", file=sys.stderr)
        return 2
    kernels = [k for k in args.kernels.split(",") if k]
    shapes = [s for s in args.shapes.split(",") if s]
    jobs = [(s, k, c) for k in kernels for s in _shapes_of(k, shapes) for c in _cands(k)]
    t0 = time.time()
    if args.workers > 1:
        chunks = [jobs[i::args.workers] for i in range(args.workers)]
        with mp.get_context("spawn").Pool(args.workers) as pool:
            ok = sum(pool.map(_compile_worker, chunks))
        print(f"precompiled {ok}/{len(jobs)} candidates in {time.time() - t0:.0f} s ({args.workers} workers)", flush=True)

    results: List[Dict] = []
    best: Dict[Tuple[str, str], Dict] = {}
    for s in shapes:
        case = _NsaCase(s) if s in NSA_SHAPES else _Case(s)
        for k in [k for k in kernels if s in _shapes_of(k, [s])]:
            table = case.table(k)
            timed = {}
            for c in _cands(k) + ([table] if table not in _cands(k) else []):
                try:
                    ms = float(triton.testing.do_bench(case.fn(k, c), warmup=5, rep=args.rep, return_mode="median"))
                except Exception as e:  # noqa: BLE001
                    ms = math.nan
                    torch.cuda.synchronize()
                timed[c] = ms
                results.append(dict(shape=s, kernel=k, cand=c, ms=ms, table=(c == table)))
            good = {c: ms for c, ms in timed.items() if ms == ms}
            if not good:
                print(f"{s:12s} {k:9s} no candidate ran", flush=True)
                continue
            bc = min(good, key=good.get)
            tms = timed.get(table, math.nan)
            best[(s, k)] = dict(cand=bc, ms=good[bc], table=table, table_ms=tms)
            print(f"{s:12s} {k:9s} best {bc} {good[bc]:.3f} ms | table {table} {tms:.3f} ms | "
                  f"x{tms / good[bc]:.2f}", flush=True)
        del case
        torch.cuda.empty_cache()

    lines = [f"# tune_tiles: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
             f"bf16 causal SSA | {time.strftime('%Y-%m-%d')}", "",
             "| shape | kernel | best (BM, BN, warps, stages[, tma]) | ms | table entry | table ms | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for (s, k), r in best.items():
        lines.append(f"| {s} | {k} | {r['cand']} | {r['ms']:.3f} | {r['table']} | {r['table_ms']:.3f} | "
                     f"{r['table_ms'] / r['ms']:.2f} |")
    lines += ["", "All candidates (ms; nan = failed to compile/launch):", "", "| shape | kernel | cand | ms |",
              "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['cand']}{' (table)' if r['table'] else ''} | {r['ms']:.3f} |")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print("\n".join(lines[:4 + len(best)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
