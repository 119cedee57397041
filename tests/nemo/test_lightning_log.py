"""nemo_ssa.nemo.lightning_log: Lightning's self.log with the fast ``_ResultMetric.to`` logs,
reduces and reports exactly what Lightning's own does, and walks only when something moves."""

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from lightning.pytorch.trainer.connectors.logger_connector import result  # noqa: E402

from nemo_ssa.nemo import lightning_log  # noqa: E402


@pytest.fixture
def installed():
    assert lightning_log.install() is None
    yield
    lightning_log.uninstall()


def _log_steps(rc, values, names=("reduced_train_loss", "lr", "global_step")):
    """NeMo's per-step pattern: several keys on_step, one of them also reduced per epoch."""
    seen = []
    for step, v in enumerate(values):
        rc.log("training_step", names[0], v, on_step=True, on_epoch=True, batch_size=2, prog_bar=True)
        rc.log("training_step", names[1], v * 0.5, on_step=True, on_epoch=False, batch_size=1)
        rc.log("training_step", names[2], torch.tensor(float(step)), on_step=True, on_epoch=False, batch_size=1)
        seen.append({k: t.clone() for k, t in rc.metrics(True)["callback"].items()})
    return seen, {k: t.clone() for k, t in rc.metrics(False)["callback"].items()}


