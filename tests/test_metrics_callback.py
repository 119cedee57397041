"""MetricsCallback: one row per step, values read back only at flush steps, MFU in the summary."""

import csv
import json
import time
import types

import pytest
import torch

from nemo_ssa.megatron.core_attention import SSAScalars
from nemo_ssa.megatron.sync_free import GUARD
from nemo_ssa.tools.metrics_log import TB_LOSS_TAG, device_peak_tflops, flops_per_token
from nemo_ssa.nemo.callbacks import MetricsCallback


class _Attn(torch.nn.Module, SSAScalars):
    def __init__(self, layer):
        super().__init__()
        self.layer_number = layer
        self.n = torch.nn.Parameter(torch.tensor([1.5]))
        self.b = torch.nn.Parameter(torch.tensor([0.8]), requires_grad=False)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(
            [torch.nn.Module() for _ in range(3)])
        for i, layer in enumerate(self.decoder.layers):
            layer.self_attention = torch.nn.Module()
            layer.self_attention.core_attention = _Attn(i + 1)


def test_rows_every_step_flushed_in_blocks(tmp_path, monkeypatch):
    model = _Model()
    logged, via_lightning = [], []
    pl_module = types.SimpleNamespace(module=model, log=lambda *a, **k: via_lightning.append(a))
    opt = types.SimpleNamespace(param_groups=[{"lr": 1e-3}])
    logger = types.SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    trainer = types.SimpleNamespace(global_step=0, max_steps=7, callback_metrics={}, optimizers=[opt],
                                    loggers=[logger])
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="ssa", flush_every=3,
                         flops_per_token=100.0)
    cb.on_train_start(trainer, pl_module)
    reads = []
    orig_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or orig_tolist(self))
    for step in range(1, 8):
        trainer.global_step = step
        trainer.callback_metrics[TB_LOSS_TAG] = torch.tensor(10.0 - step)
        with torch.no_grad():
            for layer in model.decoder.layers:
                layer.self_attention.core_attention.n.add_(0.01)
        # the sync-free step's wrapper leaves megatron's norm as a device tensor; none at step 5
        GUARD.grad_norm = None if step == 5 else torch.tensor(0.25 * step, dtype=torch.float64)
        cb.on_train_batch_end(trainer, pl_module, None, None, step)
        assert GUARD.grad_norm is None  # taken: a later step without a norm cannot log this one's
        rows = list(csv.DictReader(open(tmp_path / "metrics.csv"))) if (tmp_path / "metrics.csv").exists() else []
        assert len(rows) == (step // 3) * 3 + (step == 7) * (7 % 3), (step, len(rows))  # written in blocks
    cb.on_train_end(trainer, pl_module)
    monkeypatch.undo()
    assert len(reads) == 3 + 1  # one read per flush (3, 6, 7) + the final ssa_values read
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    assert [float(r["loss"]) for r in rows] == [10.0 - s for s in range(1, 8)]
    norms = [float(r["grad_norm"]) for r in rows]  # read in the flush's one read (counted above)
    assert norms[:4] + norms[5:] == [0.25 * s for s in (1, 2, 3, 4, 6, 7)] and norms[4] != norms[4]
    # n of every layer at every step (not the value at flush time)
    assert [round(float(r["n_layer_02"]), 6) for r in rows] == [round(1.5 + 0.01 * s, 6) for s in range(1, 8)]
    # the trainer's loggers get every layer's n at each flush (steps 3, 6, 7), the latest value, and
    # nothing goes through pl_module.log (Lightning's result collection costs the host each call)
    assert [step for step, _ in logged] == [3, 6, 7] and not via_lightning
    assert list(logged[-1][1]) == [f"ssa/n/layer_{i:02d}" for i in (1, 2, 3)]
    assert round(logged[-1][1]["ssa/n/layer_02"], 6) == round(1.5 + 0.07, 6)
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["flops_per_token"] == 100.0 and summary["loss"]["7"] == 3.0
    assert summary["mfu"] is None  # no GPU here: no peak, no MFU
    assert summary["cuda_graphs_captured"] is False


def test_flops_formula_and_peaks():
    # the 114M recipe at seq 1024: 6 * (12 * (768 * (768 + 2 * 256) + 768^2 + 2 * 768 * 3072) + 768 * 50304)
    # + 6 * 12 * 1024 * 768
    f = flops_per_token(768, 12, 3072, 32, 8, 50304, 1024)
    per_layer = 768 * (768 + 512) + 768 * 768 + 2 * 768 * 3072
    assert f == 6.0 * (12 * per_layer + 768 * 50304) + 6.0 * 12 * 1024 * 768
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("cpu") is None


def _run(tmp_path, monkeypatch, layout, steps=4):
    import nemo_ssa.nemo.callbacks as cbmod

    monkeypatch.setattr(cbmod, "rank_layout", lambda: dict(layout))
    model = _Model()
    pl_module = types.SimpleNamespace(module=model, log=lambda *a, **k: None)
    opt = types.SimpleNamespace(param_groups=[{"lr": 1e-3}])
    trainer = types.SimpleNamespace(global_step=0, max_steps=steps, callback_metrics={}, optimizers=[opt])
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="ssa", flush_every=2)
    cb.on_train_start(trainer, pl_module)
    for step in range(1, steps + 1):
        trainer.global_step = step
        trainer.callback_metrics[TB_LOSS_TAG] = torch.tensor(5.0)
        with torch.no_grad():
            model.decoder.layers[1].self_attention.core_attention.n.add_(0.1)
        cb.on_train_batch_end(trainer, pl_module, None, None, step)
    cb.on_train_end(trainer, pl_module)
    return model


