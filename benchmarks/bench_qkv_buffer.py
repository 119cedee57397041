"""The 114M recipe step with q, k, v read from the QKV buffer against megatron's split, one model.

    python benchmarks/bench_qkv_buffer.py                                  # softmax, ssa_triton; mb 32 and 8
    python benchmarks/bench_qkv_buffer.py --attentions ssa_triton --micro-batches 8 --rounds 10 --out $OUT/qkv.md

``FusedRopeSelfAttention`` reads q, k, v straight from megatron's QKV projection output
(``rope_layout_qkv_triton``); with ``read_qkv_buffer = False`` it runs megatron's split and
the core attention's fused pass on the split views instead (the path before, and the one
kept where something sits between split and RoPE). Both are the same arithmetic, so one
model serves both: per attention the recipe model is built once, wrapped as NeMo's step
(bench_model's ``step`` mode: megatron DDP + the recipe optimizer), and the two paths are
timed in alternating rounds on the same weights and batch. Step times on a GPU move
between rounds by more than this change is worth (docs/results/2026-11-29-qkv-buffer);
alternation puts both paths under the same drift, and the GPU kernel time (profiler sum)
is the figure that does not depend on the host.

Per attention and micro batch it prints each round, then: the step wall time (median of
all rounds), the host time to enqueue one step (``perf_counter`` around a step that is
not synchronised inside; at or above the wall time the step is host-bound), the GPU
kernel time per step and the kernels that differ most between the paths.

Before timing, a parity check at micro batch 4: the loss and every gradient of one
forward + backward by each path, beside the split path against itself run again (a core
attention whose backward is not deterministic run to run cannot be closer to itself).
Exit 1 if the buffer path did not run when asked, ran when not, or the loss differs from
the split path's beyond the split path's own rerun spread (``parity_ok``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401

import bench_model as bm  # noqa: E402 -- benchmarks/ on the path (_bootstrap or the test's import)

PATHS = ("buffer", "split")


def use(model, path: str) -> None:
    from nemo_ssa.megatron.self_attention import FusedRopeSelfAttention

    layers = [m for m in model.modules() if isinstance(m, FusedRopeSelfAttention)]
    if not layers:
        raise SystemExit("no FusedRopeSelfAttention in the model: nothing to compare")
    for m in layers:
        m.read_qkv_buffer = path == "buffer"


class CallCount:
    """Counts ``rope_layout_qkv_triton`` calls made through the self-attention module."""

    def __enter__(self):
        import nemo_ssa.megatron.self_attention as sa

        self.mod, self.fn, self.n = sa, sa.rope_layout_qkv_triton, 0

        def counted(*a, **k):
            self.n += 1
            return self.fn(*a, **k)
        sa.rope_layout_qkv_triton = counted
        return self

    def __exit__(self, *exc):
        self.mod.rope_layout_qkv_triton = self.fn


def loss_and_grads(model, data):
    tokens, pos, labels, mask = data
    for p in model.parameters():
        p.grad = None
    loss = bm.loss_fn(model(tokens, pos, None, labels=labels, loss_mask=mask), mask)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return loss.detach().clone(), grads


def max_diff(a, b) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def parity(model, run) -> dict:
    """The buffer path against the split path and the split path against itself:
    ``run(model)`` gives one forward + backward's ``(loss, {name: grad})``."""
    got = {}
    for path in ("buffer", "split", "split again"):
        use(model, path.split()[0])
        with CallCount() as c:
            got[path] = run(model)
        got[path] += (c.n,)
    use(model, "buffer")
    (lb, gb, nb), (ls, gs, ns), (la, ga, _) = got["buffer"], got["split"], got["split again"]
    return dict(loss_buffer=lb.item(), loss_split=ls.item(), loss_diff=abs(lb - ls).item(),
                loss_rerun_diff=abs(ls - la).item(), grad_diff=max_diff(gb, gs), grad_rerun_diff=max_diff(gs, ga),
                bitwise=torch.equal(lb, ls) and all(torch.equal(gb[n], gs[n]) for n in gb),
                rerun_bitwise=torch.equal(ls, la) and all(torch.equal(gs[n], ga[n]) for n in gs),
                buffer_calls=nb, split_calls=ns)


