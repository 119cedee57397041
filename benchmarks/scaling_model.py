"""Scaling on paper: expected tokens/s per GPU of the 114M recipe at 8, 64 and 512 GPUs,
from the step times measured on one, two (H100) and four (H200) GPUs and Megatron's communication volumes.

    python benchmarks/scaling_model.py                 # the table with the measured inputs
    python benchmarks/scaling_model.py --json          # the same as JSON

Model (every assumption is an argument; the defaults are the measured or stated values in
docs/results/2026-11-25-two-gpu/README.md):

* one optimizer step per GPU = one micro batch of 32 x 1024 tokens (weak scaling, global
  batch = 32 x data-parallel size), as Megatron scales;
* ``t_step(N) = t_mb + t_fixed / N + h_dp + exposed(comm(N))`` with the distributed optimizer
  (``t_fixed`` whole with plain DDP): ``t_mb`` a micro batch's forward + backward and
  ``t_fixed`` what a step pays once (optimizer, clipping, the trainer's host work), split from
  one machine's 1-GPU steps at one and at k micro batches; ``h_dp`` what data parallel adds
  besides the transfer (the measured DP step minus the rest): ``--fit dp4``, four H200s of one
  launcher, the default since 2026-11-27, or ``--fit dp2``, two H100s over two c10d launchers;
  each fit uses its own machine's ``t_mb`` and ``t_fixed``, so its table is that machine's;
* volumes per step, P parameters, gradients reduced in fp32, bf16 parameters:
  DDP all-reduce ``2 (N-1)/N * 4P`` bytes; distributed optimizer reduce-scatter
  ``(N-1)/N * 4P`` + all-gather ``(N-1)/N * 2P``; a ring's time is volume / bus bandwidth
  plus ``2 (N-1)`` hops of latency (NCCL's trees cut that at scale: an upper bound);
* bus bandwidth: NVLink within a node (measured 329-361 GB/s for a 1 GiB all-reduce on the
  lent 2/8-GPU H100 hosts), the network between nodes (400 Gb/s per GPU, 8 NICs per node as
  on a DGX H100: 50 GB/s, 45 GB/s reached by NCCL);
* overlap: megatron overlaps the gradient reduce-scatter / all-reduce with the backward
  (``overlap_grad_reduce``, on with DP > 1) bucket by bucket; what stays exposed is the last
  bucket's share (``--exposed``, default 1/3: three 40M-element buckets of a 114M model), and
  the parameter all-gather is not overlapped (``overlap_param_gather`` is off in the recipe);
* tensor parallel: the measured TP2+SP step (two GPUs, same global batch), then data
  parallel across TP groups on the remaining GPUs with the gradient volume divided by TP.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

#: measured on two H100s (docs/results/2026-11-25-two-gpu): seconds per optimizer step
MEASURED = {
    "t1_b32": 32768 / 350_525,   # ssa_triton, 1 GPU, global batch 32 (one micro batch)
    "t_dp2": 65536 / 611_591,    # ssa_triton, DP2 over two launchers, distributed optimizer (before the kill)
    "t_tp2": 65536 / 316_897,    # ssa_triton, TP2 + SP, global batch 64 (two micro batches), steps 1-100
    "t1_b64": 65536 / 379_476,   # ssa_triton, 1 GPU, global batch 64 (two micro batches)
}
#: measured on four H200s of one host, one launcher (docs/results/2026-11-27-four-gpu, the
#: full 200-step run); the two 1-GPU references ran side by side with one more 1-GPU run
MEASURED_DP4 = {
    "t1_b32": 32768 / 339_429,    # ssa_triton, 1 GPU, global batch 32
    "t1_b128": 131072 / 439_686,  # ssa_triton, 1 GPU, global batch 128 (4 micro batches accumulated)
    "t_dp4": 131072 / 1_499_856,  # ssa_triton, DP4, distributed optimizer, global batch 128
}
#: which measured DP step fixes the per-step DP overhead besides the transfer (--fit)
FITS = ("dp2", "dp4")
PARAMS = 114_169_344


def machine(fit: str) -> Dict[str, float]:
    """One machine's step split from its own 1-GPU runs at one and at k micro batches a step:
    ``t_mb`` a micro batch's forward + backward, ``t_fixed`` what a step pays once (the optimizer,
    gradient clipping, zeroing, the trainer's per-step host work); and the DP step measured there,
    with its rank count."""
    if fit == "dp4":
        d, k, t_k, n, t_dp = MEASURED_DP4, 4, MEASURED_DP4["t1_b128"], 4, MEASURED_DP4["t_dp4"]
    else:
        d, k, t_k, n, t_dp = MEASURED, 2, MEASURED["t1_b64"], 2, MEASURED["t_dp2"]
    t_mb = (t_k - d["t1_b32"]) / (k - 1)
    return {"t1": d["t1_b32"], "t_mb": t_mb, "t_fixed": d["t1_b32"] - t_mb, "n": n, "t_dp": t_dp}


def dp_overhead(fit: str, busbw: float, hop_latency: float, exposed: float) -> float:
    """What a data-parallel step (distributed optimizer) adds besides its modelled transfer,
    from the measured DP step: ``t_dp - t_mb - t_fixed / n - comm(n)``; the distributed optimizer
    runs 1/n of the optimizer step on each rank, so ``t_fixed`` is counted as sharded (an upper
    bound on what shards: the host's per-step work does not)."""
    m = machine(fit)
    return m["t_dp"] - m["t_mb"] - m["t_fixed"] / m["n"] - dp_comm(m["n"], PARAMS, True, busbw, hop_latency,
                                                                     exposed)


def ring_time(volume_bytes: float, hops: int, busbw: float, hop_latency: float) -> float:
    """Seconds for a ring collective: per-GPU traffic over the bus bandwidth plus its hops."""
    return volume_bytes / busbw + hops * hop_latency


def dp_comm(n: int, params: int, dist_opt: bool, busbw: float, hop_latency: float, exposed: float) -> float:
    """Exposed seconds per step of DP gradient (+ parameter) collectives over ``n`` ranks."""
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if dist_opt:
        rs = ring_time(frac * 4 * params, n - 1, busbw, hop_latency)  # fp32 gradients, reduce-scatter
        ag = ring_time(frac * 2 * params, n - 1, busbw, hop_latency)  # bf16 parameters, all-gather
        return exposed * rs + ag
    return exposed * ring_time(2 * frac * 4 * params, 2 * (n - 1), busbw, hop_latency)


def table(gpus: List[int], a) -> List[Dict]:
    m = machine(a.fit)
    intra = a.nvlink_gbs * 1e9
    inter = a.network_gbs * 1e9

    def bw(n):
        return intra if n <= a.gpus_per_node else inter

    h_dp = dp_overhead(a.fit, intra, a.hop_latency_s, a.exposed)
    rows = []
    for n in gpus:
        row = {"gpus": n}
        for name, dist_opt in (("dp_distopt", True), ("dp_ddp", False)):
            t = m["t_mb"] + m["t_fixed"] / (n if dist_opt else 1) + h_dp + \
                dp_comm(n, PARAMS, dist_opt, bw(n), a.hop_latency_s, a.exposed)
            row[name] = 32768 / t
        # TP2 groups inside a node, DP over n/2 of them (gradients of P/2 per rank); the TP2 step
        # is the two-H100 one, scaled by this machine's 1-GPU step over that machine's
        dp = n // 2
        t_tp = MEASURED["t_tp2"] / 2 * m["t1"] / MEASURED["t1_b32"] + \
            dp_comm(dp, PARAMS // 2, True, bw(n), a.hop_latency_s, a.exposed)
        row["tp2_dp"] = 32768 / t_tp / 2  # one micro batch per TP group per step, over its 2 GPUs
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="2,4,8,64,512")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nvlink-gbs", type=float, default=330.0, help="NVLink bus bandwidth, GB/s")
    ap.add_argument("--network-gbs", type=float, default=45.0, help="per-GPU network bus bandwidth, GB/s")
    ap.add_argument("--hop-latency-s", type=float, default=5e-6)
    ap.add_argument("--exposed", type=float, default=1 / 3, help="share of the gradient reduce not hidden")
    ap.add_argument("--fit", choices=FITS, default="dp4",
                    help="the measured DP step that fixes the DP overhead: dp4 (4 x H200, one launcher, "
                         "2026-11-27) or dp2 (2 x H100, two launchers, 2026-11-25)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = table([int(g) for g in a.gpus.split(",")], a)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    m = machine(a.fit)
    one = 32768 / m["t1"]
    intra = a.nvlink_gbs * 1e9
    print(f"fit {a.fit}: 1 GPU (global batch 32) {one:,.0f} tokens/s = micro batch {m['t_mb'] * 1e3:.1f} ms "
          f"+ per-step {m['t_fixed'] * 1e3:.1f} ms")
    for f in FITS:
        print(f"  DP overhead besides the transfer, {f}: "
              f"{dp_overhead(f, intra, a.hop_latency_s, a.exposed) * 1e3:+.1f} ms per step")
    print()
    print("| GPUs | DP + distributed optimizer | DP, plain DDP | TP2+SP x DP |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['dp_distopt']:,.0f} ({r['dp_distopt'] / one:.2f}) | "
              f"{r['dp_ddp']:,.0f} ({r['dp_ddp'] / one:.2f}) | {r['tp2_dp']:,.0f} ({r['tp2_dp'] / one:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
