"""Context parallel at long sequences: the 114M recipe model's fwd+bwd at CP1 (one GPU) and
CP2 (two GPUs), tokens/s, peak memory, and the time the K/V all-gather leaves exposed.

    python benchmarks/bench_cp.py --out cp1.json                                     # CP1, one GPU
    torchrun --standalone --nproc-per-node=2 benchmarks/bench_cp.py --out cp2.json   # CP2
    python benchmarks/bench_cp.py --table cp1.json cp2.json [--md out.md]           # the table

Every row: micro batch 1 x ``seq`` tokens, bf16 parameters, the recipe's model with our
spec (``nemotron_114m.model``), forward + masked-mean loss + backward, CUDA-event timed
(median of ``--iters`` after ``--warmup``). Under CP the batch is split by megatron's own
``get_batch_on_this_cp_rank`` (two load-balanced chunks per rank), as NeMo's data step does.

**All-gather or ring** (nemo_ssa/megatron/parallel.py gathers K/V once per layer, its
backward reduce-scatters dK/dV). A ring overlaps those transfers with attention compute, so
the most it can save is the time the all-gather and reduce-scatter hold the compute stream;
its other gain is K/V memory (S/cp instead of S per layer). Both are measured here: each
``_GatherSequenceChunks`` forward/backward is bracketed with CUDA events on the compute
stream ("exposed comm", ms per step and % of the step), and the peak memory is reported
beside the gathered K/V bytes. tokens/s per GPU = seq / step time / cp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List

import torch

if __name__ == "__main__" and not __package__:  # run as a file: python benchmarks/x.py
    import _bootstrap  # noqa: F401


def _init(cp: int, seed: int = 1234) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29541")
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


class _CommTimer:
    """CUDA events around the CP all-gather (forward) and reduce-scatter (backward)."""

    def __init__(self):
        from nemo_ssa.megatron import parallel

        self.cls = parallel._GatherSequenceChunks
        self.fwd, self.bwd = self.cls.forward, self.cls.backward
        self.events: List = []
        timer = self

        def wrap(fn):
            def timed(ctx, *args):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                out = fn(ctx, *args)
                e1.record()
                timer.events.append((e0, e1))
                return out
            return staticmethod(timed)

        self.cls.forward, self.cls.backward = wrap(self.fwd), wrap(self.bwd)

    def take_ms(self) -> float:
        torch.cuda.synchronize()
        ms = sum(a.elapsed_time(b) for a, b in self.events)
        self.events = []
        return ms


def run_rows(attentions: List[str], seqs: List[int], warmup: int, iters: int) -> List[Dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from benchmarks.bench_model import batch, build, loss_fn, time_steps

    cp = int(os.environ.get("WORLD_SIZE", 1))
    _init(cp)
    timer = _CommTimer()
    rows = []
    for attention in attentions:
        for seq in seqs:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row = {"attention": attention, "seq": seq, "cp": cp, "device": torch.cuda.get_device_name()}
            try:
                # megatron's loss, as every CP record so far ran it (bench_model's default is now the
                # fused loss NeMo trains with); the attention's CP scaling is what this measures
                cfg, model = build(attention, seq, {"context_parallel_size": cp}, fused_ce="false")
                tokens, pos, labels, mask = batch(1, seq)
                local = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": pos.contiguous(),
                                                   "labels": labels, "loss_mask": mask})

                def step():
                    out = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
                    loss_fn(out, local["loss_mask"]).backward()
                    for p in model.parameters():
                        p.grad = None

                comm = []

                def step_and_comm():
                    step()
                    comm.append(timer.take_ms())  # syncs at the step end: adds ~host latency before the end event

                ms = statistics.median(time_steps(step_and_comm, warmup, iters))
                comm = comm[warmup:]
                kv_bytes = seq * 2 * cfg.num_query_groups * cfg.kv_channels * 2  # K and V, bf16, one layer
                row.update(ms=ms, tokens_per_s=seq / ms * 1e3, tokens_per_s_per_gpu=seq / ms * 1e3 / cp,
                           peak_gib=torch.cuda.max_memory_allocated() / 2**30, comm_ms=statistics.median(comm),
                           gathered_kv_mib_per_layer=kv_bytes / 2**20 if cp > 1 else 0.0,
                           layers=cfg.num_layers)
                del model
            except torch.OutOfMemoryError as e:
                row.update(error=f"OOM: {str(e)[:120]}")
            # the slowest rank's numbers are the step's
            gathered = [None] * cp
            dist.all_gather_object(gathered, row)
            if "ms" in row:
                row["ms"] = max(g["ms"] for g in gathered)
                row["tokens_per_s"] = seq / row["ms"] * 1e3
                row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / cp
                row["peak_gib"] = max(g["peak_gib"] for g in gathered)
                row["comm_ms"] = max(g["comm_ms"] for g in gathered)
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
    parallel_state.destroy_model_parallel()
    return rows


def table(paths: List[str]) -> str:
    rows = [r for p in paths for r in json.load(open(p))["rows"]]
    base = {(r["attention"], r["seq"]): r for r in rows if r["cp"] == 1 and "ms" in r}
    lines = ["| attention | seq | CP | fwd+bwd ms | tokens/s | tokens/s per GPU | per GPU vs CP1 | peak GiB "
             "(per GPU) | exposed K/V comm ms (% of step) | gathered K/V per layer MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["attention"], r["seq"], r["cp"])):
        if "ms" not in r:
            lines.append(f"| {r['attention']} | {r['seq']:,} | {r['cp']} | {r.get('error')} | | | | | | |")
            continue
        b = base.get((r["attention"], r["seq"]))
        rel = f"{r['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f}x" if b else "-"
        comm = f"{r['comm_ms']:.2f} ({100 * r['comm_ms'] / r['ms']:.1f} %)" if r["cp"] > 1 else "-"
        lines.append(f"| {r['attention']} | {r['seq']:,} | {r['cp']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {rel} | {r['peak_gib']:.2f} | {comm} | "
                     f"{r['gathered_kv_mib_per_layer']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attentions", default="ssa_triton,softmax")
    ap.add_argument("--seqs", default="16384,32768")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", help="rows as JSON (rank 0)")
    ap.add_argument("--table", nargs="+", help="print the table of these JSON files, run nothing")
    ap.add_argument("--md", help="also write the table here")
    args = ap.parse_args(argv)
    if args.table:
        text = table(args.table)
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text + "\n")
        return 0
    rows = run_rows(args.attentions.split(","), [int(s) for s in args.seqs.split(",")], args.warmup, args.iters)
    import torch.distributed as dist

    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
