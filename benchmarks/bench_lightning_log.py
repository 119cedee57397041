"""Host time of NeMo's per-step ``self.log`` calls, Lightning's ``_ResultMetric.to`` against
``nemo_ssa.nemo.lightning_log``'s, alternated in one process.

NeMo's step logs seven values through Lightning's result collection (``global_step``,
``step``, ``reduced_train_loss``, ``lr``, ``consumed_samples``, ``global_batch_size``,
``grad_norm``), each a 0-dim tensor on the model's device; this replays that pattern on one
``_ResultCollection`` for ``--steps`` steps per round, ``--rounds`` rounds per variant, the
variants alternating, and prints microseconds per step and per call (the minimum over rounds
and the median) and their ratio. ``--device cuda`` logs CUDA tensors (the collection's metrics
then live on the GPU, as in a NeMo run)::

    python benchmarks/bench_lightning_log.py                 # CPU tensors
    python benchmarks/bench_lightning_log.py --device cuda   # on a GPU machine
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

KEYS = ("global_step", "step", "reduced_train_loss", "lr", "consumed_samples", "global_batch_size", "grad_norm")


def one_round(steps: int, device: torch.device) -> float:
    """Seconds per step of NeMo's seven logs on a fresh collection (after one warm step)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    rc = _ResultCollection(training=True)
    values = [torch.tensor(float(i), device=device) for i in range(len(KEYS))]

    def step():
        for key, value in zip(KEYS, values):
            rc.log("training_step", key, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    from nemo_ssa.nemo import lightning_log

    device = torch.device(args.device)
    times = {"lightning": [], "nemo_ssa": []}
    for rnd in range(args.rounds):
        for variant in (("lightning", "nemo_ssa") if rnd % 2 == 0 else ("nemo_ssa", "lightning")):
            if variant == "nemo_ssa":
                why = lightning_log.install()
                if why is not None:
                    raise SystemExit(f"[bench_lightning_log] not installed: {why}")
            try:
                times[variant].append(one_round(args.steps, device))
            finally:
                lightning_log.uninstall()
    import lightning

    print(f"| variant | us per step (min / median of {args.rounds}) | us per self.log | vs lightning |")
    print("|---|---|---|---|")
    base = min(times["lightning"])
    for variant, ts in times.items():
        lo, med = min(ts) * 1e6, statistics.median(ts) * 1e6
        print(f"| {variant} | {lo:,.0f} / {med:,.0f} | {lo / len(KEYS):,.1f} | {base / min(ts):.2f}x |")
    print(f"\n{len(KEYS)} logs a step, {args.steps} steps a round, device {device}, lightning {lightning.__version__}, "
          f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