def test_only_rank0_writes_logs_every_rank_writes_its_n(tmp_path, monkeypatch):
    base = dict(world_size=2, tp_size=2, cp_size=1, dp_size=1, cp_rank=0, dp_rank=0)
    _run(tmp_path, monkeypatch, dict(base, rank=1, tp_rank=1))
    # rank 1: no per-step log, no summary (rank 0 owns them: two writers would interleave rows)
    assert not (tmp_path / "metrics.csv").exists() and not (tmp_path / "summary.json").exists()
    r1 = json.load(open(tmp_path / "ranks" / "rank_00001.json"))
    assert r1["tp_rank"] == 1 and r1["step"] == 4
    assert float.fromhex(r1["n"]["2"]) == torch.tensor([1.5]).add_(0.1).add_(0.1).add_(0.1).add_(0.1).item()
    assert float.fromhex(r1["n"]["1"]) == 1.5 and float.fromhex(r1["b"]["3"]) == torch.tensor([0.8]).item()

    _run(tmp_path, monkeypatch, dict(base, rank=0, tp_rank=0))
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["layout"] == {"world_size": 2, "tp_size": 2, "cp_size": 1, "dp_size": 1}
    r0 = json.load(open(tmp_path / "ranks" / "rank_00000.json"))
    assert r0["n"] == r1["n"]  # same updates on both "ranks": bit-identical hex


def test_rank_layout_without_distributed(monkeypatch):
    from nemo_ssa.nemo.callbacks import rank_layout

    # an earlier test in this process may have left a gloo world / megatron's parallel state up
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    try:
        from megatron.core import parallel_state

        monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    except ImportError:
        pass
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    out = rank_layout()
    assert out["rank"] == 3 and out["world_size"] == 4 and out["tp_size"] == 1