def parity_ok(par: dict) -> bool:
    """The buffer path ran when asked and only then, and its loss is the split path's
    exactly (or within the split path's own rerun spread): the forward is the same
    arithmetic, and a tolerance would pass a small error (a 0.1 % scale of q moves a tiny
    model's loss by ~5e-7; tests/megatron/test_self_attention.py). Gradients are reported,
    not gated: a backward with atomics differs from itself run to run."""
    return (par["buffer_calls"] > 0 and par["split_calls"] == 0
            and par["loss_diff"] <= par["loss_rerun_diff"])


def host_and_kernels(model, step) -> tuple:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    hs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hs.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    kern = {e.key: e.device_time_total / 2e3 for e in prof.key_averages() if e.device_time_total > 0}
    return statistics.median(hs), kern


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attentions", default="softmax,ssa_triton")
    ap.add_argument("--micro-batches", default="32,8")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (each path once per round)")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per path per round (after 3 warm-up)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed by their difference between paths")
    ap.add_argument("--out", default=None, help="markdown results file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_qkv_buffer.py needs CUDA", file=sys.stderr)
        return 2
    bm.init_megatron(1234)
    name = torch.cuda.get_device_name()
    rows, notes, ok = [], [], True
    for attention in args.attentions.split(","):
        cfg, model = bm.build(attention, args.seq)
        data4 = bm.batch(4, args.seq)
        par = parity(model, lambda m: loss_and_grads(m, data4))
        good = parity_ok(par)
        ok &= good
        notes.append(f"- {attention} parity (micro batch 4): loss {par['loss_buffer']:.6f} / {par['loss_split']:.6f} "
                     f"(|diff| {par['loss_diff']:.2e}, split rerun {par['loss_rerun_diff']:.2e}); max |grad diff| "
                     f"{par['grad_diff']:.2e} (split rerun {par['grad_rerun_diff']:.2e}); bitwise {par['bitwise']} "
                     f"(split rerun bitwise {par['rerun_bitwise']}); buffer kernel calls {par['buffer_calls']} / "
                     f"{par['split_calls']}{'' if good else ' -- FAIL'}")
        print(notes[-1], flush=True)
        bm.wrap_for_step(cfg, model)
        for mb in (int(m) for m in args.micro_batches.split(",")):
            data = bm.batch(mb, args.seq)
            step = bm.make_step(model, data)
            times = {p: [] for p in PATHS}
            for rnd in range(args.rounds):
                line = []
                for path in PATHS if rnd % 2 == 0 else PATHS[::-1]:
                    use(model, path)
                    ts = bm.time_steps(step, 3, args.iters)
                    times[path] += ts
                    line.append(f"{path} {statistics.median(ts):.2f}")
                print(f"  {attention} mb {mb} round {rnd}: " + "  ".join(line) + " ms", flush=True)
            r = dict(attention=attention, mb=mb, **{f"{p}_ms": statistics.median(times[p]) for p in PATHS})
            kern = {}
            for path in PATHS:
                use(model, path)
                r[f"{path}_host_ms"], kern[path] = host_and_kernels(model, step)
                r[f"{path}_gpu_ms"] = sum(kern[path].values())
            rows.append(r)
            keys = sorted(set(kern["buffer"]) | set(kern["split"]),
                          key=lambda k: -abs(kern["buffer"].get(k, 0) - kern["split"].get(k, 0)))[:args.top]
            notes.append(f"- {attention} mb {mb}, kernels differing most (ms per step, buffer / split): " + "; ".join(
                f"`{k[:60]}` {kern['buffer'].get(k, 0):.3f} / {kern['split'].get(k, 0):.3f}" for k in keys))
            print(notes[-1], flush=True)
            del data, step
        use(model, "buffer")
        del model
        torch.cuda.empty_cache()
    lines = ["| attention | micro batch | step ms buffer | step ms split | split / buffer | host enqueue ms buffer "
             "/ split | GPU kernels ms buffer / split | GPU saving ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['mb']} | {r['buffer_ms']:.2f} | {r['split_ms']:.2f} | "
                     f"{r['split_ms'] / r['buffer_ms']:.3f} | {r['buffer_host_ms']:.2f} / {r['split_host_ms']:.2f} | "
                     f"{r['buffer_gpu_ms']:.2f} / {r['split_gpu_ms']:.2f} | {r['split_gpu_ms'] - r['buffer_gpu_ms']:.2f} |")
    md = "\n".join(lines)
    print("\n" + md + "\n" + ("PASS" if ok else "FAIL: see the parity lines"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# QKV buffer vs split, {name}, {time.strftime('%Y-%m-%d')}\n\n`{' '.join(sys.argv)}`\n\n"
                    f"{md}\n\n" + "\n".join(notes) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
