"""One metrics format for every training path: ``metrics.csv`` plus TensorBoard.

Columns: ``step, loss, lr, tokens_per_s, grad_norm, segment, n_layer_01 .. n_layer_NN``
(the n columns only for SSA models). ``segment`` counts launches: a resumed run appends
with the next number, so the compare tool can tell a resume from a continuous run even
when the resume starts exactly after the last logged step. TensorBoard tags follow NeMo: ``reduced_train_loss``,
``lr``, ``tokens_per_s``, ``ssa/n/layer_XX``. The NeMo callback and the CPU loop both
write through this class, so the compare tool reads one format.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Dict, Optional

TB_LOSS_TAG = "reduced_train_loss"
#: the held-out loss per evaluation (step, val_loss): the split no step trains on
HELDOUT_CSV = "heldout.csv"


def append_heldout(run_dir: str, step: int, val_loss: float) -> str:
    """Append one held-out evaluation to ``run_dir/heldout.csv`` (header on first write).
    Written by the NeMo callback and by the CPU loop, read by the study."""
    path = os.path.join(run_dir, HELDOUT_CSV)
    new = not os.path.isfile(path)
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "a", newline="") as f:
        if new:
            f.write("step,val_loss\n")
        f.write(f"{int(step)},{float(val_loss):.6g}\n")
    return path


class MetricsWriter:
    def __init__(self, run_dir: str, append: bool = False, tensorboard: bool = True,
                 csv_name: str = "metrics.csv", tb_subdir: str = "tb"):
        os.makedirs(run_dir, exist_ok=True)
        self.csv_path = os.path.join(run_dir, csv_name)
        self._append = append and os.path.exists(self.csv_path)
        self._file = None
        self._writer = None
        self._columns = None
        self._tb = None
        self.segment = 1
        if self._append:
            with open(self.csv_path, newline="") as f:
                last = None
                for last in csv.DictReader(f):
                    pass
            try:
                self.segment = int((last or {}).get("segment") or 0) + 1
            except ValueError:
                self.segment = 2
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, tb_subdir))

    def write(self, step: int, loss: float, lr: float, tokens_per_s: float,
              grad_norm: float = math.nan, ssa_n: Optional[Dict[int, float]] = None) -> None:
        row = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm,
               "segment": self.segment}
        for layer, value in sorted((ssa_n or {}).items()):
            row[f"n_layer_{layer:02d}"] = value
        if self._writer is None:
            self._columns = list(row)
            if self._append:
                with open(self.csv_path) as f:
                    header = next(csv.reader(f), None)
                if header:
                    self._columns = header
            self._file = open(self.csv_path, "a" if self._append else "w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=self._columns, extrasaction="ignore")
            if not self._append:
                self._writer.writeheader()
        self._writer.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in row.items()})
        self._file.flush()
        if self._tb is not None:
            self._tb.add_scalar(TB_LOSS_TAG, loss, step)
            self._tb.add_scalar("lr", lr, step)
            self._tb.add_scalar("tokens_per_s", tokens_per_s, step)
            for layer, value in sorted((ssa_n or {}).items()):
                self._tb.add_scalar(f"ssa/n/layer_{layer:02d}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device-name substring, for MFU.
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0))


def device_peak_tflops(name: str) -> Optional[float]:
    """Dense bf16 peak of the named GPU (``torch.cuda.get_device_name()``), or None if unknown."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key in (name or ""):
            return peak
    return None


def flops_per_token(hidden: int, layers: int, ffn: int, kv_channels: int, query_groups: int,
                    vocab: int, seq: int) -> float:
    """Model FLOPs per trained token (fwd + bwd = 3 x fwd), the MFU numerator.

    ``6 * (matmul params incl. the output layer) + 6 * layers * seq * hidden``: a matmul
    with P parameters costs 2P FLOPs per token forward and 4P backward; attention's scores
    and PV are ``2 * 2 * seq * hidden`` per token and layer forward, halved by the causal
    mask, times 3 for fwd+bwd. Matmul params per layer: QKV ``h * (h + 2 * kv)``
    (``kv = kv_channels * query_groups``), output projection ``h * h``, squared-ReLU MLP
    ``2 * h * ffn`` (no gate). Embedding lookups and norms are not counted (as in PaLM's
    MFU); the tied output layer is, once.
    """
    kv = kv_channels * query_groups
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 2 * hidden * ffn
    return 6.0 * (layers * per_layer + hidden * vocab) + 6.0 * layers * seq * hidden


def rank_layout() -> dict:
    """This process's place in the run: global rank and world size (torch.distributed, else
    the launcher's RANK/WORLD_SIZE), and megatron's tensor/context/data-parallel rank and
    size where its parallel state exists (else rank 0 of 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = {"rank": rank, "world_size": world, "tp_rank": 0, "tp_size": 1, "cp_rank": 0, "cp_size": 1,
           "dp_rank": 0, "dp_size": 1}
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            out.update(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                       cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
                       dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())
    except ImportError:
        pass
    return out


def write_rank_file(run_dir: str, layout: Dict[str, Any], step: int, ssa: Dict[str, Dict[int, float]]) -> str:
    """``<run_dir>/ranks/rank_RRRRR.json``: this rank's layout (:func:`rank_layout`), the
    step, and its own SSA n and b per layer as exact ``float.hex`` strings. Every rank
    writes one at the end of a run (NeMo callback and CPU loop alike), so agreement of n
    across tensor-parallel ranks is checked bit for bit from files (``scripts/device/two_gpu.py``)."""
    record = dict(layout, step=int(step),
                  n={str(layer): float(v).hex() for layer, v in sorted(ssa.get("n", {}).items())},
                  b={str(layer): float(v).hex() for layer, v in sorted(ssa.get("b", {}).items())})
    path = os.path.join(run_dir, "ranks", f"rank_{int(layout.get('rank', 0)):05d}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return path