def test_heldout_loss_is_written_per_validation_by_rank0_only(tmp_path):
    from nemo_ssa.nemo.callbacks import MetricsCallback
    from nemo_ssa.tools.metrics_log import HELDOUT_CSV

    cb = MetricsCallback(str(tmp_path), seq_length=8, global_batch_size=2, attention="ssa")
    trainer = types.SimpleNamespace(global_step=0, callback_metrics={}, sanity_checking=True)
    trainer.callback_metrics["val_loss"] = torch.tensor(9.0)
    cb.on_validation_end(trainer, None)  # the sanity check before training: not a measurement
    assert not (tmp_path / HELDOUT_CSV).exists()
    trainer.sanity_checking = False
    for step, val in ((100, 4.5), (200, 4.25)):
        trainer.global_step = step
        trainer.callback_metrics["val_loss"] = torch.tensor(val)
        cb.on_validation_end(trainer, None)
    assert (tmp_path / HELDOUT_CSV).read_text().splitlines() == ["step,val_loss", "100,4.5", "200,4.25"]
    cb._main = False  # another rank
    cb.on_validation_end(trainer, None)
    assert len((tmp_path / HELDOUT_CSV).read_text().splitlines()) == 3


def test_the_mfu_line_says_what_it_is_of(tmp_path, monkeypatch, capsys):
    """The job prints MFU with its definition: model FLOPs per token, the rate, the peak it divides by."""
    import nemo_ssa.tools.metrics_log as ml

    monkeypatch.setattr(ml, "device_peak_tflops", lambda name: 989.0)
    model = _Model()
    pl_module = types.SimpleNamespace(module=model, log=lambda k, v, batch_size: None)
    opt = types.SimpleNamespace(param_groups=[{"lr": 1e-3}])
    trainer = types.SimpleNamespace(global_step=0, max_steps=6, callback_metrics={}, optimizers=[opt])
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="ssa", flush_every=2,
                         flops_per_token=741.4e6)
    cb.on_train_start(trainer, pl_module)
    for step in range(1, 7):
        trainer.global_step = step
        trainer.callback_metrics[TB_LOSS_TAG] = torch.tensor(5.0)
        cb.on_train_batch_end(trainer, pl_module, None, None, step)
    cb.on_train_end(trainer, pl_module)
    out = capsys.readouterr().out
    assert "[metrics] MFU = 741.4 MFLOP per token" in out and "/ 989 TFLOP/s (cpu, dense bf16)" in out, out
    assert json.load(open(tmp_path / "summary.json"))["mfu"] > 0


class _CountingTrainer(types.SimpleNamespace):
    """A trainer whose ``callback_metrics`` counts its reads (Lightning assembles every metric,
    a device sync per progress-bar value, on each)."""

    @property
    def callback_metrics(self):
        self.reads += 1
        return self.metrics


@pytest.mark.parametrize("accumulate, outputs_kind, reads_per_step", [
    (1, "dict", 0), (1, "tensor", 0), (1, None, 1), (2, "dict", 1)])
