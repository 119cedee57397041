"""SSAMegatronOptimizerModule logs the learning rate as NeMo does, without a blocking copy on CUDA."""

import types

import pytest
import torch

from nemo_ssa.nemo.optim import SSAMegatronOptimizerModule


def _module(lr):
    mod = object.__new__(SSAMegatronOptimizerModule)  # the hook reads only the built optimizers
    mod._optimizers = [types.SimpleNamespace(param_groups=[{"lr": lr}, {"lr": 9.0}])]
    return mod


def _pl_module(device):
    logged = []
    return types.SimpleNamespace(device=torch.device(device), log=lambda *a, **k: logged.append((a, k))), logged


def test_off_cuda_it_is_nemos_hook():
    pl_module, logged = _pl_module("cpu")
    _module(3e-4).on_train_batch_start(None, pl_module, None, 0)
    assert logged == [(("lr", 3e-4), {"batch_size": 1, "prog_bar": True})]


def test_before_the_optimizers_exist_it_is_nemos_hook():
    pl_module, logged = _pl_module("cuda")
    mod = _module(3e-4)
    mod._optimizers = None
    mod.on_train_batch_start(None, pl_module, None, 0)
    assert logged == []  # NeMo's hook logs nothing then


@pytest.mark.parametrize("default", [torch.float32, torch.float64, torch.bfloat16])
def test_on_cuda_the_value_travels_pinned_and_non_blocking(monkeypatch, default):
    made, moved = [], []
    real_tensor = torch.tensor

    def tensor(value, **kw):
        made.append(dict(kw))
        kw.pop("pin_memory", None)  # no CUDA here to pin with
        return real_tensor(value, **kw)

    def to(self, device, non_blocking=False):
        moved.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "to", to)
    pl_module, logged = _pl_module("cuda:0")
    monkeypatch.setattr(torch, "get_default_dtype", lambda: default)
    _module(3e-4).on_train_batch_start(None, pl_module, None, 0)
    monkeypatch.undo()
    # Lightning makes a float into the default dtype but no lower than float32
    want = torch.float64 if default == torch.float64 else torch.float32
    assert made == [{"dtype": want, "pin_memory": True}]
    assert moved == [("cuda:0", True)]
    (name, value), kw = logged[0]
    assert name == "lr" and kw == {"batch_size": 1, "prog_bar": True}
    # the value Lightning would have made of the float: that dtype, the first group's rate
    assert value.dtype == want and value.item() == real_tensor(3e-4, dtype=want).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_no_synchronisation():
    pl_module, logged = _pl_module("cuda")
    mod = _module(3e-4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mod.on_train_batch_start(None, pl_module, None, 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (_, value), _ = logged[0]
    assert value.is_cuda and value.item() == torch.tensor(3e-4).item()