def _values(seed=0, n=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((), generator=g, dtype=dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logs_exactly_what_lightning_logs(installed, dtype):
    vals = _values(dtype=dtype)
    fast = _log_steps(result._ResultCollection(training=True), vals)
    lightning_log.uninstall()
    ref = _log_steps(result._ResultCollection(training=True), vals)
    assert lightning_log.install() is None
    for (fs, fe), (rs, re_) in [(fast, ref)]:
        assert len(fs) == len(rs) and fe.keys() == re_.keys()
        for a, b in zip(fs + [fe], rs + [re_]):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_walks_only_when_something_moves(installed, monkeypatch):
    rc = result._ResultCollection(training=True)
    rc.log("training_step", "x", torch.tensor(1.0), on_step=True, on_epoch=False, batch_size=1)
    metric = rc["training_step.x"]
    walks = []
    original = lightning_log._ORIGINAL["to"]
    monkeypatch.setitem(lightning_log._ORIGINAL, "to", lambda self, *a, **k: walks.append((a, k)) or original(self, *a, **k))
    cpu = torch.device("cpu")
    assert metric.to(cpu) is metric and walks == []  # every tensor already on the CPU: no walk
    metric.to(torch.float64)  # a dtype: Lightning's
    metric.to(device=cpu)  # keyword arguments: Lightning's
    assert len(walks) == 2
    # a nested container or a module inside: Lightning walks it
    metric.__dict__["extra"] = {"a": [torch.tensor(1.0)]}
    metric.to(cpu)
    metric.__dict__["extra"] = torch.nn.Linear(1, 1)
    metric.to(cpu)
    assert len(walks) == 4
    del metric.__dict__["extra"]
    # a move to another device (meta stands for a GPU): Lightning's walk; then again: none
    meta = torch.device("meta")
    metric.to(meta)
    metric.to(meta)
    assert len(walks) == 5
    # one tensor elsewhere (as after a move behind Lightning's back): Lightning walks it
    metric.__dict__["value"] = torch.tensor(0.0)
    metric.to(meta)
    assert len(walks) == 6 and metric.__dict__["value"].device == meta


def test_a_move_still_moves(installed):
    """A move to another device is Lightning's walk, and moves every tensor (the meta device
    stands for a GPU here: a real one in the GPU test below)."""
    rc = result._ResultCollection(training=True)
    rc.log("training_step", "x", torch.tensor(2.0), on_step=True, on_epoch=False, batch_size=1)
    metric = rc["training_step.x"]
    meta = torch.device("meta")
    assert metric.to(meta) is metric
    tensors = [v for v in metric.__dict__.values() if isinstance(v, torch.Tensor)]
    tensors += [v for v in metric.__dict__["_defaults"].values() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 4 and all(t.device == meta for t in tensors)


def test_install_refuses_a_to_it_does_not_know(monkeypatch):
    monkeypatch.setattr(result._ResultMetric, "to", lambda self, *a, **k: self, raising=True)
    assert "not the one" in lightning_log.install()
    assert result._ResultMetric.__dict__["to"] is not lightning_log.to


def test_install_is_idempotent_and_uninstall_restores():
    before = result._ResultMetric.__dict__["to"]
    assert lightning_log.install() is None and lightning_log.install() is None
    assert result._ResultMetric.__dict__["to"] is lightning_log.to
    lightning_log.uninstall()
    assert result._ResultMetric.__dict__["to"] is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_values_log_as_lightning_logs_them(installed):
    vals = [v.cuda() for v in _values()]
    fast = _log_steps(result._ResultCollection(training=True), vals)
    lightning_log.uninstall()
    ref = _log_steps(result._ResultCollection(training=True), vals)
    assert lightning_log.install() is None
    for a, b in zip(fast[0] + [fast[1]], ref[0] + [ref[1]]):
        assert a.keys() == b.keys() and all(a[k].device == b[k].device and torch.equal(a[k], b[k]) for k in a)


def test_the_benchmark_runs_both_variants_and_leaves_lightning_as_it_was(capsys):
    from benchmarks import bench_lightning_log

    before = result._ResultMetric.__dict__["to"]
    assert bench_lightning_log.main(["--steps", "3", "--rounds", "2"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("| lightning", "| nemo_ssa"))]
    assert len(rows) == 2 and rows[0].endswith("| 1.00x |")
    assert result._ResultMetric.__dict__["to"] is before


# --- the progress-bar values off (a trainer without a progress bar) ---------------------------

def _all_metrics(rc, values):
    """Per step: the three dicts Lightning's on_batch_end builds; then the epoch's callback dict."""
    seen = []
    for step, v in enumerate(values):
        rc.log("training_step", "reduced_train_loss", v, on_step=True, on_epoch=True, batch_size=2, prog_bar=True)
        rc.log("training_step", "lr", v * 0.5, True, on_step=True, on_epoch=False, batch_size=1)  # positional
        rc.log("training_step", "global_step", torch.tensor(float(step), device=v.device), on_step=True,
               on_epoch=False, batch_size=1, prog_bar=True)
        m = rc.metrics(True)
        seen.append({part: {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in m[part].items()}
                     for part in ("callback", "log", "pbar")})
    return seen, rc.metrics(False)["callback"]


@pytest.fixture
def bar_off():
    assert lightning_log.install_progress_bar_off() is None
    yield
    lightning_log.uninstall()


def test_progress_bar_off_keeps_every_logged_and_callback_value(bar_off):
    vals = _values()
    off, off_epoch = _all_metrics(result._ResultCollection(training=True), vals)
    lightning_log.uninstall()
    ref, ref_epoch = _all_metrics(result._ResultCollection(training=True), vals)
    assert lightning_log.install_progress_bar_off() is None
    assert all(step["pbar"] == {} for step in off)
    assert all(step["pbar"] for step in ref)  # Lightning's own fills it: the comparison means something
    for a, b in zip(off, ref):
        for part in ("callback", "log"):
            assert a[part].keys() == b[part].keys()
            assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert off_epoch.keys() == ref_epoch.keys() and all(torch.equal(off_epoch[k], ref_epoch[k]) for k in off_epoch)


def test_progress_bar_off_refuses_a_log_it_does_not_know(monkeypatch):
    monkeypatch.setattr(result._ResultCollection, "log", lambda self, fx, name, value, **k: None, raising=True)
    assert "not the one" in lightning_log.install_progress_bar_off()
    assert "log" not in lightning_log._ORIGINAL


def test_progress_bar_off_is_idempotent_and_uninstall_restores_both():
    log_before, to_before = result._ResultCollection.__dict__["log"], result._ResultMetric.__dict__["to"]
    assert lightning_log.install() is None
    assert lightning_log.install_progress_bar_off() is None and lightning_log.install_progress_bar_off() is None
    assert result._ResultCollection.__dict__["log"] is lightning_log.log_progress_bar_off
    lightning_log.uninstall()
    assert result._ResultCollection.__dict__["log"] is log_before and result._ResultMetric.__dict__["to"] is to_before


class _Trainer:
    global_rank = 0

    def __init__(self, bar):
        self.progress_bar_callback = bar


@pytest.mark.parametrize("value,bar,dropped", [("drop", None, True), ("drop", object(), False),
                                               ("keep", None, False), ("KEEP", object(), False)])
def test_the_callback_drops_the_bar_values_only_when_asked_and_without_a_bar(value, bar, dropped, capsys):
    from nemo_ssa.nemo.callbacks import LightningLogCallback

    cb, before = LightningLogCallback(progress_bar_values=value), result._ResultCollection.__dict__["log"]
    cb.setup(_Trainer(bar), None, "fit")
    try:
        installed = result._ResultCollection.__dict__["log"] is lightning_log.log_progress_bar_off
        assert installed == dropped
        out = capsys.readouterr().out
        assert ("logged without prog_bar" in out) == dropped and "progress-bar values" in out
    finally:
        cb.teardown(_Trainer(bar), None, "fit")
    assert result._ResultCollection.__dict__["log"] is before


def test_the_callback_names_what_it_supports():
    from nemo_ssa.nemo.callbacks import LightningLogCallback

    assert LightningLogCallback().progress_bar_values == "drop"  # kept anyway where a progress bar reads them
    with pytest.raises(ValueError, match="supported: keep, drop"):
        LightningLogCallback(progress_bar_values="off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_progress_bar_off_reads_nothing_from_the_device_at_a_batch_end():
    """Lightning's on_batch_end dicts with CUDA values: a device sync without the patch (so the
    test can fail), none with it."""
    vals = [v.cuda() for v in _values(n=2)]

    def batch_end(rc):
        rc.log("training_step", "reduced_train_loss", vals[0], on_step=True, on_epoch=True, batch_size=1, prog_bar=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rc.metrics(True)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    with pytest.raises(RuntimeError, match="synchroniz"):
        batch_end(result._ResultCollection(training=True))
    assert lightning_log.install_progress_bar_off() is None
    try:
        batch_end(result._ResultCollection(training=True))
    finally:
        lightning_log.uninstall()
