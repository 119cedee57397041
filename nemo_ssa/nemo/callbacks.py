"""Lightning callbacks for NeMo runs: our metrics log, the RNG-safe attention warm-up, the run's
seed for the weights and the RNG tracker megatron's local CUDA graphs need."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from nemo_ssa.tools.metrics_log import MetricsWriter, TB_LOSS_TAG, append_heldout, rank_layout, write_rank_file
from nemo_ssa.train.rng import preserved_rng

#: the held-out loss per validation, beside metrics.csv (scripts/study.py reads it)


def _unwrap(pl_module):
    # NeMo's GPTModel holds the megatron model as ``module`` (possibly DDP/Float16 wrapped)
    return getattr(pl_module, "module", pl_module)


def _step_loss(outputs: Any, trainer) -> Optional[torch.Tensor]:
    """The step's reduced training loss from what the step returned, or None where it is not there.

    NeMo's strategy returns the reduced loss and logs the same tensor as ``reduced_train_loss``;
    Lightning hands it to ``on_train_batch_end`` as ``outputs["loss"]`` (divided by
    ``accumulate_grad_batches``, which NeMo keeps at 1: megatron accumulates). Reading it here
    instead of ``trainer.callback_metrics`` spares every step Lightning's metric assembly, which
    turns each progress-bar metric into a Python number (a device sync each)."""
    if getattr(trainer, "accumulate_grad_batches", 1) != 1:
        return None
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss if isinstance(loss, torch.Tensor) and loss.numel() >= 1 else None


class _DeviceMarks:
    """Points on the device's timeline: CUDA events on a GPU, the host's clock without one.

    A block of rows is closed by a mark recorded after its steps' work; its values are copied to
    pinned host memory behind the same mark and read once the device has passed it, so no read
    waits for the launch queue to drain (a blocking read there left the GPU idle while the host
    refilled the queue after it). The block's rate is the device time between two marks. On the
    CPU every value is ready when the host has it: the marks are ``time.time()`` and always done."""

    def __init__(self, cuda: bool):
        self.cuda = bool(cuda)

    def mark(self):
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark) -> bool:
        return mark.query() if self.cuda else True

    def wait(self, mark) -> None:
        if self.cuda:
            mark.synchronize()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def to_host(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat``'s values on the host once the next mark is done (a copy enqueued, not waited for)."""
        if not flat.is_cuda:
            return flat
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        return host


