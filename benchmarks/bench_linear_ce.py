"""Output layer + LM cross-entropy: nemo_ssa's chunked fused path vs megatron's and torch.compile's.

    python benchmarks/bench_linear_ce.py --out $OUT/linear_ce.md

At the recipe's shapes (tokens = micro batch x 1024: 8,192 and 32,768; hidden 768; vocab
50,304; bf16), fwd+bwd of ``sum(loss * mask) / sum(mask)`` (NeMo's reduction; 10% of the
tokens masked), median ms (triton ``do_bench``) and peak memory above the inputs, for:

* ``megatron``: bf16 GEMM + megatron-core's ``vocab_parallel_cross_entropy`` (fp32 logits);
* ``megatron GEMM + nemo_ssa compiled CE``: the loss-only fused path (``lm_cross_entropy``);
* ``torch.compile(linear+CE)``: the plain expression compiled;
* ``nemo_ssa chunked (c=...)``: ``linear_cross_entropy``, the fused output layer + loss.

Correctness (first token count only): loss, d hidden and d weight of every row against an
fp64 reference, and ``ok`` = within 2x the megatron path's error (the repo's 2x-eager rule).
The compact table is printed last; ``--out`` gets the same table plus the run's settings.
On a machine without CUDA it runs tiny shapes with wall-clock timing (a smoke test).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Dict, List

import torch

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

from benchmarks.timing import median_ms, peak_mib  # noqa: E402


def _bench(fn: Callable[[], None], leaves, cuda: bool) -> Dict[str, float]:
    fn()
    if cuda:
        ms = median_ms(fn, rep_ms=100, grad_to_none=leaves)
        for t in leaves:
            t.grad = None
        peak = peak_mib(fn)
    else:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        ms, peak = (time.perf_counter() - t0) / 3 * 1e3, math.nan
    for t in leaves:
        t.grad = None
    return {"ms": ms, "peak_mib": peak}


def _megatron_ce():
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=None, help="comma list (default 8192,32768; CPU: 96)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--chunks", default=None, help="chunk sizes of the fused path (default 4096,8192)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    H = args.hidden or (768 if cuda else 32)
    V = args.vocab or (50304 if cuda else 1001)
    token_list = [int(x) for x in (args.tokens or ("8192,32768" if cuda else "96")).split(",")]
    chunks = [int(x) for x in (args.chunks or ("4096,8192" if cuda else "40")).split(",")]

    from nemo_ssa.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_naive, lm_cross_entropy
    from nemo_ssa.testing import rel_err

    vp_ce = _megatron_ce()
    ce_c = torch.compile(lambda x, w, t: torch.nn.functional.cross_entropy((x @ w.t()).float(), t,
                                                                           reduction="none"))
    rows: List[Dict] = []
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, dtype {dt}, H {H}, V {V}, torch "
          f"{torch.__version__}", flush=True)
    for ti, T in enumerate(token_list):
        torch.manual_seed(0)
        x = (torch.randn(T, H, device=dev, dtype=dt)).requires_grad_()
        w = (torch.randn(V, H, device=dev, dtype=dt) * 0.05).requires_grad_()
        tgt = torch.randint(0, V, (T,), device=dev)
        mask = (torch.rand(T, device=dev) > 0.1).float()
        nvalid = mask.sum()

        impls: Dict[str, Callable[[], torch.Tensor]] = {
            "megatron (bf16 GEMM + fp32 CE)": lambda: vp_ce((x @ w.t()).view(T, 1, V), tgt.view(T, 1)).view(T),
            "megatron GEMM + nemo_ssa compiled CE": lambda: lm_cross_entropy((x @ w.t()).view(T, 1, V),
                                                                              tgt.view(1, T)).view(T),
            "torch.compile(linear+CE)": lambda: ce_c(x, w, tgt),
        }
        for c in chunks:
            impls[f"nemo_ssa chunked linear+CE c={c}"] = (
                lambda c=c: linear_cross_entropy(x, w, tgt, row_weight=mask, chunk_size=c))

        ref = None
        if ti == 0:  # fp64 anchor
            x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
            l64 = linear_cross_entropy_naive(x64, w64, tgt)
            g64 = torch.autograd.grad((l64 * mask.double()).sum() / nvalid.double(), [x64, w64])
            ref = (l64.detach(), g64[0], g64[1])
            del x64, w64, l64, g64
            if cuda:
                torch.cuda.empty_cache()
        base_err = None
        for name, f in impls.items():
            def step(f=f):
                ((f() * mask).sum() / nvalid).backward()

            try:
                r = _bench(step, [x, w], cuda)
                if ref is not None:
                    loss = f()
                    gx, gw = torch.autograd.grad((loss * mask).sum() / nvalid, [x, w])
                    errs = [rel_err(loss, ref[0]), rel_err(gx, ref[1]), rel_err(gw, ref[2])]
                    if base_err is None:
                        base_err = errs
                    r["err"] = "/".join(f"{e:.1e}" for e in errs)
                    r["ok"] = all(e <= 2 * b + 1e-7 for e, b in zip(errs, base_err))
            except Exception as e:  # noqa: BLE001 - report, keep going
                r = {"ms": math.nan, "peak_mib": math.nan, "note": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
            r.update(impl=name, tokens=T)
            rows.append(r)
            print(f"  T={T:6d} {name:40s} {r['ms']:8.3f} ms  peak {r['peak_mib']:8.0f} MiB  "
                  f"{r.get('err', '')} {r.get('ok', '')} {r.get('note', '')}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
        del x, w
        if cuda:
            torch.cuda.empty_cache()

    lines = ["| tokens | impl | fwd+bwd ms | x megatron | peak extra MiB | rel err loss/dx/dw vs fp64 | "
             "within 2x megatron |", "|---|---|---|---|---|---|---|"]
    for T in token_list:
        mine = [r for r in rows if r["tokens"] == T]
        base = mine[0]["ms"]
        for r in mine:
            lines.append(f"| {T} | {r['impl']} | {r['ms']:.2f} | {r['ms'] / base:.2f} | {r['peak_mib']:.0f} | "
                         f"{r.get('err', '-')} | {r.get('ok', '-')}{' ' + r['note'] if 'note' in r else ''} |")
    table = "\n".join(lines)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(f"# bench_linear_ce\n\ndevice {torch.cuda.get_device_name() if cuda else 'cpu'}, "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, dtype {dt}, H {H}, V {V}, "
                     f"torch {torch.__version__}\ncommand: python benchmarks/bench_linear_ce.py "
                     f"{' '.join(argv if argv is not None else sys.argv[1:])}\n\n{table}\n")
    print()
    print(table)
    bad = [r for r in rows if r.get("ok") is False and "chunked" in r["impl"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