def test_the_loss_comes_from_the_steps_output(tmp_path, accumulate, outputs_kind, reads_per_step):
    opt = types.SimpleNamespace(param_groups=[{"lr": 1e-3}])
    trainer = _CountingTrainer(global_step=0, max_steps=4, optimizers=[opt], loggers=[], reads=0,
                               accumulate_grad_batches=accumulate, metrics={})
    pl_module = types.SimpleNamespace(module=torch.nn.Linear(1, 1))
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="softmax", flush_every=2)
    cb.on_train_start(trainer, pl_module)
    for step in range(1, 5):
        trainer.global_step = step
        out = torch.tensor(10.0 - step)
        trainer.metrics[TB_LOSS_TAG] = torch.tensor(100.0 + step)  # what callback_metrics would say
        outputs = {"loss": out} if outputs_kind == "dict" else out if outputs_kind == "tensor" else None
        cb.on_train_batch_end(trainer, pl_module, outputs, None, step)
    cb.on_train_end(trainer, pl_module)
    assert trainer.reads == 4 * reads_per_step
    want = [10.0 - s for s in range(1, 5)] if reads_per_step == 0 else [100.0 + s for s in range(1, 5)]
    assert [float(r["loss"]) for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == want


@pytest.mark.filterwarnings("ignore")
def test_lightning_hands_the_step_output_that_was_logged(tmp_path, monkeypatch):
    """The contract ``_step_loss`` rests on, in the installed Lightning: a training_step that logs
    its loss as ``reduced_train_loss`` and returns it (NeMo's strategy does both) gives the
    callback that same value in ``outputs``; the rows equal what callback_metrics held."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.logged = []

        def training_step(self, batch, batch_idx):
            loss = self.lin(batch[0]).pow(2).mean()
            self.log(TB_LOSS_TAG, loss, prog_bar=True, batch_size=1)
            self.logged.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from nemo_ssa.nemo import callbacks

    found = []
    real = callbacks._step_loss
    monkeypatch.setattr(callbacks, "_step_loss", lambda o, t: found.append(real(o, t)) or found[-1])
    torch.manual_seed(0)
    model = Tiny()
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="softmax", flush_every=2)
    trainer = pl.Trainer(max_steps=5, callbacks=[cb], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=2))
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [float(r["loss"]) for r in rows] == pytest.approx(model.logged, rel=1e-7)
    assert len(set(model.logged)) == 5  # the loss moved: the rows are not one repeated value
    assert len(found) == 5 and all(isinstance(t, torch.Tensor) for t in found)  # read from outputs every step


def test_progress_lines_come_from_the_flush(tmp_path, capsys):
    model = _Model()
    opt = types.SimpleNamespace(param_groups=[{"lr": 2.5e-4}])
    trainer = types.SimpleNamespace(global_step=0, max_steps=5, callback_metrics={}, optimizers=[opt], loggers=[],
                                    sanity_checking=False)
    pl_module = types.SimpleNamespace(module=model)
    quiet = MetricsCallback(str(tmp_path / "q"), seq_length=4, global_batch_size=2, attention="ssa", flush_every=2)
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="ssa", flush_every=2,
                         progress=True)
    for c in (quiet, cb):
        c.on_train_start(trainer, pl_module)
    for step in range(1, 6):
        trainer.global_step = step
        for c in (quiet, cb):
            GUARD.grad_norm = torch.tensor(1.5) if step == 4 else None  # a norm at step 4 only
            c.on_train_batch_end(trainer, pl_module, {"loss": torch.tensor(9.0 - step)}, None, step)
    trainer.callback_metrics["val_loss"] = torch.tensor(3.25)
    cb.on_validation_end(trainer, pl_module)
    quiet.on_validation_end(trainer, pl_module)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[train]")]
    assert [ln.split(" |")[0] for ln in lines] == ["[train] step 2/5", "[train] step 4/5", "[train] step 5/5",
                                                   "[train] step 5: held-out loss 3.2500"]
    assert ["| grad norm 1.500 |" in ln for ln in lines[:3]] == [False, True, False]
    assert "loss 5.0000 | lr 2.500e-04 |" in lines[1] and "tokens/s | n 1.500-1.500" in lines[1]


def test_tokens_per_s_is_timed_between_flushes_less_validation(tmp_path, monkeypatch):
    """The host may run steps ahead of the device (no read per step): a step's own host time is
    not the device's rate. The rate is the block's tokens over the wall time between the flush
    reads (each waits for the device), validation time left out; the steady rate is the median
    over the blocks after the first 10 steps."""
    import nemo_ssa.nemo.callbacks as cbmod

    clock = {"t": 100.0}
    monkeypatch.setattr(cbmod.time, "time", lambda: clock["t"])
    trainer = types.SimpleNamespace(global_step=0, max_steps=40, callback_metrics={}, sanity_checking=False,
                                    optimizers=[types.SimpleNamespace(param_groups=[{"lr": 1e-3}])], loggers=[])
    pl_module = types.SimpleNamespace(module=_Model())
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="ssa", flush_every=10)
    cb.on_train_start(trainer, pl_module)
    # host time per step: 0 for nine steps, then the whole block's device time at the flush step
    block_seconds = {10: 5.0, 20: 1.0, 30: 2.0, 40: 4.0}
    for step in range(1, 41):
        trainer.global_step = step
        trainer.callback_metrics[TB_LOSS_TAG] = torch.tensor(1.0)
        if step == 25:  # a validation of 7 s inside the third block
            cb.on_validation_start(trainer, pl_module)
            clock["t"] += 7.0
            cb.on_validation_end(trainer, pl_module)
        clock["t"] += block_seconds.get(step, 0.0)
        cb.on_train_batch_end(trainer, pl_module, None, None, step)
    cb.on_train_end(trainer, pl_module)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    tokens = 4 * 2 * 10
    want = {10: tokens / 5.0, 20: tokens / 1.0, 30: tokens / 2.0, 40: tokens / 4.0}
    for r in rows:
        block_end = -(-int(r["step"]) // 10) * 10
        assert float(r["tokens_per_s"]) == pytest.approx(want[block_end]), r
    summary = json.load(open(tmp_path / "summary.json"))
    # blocks from step 11: rates 80, 40, 20 -> median 40 (the first block, 16, is warm-up)
    assert summary["tokens_per_s_median"] == pytest.approx(tokens / 2.0)


def test_a_checkpoint_save_writes_the_pending_rows(tmp_path):
    """The rows up to a checkpoint are on disk when it is saved: a run killed after it resumes at
    the next step, so a row still pending then (checkpoints every 15 steps, flushes every 10)
    would be missing from the resumed curve for good."""
    trainer = types.SimpleNamespace(global_step=0, max_steps=40, callback_metrics={}, optimizers=[], loggers=[])
    pl_module = types.SimpleNamespace(module=torch.nn.Module())
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="softmax", flush_every=10)
    cb.on_train_start(trainer, pl_module)
    for step in range(1, 16):
        trainer.global_step = step
        trainer.callback_metrics[TB_LOSS_TAG] = torch.tensor(float(step))
        cb.on_train_batch_end(trainer, pl_module, None, None, step)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 11))  # 11-15 pending
    cb.on_save_checkpoint(trainer, pl_module, {})
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 16))
    assert [float(r["loss"]) for r in rows] == [float(s) for s in range(1, 16)]
    cb.on_save_checkpoint(trainer, pl_module, {})  # nothing pending: nothing written twice
    assert len(list(csv.DictReader(open(tmp_path / "metrics.csv")))) == 15


class _LaggingMarks:
    """Stand-in for the device's marks: a mark is done only once the test lets the "device" pass
    it, and a wait on it counts (on a GPU it would block the host)."""

    def __init__(self):
        self.made, self.passed, self.waited = 0, 0, []
        self.seconds_each = 2.0  # device time between consecutive marks

    def mark(self):
        self.made += 1
        return self.made

    def done(self, mark):
        return mark <= self.passed

    def wait(self, mark):
        if mark > self.passed:
            self.waited.append(mark)
            self.passed = mark

    def seconds(self, start, end):
        return (end - start) * self.seconds_each

    def to_host(self, flat):
        return flat.clone()


def _lagging_run(tmp_path, flush_every=2):
    trainer = types.SimpleNamespace(global_step=0, max_steps=100, callback_metrics={}, optimizers=[], loggers=[],
                                    sanity_checking=False)
    pl_module = types.SimpleNamespace(module=torch.nn.Module())
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="softmax",
                         flush_every=flush_every)
    cb.on_train_start(trainer, pl_module)
    marks = cb._marks = _LaggingMarks()
    cb._start = marks.mark()

    def step(s):
        trainer.global_step = s
        cb.on_train_batch_end(trainer, pl_module, {"loss": torch.tensor([float(s)])}, None, s)

    def written():
        path = tmp_path / "metrics.csv"
        return [int(r["step"]) for r in csv.DictReader(open(path))] if path.exists() else []

    return cb, trainer, pl_module, marks, step, written


def test_a_closed_block_is_written_once_the_device_has_passed_it_without_a_wait(tmp_path):
    """The block's values are read only after the device is past the block's end mark: closing a
    block waits for nothing (a blocking read drained the GPU's queue every flush), its rows come
    at the first batch end that finds the mark done, and a block three behind is waited for."""
    cb, trainer, pl_module, marks, step, written = _lagging_run(tmp_path)
    step(1), step(2)  # block 1-2 closed behind mark 2
    assert written() == [] and marks.waited == []
    step(3)
    marks.passed = 2  # the device finished steps 1-2
    step(4)  # closes 3-4 (mark 3) and finds mark 2 done
    assert written() == [1, 2] and marks.waited == []
    for s in range(5, 11):  # the device stays behind: blocks 3-4, 5-6, 7-8, 9-10 closed
        step(s)
    # never more than two blocks left unwritten: the oldest was waited for (the device busy after it)
    assert written() == [1, 2, 3, 4, 5, 6] and marks.waited == [3, 4]
    cb.on_save_checkpoint(trainer, pl_module, {})  # everything up to the checkpoint, waited for
    assert written() == list(range(1, 11)) and marks.waited == [3, 4, 5, 6]
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [float(r["loss"]) for r in rows] == [float(s) for s in range(1, 11)]
    # each block's rate: its 2 steps' tokens over the device time between its marks (one apart)
    assert all(float(r["tokens_per_s"]) == pytest.approx(2 * 8 / 2.0) for r in rows)


def test_the_end_writes_every_block_and_validation_time_is_left_out(tmp_path):
    cb, trainer, pl_module, marks, step, written = _lagging_run(tmp_path, flush_every=3)
    step(1)
    cb.on_validation_start(trainer, pl_module)  # marks 2 and 3: 2 s of device time in validation
    cb.on_validation_end(trainer, pl_module)
    step(2), step(3)  # block 1-3 ends at mark 4: 6 s from its start, 2 of them validation
    step(4)
    cb.on_train_end(trainer, pl_module)  # the open block (step 4) closed and everything waited for
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["tokens_per_s"]) for r in rows[:3]] == [pytest.approx(3 * 8 / 4.0)] * 3
    assert float(rows[3]["tokens_per_s"]) == pytest.approx(8 / 2.0)
    assert json.load(open(tmp_path / "summary.json"))["loss"]["4"] == 4.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_closing_a_block_on_the_gpu_does_not_synchronize(tmp_path):
    """On a GPU the block's copy is enqueued behind a CUDA event and nothing waits for it: the
    batch end that closes a block runs under torch's sync debug mode 'error', while the device
    is still busy; the rows come at the next batch end after the device has passed the event.

    A first block runs (and is waited for) before that: the first launch of each kernel loads its
    module, which may wait for the device (CUDA's lazy loading), and the first pinned block is
    allocated; a training run's first block pays both after its warm-up steps, once."""
    trainer = types.SimpleNamespace(global_step=0, max_steps=100, callback_metrics={}, optimizers=[], loggers=[])
    pl_module = types.SimpleNamespace(module=torch.nn.Module())
    cb = MetricsCallback(str(tmp_path), seq_length=4, global_batch_size=2, attention="softmax", flush_every=2)
    cb.on_train_start(trainer, pl_module)
    assert cb._marks.cuda
    loss = torch.zeros(1, device="cuda")

    def step(s):
        loss.fill_(float(s))
        trainer.global_step = s
        cb.on_train_batch_end(trainer, pl_module, {"loss": loss}, None, s)

    for s in (1, 2, 3):  # the first block closed at 2, written at 3 (the device idle by then)
        step(s)
        torch.cuda.synchronize()
    assert [int(r["step"]) for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == [1, 2]
    torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        torch.cuda._sleep(2_000_000_000)  # the "step": about a second of device work, queued
        step(4)  # closes the block of 3 and 4 behind the sleep
        host = time.perf_counter() - t0
        busy = bool(cb._closed) and not cb._closed[-1][3].query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert busy, (f"the block closed at step 4 was {'written' if not cb._closed else 'done'} before the batch end "
                  f"returned ({host:.3f} s on the host): something waited for the device")
    assert [int(r["step"]) for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == [1, 2]
    torch.cuda.synchronize()
    step(5)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