class MetricsCallback(Callback):
    """Writes ``metrics.csv`` (+ TensorBoard under ``run_dir/tb``): one row per step.

    Columns: step, loss (``reduced_train_loss``), lr, tokens/s, grad_norm (the total norm before
    clipping, from the sync-free step; NaN where that is off), n per layer
    (SSA models). No per-step host sync: each step keeps the loss and every layer's n on
    the device (one small concatenation). Every ``flush_every`` steps (the trainer's
    ``log_every_n_steps``) the block is closed: its values are copied to pinned host memory
    behind a CUDA event (``_DeviceMarks``), and its rows are written at the first batch end
    that finds the device past that event -- no read waits for the device, so the GPU's queue
    never drains for the log (the host runs ahead of the device: the sync-free step,
    nemo_ssa.megatron.sync_free, reads nothing either). At each checkpoint save and at the end
    every open block is closed and waited for. tokens/s is the block's tokens over the device
    time between its events (less the device time between the marks at validation's start and
    end) -- a step's own host time is not the rate the device kept. Each row carries its
    block's rate; the steady rate is the median over the blocks after the first 10 steps. The loss is the step's own output (``_step_loss``), not
    ``trainer.callback_metrics``. n per layer also goes to the trainer's loggers
    (``ssa/n/layer_XX``) at flush steps. At the end, ``summary.json`` records the
    steady-state tokens/s (median over steps after the first 10), MFU (model FLOPs per
    token x tokens/s / the GPU's dense bf16 peak; ``nemo_ssa.tools.metrics_log.flops_per_token``
    documents the formula), peak GPU memory and the losses. ``progress=True`` (the launcher's
    choice: it turns Lightning's progress bar off) prints a line per flush, ``[train] step S/M |
    loss | lr | grad norm | tokens/s (the block's rate) | n range``, and one per held-out loss, from the
    values the flush reads anyway: NeMo's progress printer assembles every progress-bar metric
    (a device sync each) on every step.

    Several ranks: global rank 0 alone writes ``metrics.csv``, TensorBoard and
    ``summary.json`` (the loss it logs is already reduced over the data-parallel ranks);
    other ranks record nothing per step. At the end *every* rank writes
    ``ranks/rank_RRRRR.json``: its layout (:func:`rank_layout`) and its own n and b per
    layer, as exact ``float.hex`` strings, so that "n is identical on every TP rank" is
    checked bit for bit (``scripts/device/two_gpu.py check``).
    """

    def __init__(self, run_dir: str, seq_length: int, global_batch_size: int, attention: str,
                 flush_every: int = 10, flops_per_token: Optional[float] = None, progress: bool = False):
        self.run_dir = run_dir
        self.progress = bool(progress)
        self._max_steps = None
        self.tokens_per_step = seq_length * global_batch_size
        self.attention = attention
        self.flush_every = max(1, int(flush_every))
        self.flops_per_token = flops_per_token
        self._writer: Optional[MetricsWriter] = None
        self._marks = _DeviceMarks(False)
        self._start = None  # the mark the open block's time runs from (the last block's end)
        self._val_start = None
        self._excluded = []  # (start, end) marks of the validations inside the open block
        self._closed = []  # blocks closed, not yet written: (rows, host values, start, end, excluded)
        self._rates = []  # (first step of the block, tokens/s of the block)
        self._losses = {}
        self._pending = []  # (step, loss tensor | float, lr, n tensor | None)
        self._ssa = []
        self._layout = {"rank": 0, "world_size": 1}
        self._main = True

    def on_train_start(self, trainer, pl_module):
        from nemo_ssa.megatron.introspect import ssa_modules

        self._layout = rank_layout()
        self._main = self._layout["rank"] == 0
        self._writer = MetricsWriter(self.run_dir, append=trainer.global_step > 0) if self._main else None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._ssa = ssa_modules(_unwrap(pl_module))
        self._marks = _DeviceMarks(torch.cuda.is_available())
        self._start = self._marks.mark()

    def on_validation_start(self, trainer, pl_module):
        if self._main:
            self._val_start = self._marks.mark()

    def on_validation_end(self, trainer, pl_module):
        if self._main and self._val_start is not None and not getattr(trainer, "sanity_checking", False):
            self._excluded.append((self._val_start, self._marks.mark()))
        self._val_start = None
        self._validation_end(trainer)

    def _validation_end(self, trainer):
        """The held-out loss (NeMo's ``val_loss`` on the data module's validation split, which
        no step trains on) -> ``heldout.csv`` (step, val_loss), global rank 0 only."""
        if not self._main or getattr(trainer, "sanity_checking", False):
            return
        val = trainer.callback_metrics.get("val_loss")
        if val is None:
            return
        append_heldout(self.run_dir, trainer.global_step, float(val))
        if self.progress:
            print(f"[train] step {trainer.global_step}: held-out loss {float(val):.4f}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self._main:
            return
        step = trainer.global_step
        self._max_steps = trainer.max_steps
        loss = _step_loss(outputs, trainer)
        if loss is None:
            loss = trainer.callback_metrics.get(TB_LOSS_TAG)
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(-1)[:1].clone()
        else:
            loss = float(loss) if loss is not None else float("nan")
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
        n_now = torch.cat([m.n.detach().float().reshape(-1)[:1] for _, m in self._ssa]) if self._ssa else None
        self._pending.append((step, loss, float(lr), n_now, _step_grad_norm()))
        if step >= trainer.max_steps:
            self._flush(trainer)  # the run ends here: its last rows and progress line now
            return
        if len(self._pending) >= self.flush_every:
            self._close()
        # rows of the blocks the device has passed; a block more than two behind is waited for
        # (the device is then still busy with the later ones: the wait drains nothing)
        self._write_closed(trainer, wait_all=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # a run killed after this checkpoint resumes at the step after it: the rows up to it are
        # written now, or the resumed curve would lack the block that was still open (with a
        # checkpoint cadence that is not a multiple of the flush's); the save itself waits for
        # the device, so the wait adds none of its own
        if self._main:
            self._flush(trainer)

    def _flush(self, trainer=None):
        """Close the open block and write every closed one, waiting for the device."""
        self._close()
        self._write_closed(trainer, wait_all=True)

    def _close(self):
        """End the open block: its values copied to the host behind a mark, read later."""
        if not self._pending:
            return
        # one copy for the whole block: losses, n values and grad norms stacked on the device
        tensors = [t for row in self._pending for t in (row[1], row[3], row[4]) if isinstance(t, torch.Tensor)]
        flat = torch.cat([t.reshape(-1).float().to(tensors[0].device) for t in tensors]) if tensors else None
        host = self._marks.to_host(flat) if flat is not None else None
        end = self._marks.mark()
        self._closed.append((self._pending, host, self._start, end, self._excluded))
        self._pending, self._start, self._excluded = [], end, []

    def _write_closed(self, trainer, wait_all: bool):
        while self._closed:
            end = self._closed[0][3]
            if not (wait_all or len(self._closed) > 2 or self._marks.done(end)):
                return
            self._marks.wait(end)
            self._write_block(trainer, *self._closed.pop(0))

    def _write_block(self, trainer, rows, host, start, end, excluded):
        flat = host.tolist() if host is not None else []
        seconds = (self._marks.seconds(start, end) - sum(self._marks.seconds(a, b) for a, b in excluded)
                   if start is not None else float("nan"))
        rate = self.tokens_per_step * len(rows) / seconds if seconds > 0 else float("nan")
        self._rates.append((rows[0][0], rate))
        pos = 0
        layers = [layer for layer, _ in self._ssa]
        last_n = {}
        for step, loss, lr, n_now, grad_norm in rows:
            if isinstance(loss, torch.Tensor):
                loss, pos = flat[pos], pos + 1
            n_vals = {}
            if isinstance(n_now, torch.Tensor):
                n_vals = dict(zip(layers, flat[pos:pos + len(layers)]))
                pos += len(layers)
            if isinstance(grad_norm, torch.Tensor):
                grad_norm, pos = flat[pos], pos + 1
            self._losses[step] = loss
            last_n = n_vals
            if self._writer is not None:
                self._writer.write(step=step, loss=loss, lr=lr, tokens_per_s=rate, grad_norm=grad_norm,
                                   ssa_n=n_vals)
        if self.progress and trainer is not None:
            n = f" | n {min(last_n.values()):.3f}-{max(last_n.values()):.3f}" if last_n else ""
            g = f" | grad norm {grad_norm:.3f}" if grad_norm == grad_norm else ""
            print(f"[train] step {step}/{self._max_steps} | loss {loss:.4f} | lr {lr:.3e}{g} | {rate:,.0f} tokens/s"
                  f"{n}", flush=True)
        if trainer is not None and last_n:
            # straight to the trainer's loggers (NeMo's TensorBoard, a user's W&B): pl_module.log
            # would route each value through Lightning's result collection, a walk over the
            # metric's attributes per call that the host-bound step pays for
            metrics = {f"ssa/n/layer_{layer:02d}": value for layer, value in last_n.items()}
            for logger in getattr(trainer, "loggers", None) or []:
                logger.log_metrics(metrics, step=step)

    def _steady_rate(self):
        steady = sorted(r for first, r in self._rates if r == r and first > 10) or \
            sorted(r for _, r in self._rates if r == r)
        return steady[len(steady) // 2] if steady else None

    def on_train_end(self, trainer, pl_module):
        self._flush(None)
        if self._writer is not None:
            self._writer.close()
        from nemo_ssa.megatron.introspect import ssa_modules
        from nemo_ssa.tools.metrics_log import device_peak_tflops

        # one device-to-host read for every layer's n and b, for the rank file and the summary
        mods = ssa_modules(_unwrap(pl_module))
        vals = torch.cat([t.detach().float().reshape(-1)[:1] for _, m in mods for t in (m.n, m.b)]).tolist() \
            if mods else []
        ssa = {"n": {layer: vals[2 * i] for i, (layer, _) in enumerate(mods)},
               "b": {layer: vals[2 * i + 1] for i, (layer, _) in enumerate(mods)}}
        write_rank_file(self.run_dir, self._layout, trainer.global_step, ssa)
        if not self._main:
            return
        rate = self._steady_rate()
        cuda = torch.cuda.is_available()
        name = torch.cuda.get_device_name() if cuda else "cpu"
        peak = device_peak_tflops(name)
        mfu = (self.flops_per_token * rate / (peak * 1e12)) if (self.flops_per_token and rate and peak) else None
        summary = {
            "attention": self.attention,
            "steps": trainer.global_step,
            "tokens_per_s_median": rate,
            "mfu": mfu,
            "flops_per_token": self.flops_per_token,
            "peak_tflops_bf16": peak,
            "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
            "device": name,
            "cuda_graphs_captured": _graphs_created(),
            "layout": {k: v for k, v in self._layout.items() if k.endswith("size")},
            "ssa_n": ssa["n"],
            "ssa_b": ssa["b"],
            "loss": {str(k): v for k, v in sorted(self._losses.items())},
        }
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        mem = summary["peak_memory_gib"]
        print(f"[metrics] {self.attention}: {rate or float('nan'):,.0f} tokens/s (median), "
              f"MFU {100 * mfu:.1f} %" if mfu else f"[metrics] {self.attention}: {rate or float('nan'):,.0f} tokens/s",
              f"peak memory {mem:.1f} GiB" if mem else "", flush=True)
        if mfu:  # what the percentage is of (docs/training-step.md, "MFU")
            print(f"[metrics] MFU = {self.flops_per_token / 1e6:.1f} MFLOP per token (6 x matmul parameters + "
                  f"causal attention, fwd+bwd) x tokens/s / {peak:.0f} TFLOP/s ({name}, dense bf16)", flush=True)

def _step_grad_norm():
    """The step's total gradient norm before clipping, as megatron's optimizer returned it to
    the sync-free step's wrapper (``nemo_ssa.megatron.sync_free``): a device tensor, copied so
    the next step cannot overwrite it before the flush reads it; NaN where that wrapper is off
    (NeMo logs the same number to its own loggers as ``grad_norm``, with a read per step)."""
    from nemo_ssa.megatron.sync_free import GUARD

    norm, GUARD.grad_norm = GUARD.grad_norm, None
    if isinstance(norm, torch.Tensor):
        return norm.detach().reshape(-1)[:1].float().clone()
    return float(norm) if isinstance(norm, (int, float)) else float("nan")


def _graphs_created() -> bool:
    """megatron captured the layers' CUDA graphs in this run (model.cuda_graphs=local did what
    it says; a run's tokens/s and losses alone cannot show it)."""
    from nemo_ssa.megatron.cuda_graphs import graphs_created

    return graphs_created()


class AttentionWarmupCallback(Callback):
    """Warm the core attentions up before step 0 without changing the run.

    Compiles/autotunes fused kernels on random inputs of the training shape, then
    restores every RNG state (python, numpy, torch CPU/CUDA, megatron's tracker).
    """

    def __init__(self, micro_batch_size: int, seq_length: int, restore_rng: bool = True):
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.restore_rng = restore_rng

    def on_train_start(self, trainer, pl_module: Any):
        from nemo_ssa.train.warmup import warmup_attention

        if trainer.global_step > 0:
            return  # resumed: the run's RNG state came from the checkpoint
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        tokens = torch.zeros(self.micro_batch_size, self.seq_length, dtype=torch.long, device=device)
        with preserved_rng(self.restore_rng):
            warmup_attention(_unwrap(pl_module), {"tokens": tokens})


#: the seed NeMo's strategy gives every generator (``init_parallel_ranks``' default; nothing
#: in NeMo's trainer passes a run's seed there)
NEMO_DEFAULT_SEED = 1234


def seed_like_nemo(seed: int) -> None:
    """Python's, numpy's and torch's generators and megatron's CUDA RNG tracker seeded with
    ``seed`` as NeMo's strategy seeds them (``seed + 100 x`` the pipeline rank; megatron's
    ``model_parallel_cuda_manual_seed`` derives the tensor-parallel streams from it)."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    s = int(seed) + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    if torch.cuda.device_count() > 0:
        tensor_parallel.model_parallel_cuda_manual_seed(s)


class SeedCallback(Callback):
    """The run's ``seed`` for the weights on NeMo's path.

    NeMo seeds Python, numpy, torch and megatron's tracker in the strategy's environment
    set-up, always with 1234: without this callback every NeMo run starts from the same
    weights whatever its seed, and the seed changes only the data order. Lightning calls
    ``setup`` after that seeding and before ``configure_model`` builds the model: here the
    same generators are seeded again with the run's seed, the way NeMo does it. At NeMo's own
    1234 nothing is done, so those runs keep their bits. Runs before an order of callbacks
    that puts it first (``recipes.nemotron_114m.apply_seed``): the CUDA graph callback keeps
    the tracker's streams, so it must see the run's."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.seed != NEMO_DEFAULT_SEED:
            seed_like_nemo(self.seed)
            # the start-up log is where a run shows which weights it began from
            if getattr(trainer, "global_rank", 0) == 0:
                print(f"[seed] weights seeded with {self.seed} (NeMo's strategy seeded {NEMO_DEFAULT_SEED})",
                      flush=True)


class ResumeCadenceCallback(Callback):
    """Validation and the last step where they were before a resume from a mid-step checkpoint.

    NeMo's checkpoints every ``ckpt_every_n_steps`` are saved in ``on_train_batch_end``, before
    Lightning counts the batch completed: the checkpoint holds ``completed = global_step - 1``.
    A run resumed from it has Lightning's batch index one behind the step (Lightning 2.4), so
    the validation cadence runs one step late (held-out at 1751, 1876, ... instead of 1875,
    2000, ...) and the validation at ``max_steps`` never runs -- a study resumed at step 1750
    lost its final held-out loss that way. Training itself is untouched (NeMo's sampler resumes
    from the consumed samples and the schedule from the step). Lightning calls
    ``on_train_start`` after restoring and before the epoch loop resets its counters: here the
    one uncounted batch is counted, and Lightning then runs the validation the checkpoint was
    taken before (a repeat where the killed run had already run it; ``heldout.csv`` keeps the
    later row)."""

    def on_train_start(self, trainer, pl_module) -> None:
        loop = trainer.fit_loop.epoch_loop
        progress = loop.batch_progress
        step = trainer.global_step
        if not (loop.restarting and step > 0 and trainer.accumulate_grad_batches == 1):
            return
        for p in (progress.total, progress.current):
            if p.ready == step and p.completed == step - 1:
                p.completed = step


class CudaGraphRNGCallback(Callback):
    """megatron-core's local CUDA graphs in NeMo's trainer (``model.cuda_graphs=local``): the
    cudagraphable RNG tracker, before the model is built.

    NeMo seeds megatron's tracker in the strategy's environment set-up, without the
    cudagraphable variant megatron's ``CudaGraphManager`` asserts when a layer is built.
    Lightning calls ``setup`` after that and before ``configure_model``: here the tracker is
    swapped for the cudagraphable one with the same streams
    (``nemo_ssa.megatron.cuda_graphs.use_cudagraphable_rng_tracker``), so the weights start as
    they would without graphs. The rest is megatron's: the config fields the recipe set, and
    ``create_cudagraphs()``, which the schedule NeMo's step runs calls after each fwd+bwd.
    With ``model.cuda_graphs=full`` it also arms NeMo's whole-iteration switch
    (``nemo_ssa.megatron.cuda_graphs.arm_full_iteration``), whose static input buffers then take
    each batch only after the queued work (``order_static_buffer_copies``: megatron < 0.17 raced).
    """

    def setup(self, trainer, pl_module, stage: str) -> None:
        from nemo_ssa.megatron.cuda_graphs import (arm_full_iteration, order_static_buffer_copies,
                                                   use_cudagraphable_rng_tracker)

        use_cudagraphable_rng_tracker()
        # model.cuda_graphs=full: the strategy has re-run the config's __post_init__ by now
        # (Lightning calls setup after strategy.connect), so NeMo's flag can go on
        config = getattr(pl_module, "config", None)
        if config is not None and arm_full_iteration(config) and getattr(trainer, "global_rank", 0) == 0:
            print("[nemo_ssa] CUDA graphs: megatron's whole-iteration graph (FullCudaGraphWrapper), captured "
                  f"at the second training step; {order_static_buffer_copies()}", flush=True)


class SyncFreeLossReductionCallback(Callback):
    """The training loss reduced without a host read (``nemo_ssa.nemo.loss_reduction``): set on
    the model in ``setup``, before the first step; a model with its own reduction keeps it."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        from nemo_ssa.nemo.loss_reduction import install

        install(pl_module)


class LightningLogCallback(Callback):
    """Lightning's ``self.log`` without its per-call walk over a metric already on the value's
    device, and with ``progress_bar_values="drop"`` -- when the trainer has no progress bar --
    without the progress-bar values, which Lightning reads from the device at the end of every
    batch for a bar that is not there (``nemo_ssa.nemo.lightning_log``): installed in ``setup``,
    taken out in ``teardown``; global rank 0 prints what it decided.

    ``progress_bar_values``: ``drop`` (the default; with a progress bar the values stay as
    Lightning logs them, the bar reads them) or ``keep`` (Lightning's per-batch read, one device
    sync a step). ``drop`` lets the host run ahead of the GPU, which uncovered a race in
    megatron < 0.17's whole-iteration graph (fixed: ``order_static_buffer_copies``); its
    1,000-step loss sits inside keep's rerun spread (docs/results/2026-12-03-pbar-sync)."""

    def __init__(self, progress_bar_values: str = "drop"):
        from nemo_ssa.config.check import PROGRESS_BAR_VALUES

        value = str(progress_bar_values).lower()
        if value not in PROGRESS_BAR_VALUES:
            raise ValueError(f"train.progress_bar_values={progress_bar_values!r} is not supported "
                             f"(supported: {', '.join(PROGRESS_BAR_VALUES)})")
        self.progress_bar_values = value

    def setup(self, trainer, pl_module, stage: str) -> None:
        from nemo_ssa.nemo import lightning_log

        why = lightning_log.install()
        if self.progress_bar_values == "keep":
            bar = ("as Lightning logs them: read from the device at every batch's end, one sync a step "
                   "(train.progress_bar_values=drop removes it where no progress bar is shown)")
        elif getattr(trainer, "progress_bar_callback", None) is not None:
            bar = "as Lightning logs them: the progress bar reads them (one device read a step)"
        else:
            why_bar = lightning_log.install_progress_bar_off()
            bar = ("logged without prog_bar (train.progress_bar_values=drop: no progress bar reads them; Lightning "
                   "would read each from the device at every batch's end)" if why_bar is None
                   else f"as Lightning logs them ({why_bar})")
        if getattr(trainer, "global_rank", 0) == 0:
            print("[nemo_ssa] Lightning's self.log: " + ("a metric already on the value's device is not walked"
                                                          if why is None else f"as Lightning does it ({why})")
                  + "; progress-bar values " + bar, flush=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        from nemo_ssa.nemo import lightning_log

        lightning_log.uninstall()


class StopAfterCallback(Callback):
    """Stop training after global step ``step`` (a planned interruption for resume checks).

    The LR schedule still spans ``max_steps``; a later ``resume=true`` launch continues it.
    """

    def __init__(self, step: int):
        if step < 1:
            raise ValueError(f"stop_after must be >= 1, got {step}")
        self.step = int(step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class ProfilerCallback(Callback):
    """torch.profiler over ``num_steps`` training steps from global step ``start``.

    Writes ``<run_dir>/profile/``: ``trace.json.gz`` (chrome://tracing / Perfetto; CPU ops,
    CUDA kernels and, with ``with_stack``, Python frames), ``summary.txt`` (ops by self
    CPU time and by CUDA time) and ``where.md`` (the steps' device time by module, forward and
    backward, and by kernel family: nemo_ssa.tools.step_profile; time outside every module --
    the optimizer, the loss reduction -- is the ``other`` row). ``python -m nemo_ssa.tools.profile_summary <trace>`` turns a trace
    into per-step wall time, GPU-busy time and the host functions that leave the GPU idle.
    Enable from the launcher with ``profile.start=40`` (``profile.steps``, ``profile.with_stack``).

    ``module_ranges=False`` (the launcher's choice under ``model.cuda_graphs=local``): no module
    table. The ranges are forward pre-hooks, which megatron refuses on a graphed layer; the
    kernel families, the ops outside modules and the trace -- the host gaps between graph
    replays -- are what such a step is profiled for.
    """

    def __init__(self, run_dir: str, start: int, num_steps: int = 2, with_stack: bool = True,
                 module_ranges: bool = True):
        if start < 1 or num_steps < 1:
            raise ValueError(f"profile: start ({start}) and steps ({num_steps}) must be >= 1")
        self.out = os.path.join(run_dir, "profile")
        self.start, self.num_steps, self.with_stack = int(start), int(num_steps), bool(with_stack)
        self.module_ranges = bool(module_ranges)
        self._prof = None
        self._ranges = None
        self._profiled = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._prof is None and trainer.global_step == self.start:
            from torch.profiler import ProfilerActivity, profile

            from contextlib import nullcontext

            from nemo_ssa.tools.step_profile import module_ranges

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._ranges = module_ranges(pl_module) if self.module_ranges else nullcontext()
            self._ranges.__enter__()
            self._prof = profile(activities=acts, with_stack=self.with_stack, record_shapes=False)
            self._prof.__enter__()
        if self._prof is not None:
            self._profiled += 1
            self._step_ctx = torch.profiler.record_function(f"ProfilerStep#{trainer.global_step}")
            self._step_ctx.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._prof is None:
            return
        self._step_ctx.__exit__(None, None, None)
        if trainer.global_step >= self.start + self.num_steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            self._ranges.__exit__(None, None, None)
            os.makedirs(self.out, exist_ok=True)
            self._write_where(prof.events())
            prof.export_chrome_trace(os.path.join(self.out, "trace.json.gz"))
            with open(os.path.join(self.out, "summary.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
                if torch.cuda.is_available():
                    f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40) + "\n")
            print(f"[profile] steps {self.start}..{self.start + self.num_steps - 1}: {self.out}", flush=True)

    def _write_where(self, events) -> None:
        from nemo_ssa.tools import step_profile as sp

        device = torch.cuda.is_available()
        what = "device" if device else "CPU"
        with open(os.path.join(self.out, "where.md"), "w") as f:
            modules = (sp.table(sp.by_module(events, device=device), "module", self._profiled) if self.module_ranges
                       else "No module table: the layers replay as CUDA graphs (model.cuda_graphs=local or full), "
                            "and the module ranges are forward pre-hooks, which megatron refuses on a graphed layer. "
                            "The tables below hold the kernels launched outside the graphs only (a graph's kernels "
                            "belong to no op); every kernel, by time: `python -m nemo_ssa.tools.profile_summary "
                            "trace.json.gz`.")
            f.write(f"# Where the step goes: {what} time per step over {self._profiled} profiled steps\n\n"
                    + modules + "\n\n"
                    + sp.table(sp.by_family(events, device=device), "kernel family", self._profiled) + "\n\n"
                    + "What the rows without a module hold:\n\n"
                    + sp.top_ops_table(sp.top_ops(events, device=device), self._profiled) + "\n")
            if device:
                f.write("\nThe largest kernels:\n\n"
                        + sp.top_kernels_table(sp.top_kernels(events), self._profiled) + "\n")
