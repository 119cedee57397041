"""Lightning's ``self.log`` without its per-call walk over the metric when nothing has to move.

Every ``LightningModule.log`` call ends in ``_ResultCollection.log``, which calls
``self[key].to(value.device)`` on the stored ``_ResultMetric`` -- a torchmetrics ``Metric``
whose ``to`` rebuilds its whole ``__dict__`` (47 entries) through ``apply_to_collection`` to
move any tensor in it, every call, even when every tensor already is on that device. NeMo logs
six to seven values per training step this way (``global_step``, ``step``,
``reduced_train_loss``, ``lr``, ``consumed_samples``, ``global_batch_size``, ``grad_norm``):
a host cost the step pays each time, and at micro batch 8 the step is bound by its host
(docs/training-step.md; the 2026-12-01 profile put ``_ResultMetric.to`` at 15 % of the GPU's
idle time).

:func:`install` replaces ``_ResultMetric.to`` with :func:`to`: when the call is a move to one
device and every tensor the metric holds (directly, or in a dict or list in its ``__dict__``,
its ``_defaults`` included) is already there, it returns the metric as Lightning's would leave
it (unchanged); any other call -- a dtype, keyword arguments, a tensor elsewhere -- is
Lightning's own ``to``. The check is exact, not a cache: a metric moved behind Lightning's back
(``Metric._apply``) still takes Lightning's path.

:func:`install_progress_bar_off` is for a trainer without a progress bar (the launcher turns
Lightning's off and prints its own lines): it logs every value with ``prog_bar=False``.
Lightning's ``_LoggerConnector.on_batch_end`` builds the progress-bar dict at the end of every
training batch, and for it turns each ``prog_bar=True`` value into a Python number with
``.item()`` -- NeMo logs four of them (``reduced_train_loss``, ``lr``, ``global_step``,
``consumed_samples``), each a device tensor, so every step ended in a host-device
synchronisation that nothing read: the host waited for the whole step's kernels, and the GPU
then waited for the host's next-step Python (a py-spy record of the NeMo main job: 49 % of
the micro-batch-8 step's host time, 76 % at micro batch 32, waiting there;
docs/results/2026-12-03-pbar-sync). The logged, callback and reduced values are Lightning's
unchanged (they never pass through the progress-bar dict); only ``trainer.progress_bar_metrics``
stays empty, which only a progress bar reads.

Installed only on the Lightning this was written against (``_ResultMetric.to`` defined in
``lightning.pytorch.trainer.connectors.logger_connector.result`` as the method that walks
``__dict__``); elsewhere :func:`install` leaves Lightning as it is and says why.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

_ORIGINAL: dict = {}


def _on(value: Any, device: torch.device) -> bool:
    """No tensor in ``value`` (a tensor, or a dict/list/tuple one level deep) is off ``device``,
    and it holds no module (a logged torchmetrics ``Metric`` moves itself: Lightning's walk)."""
    if isinstance(value, torch.Tensor):
        return value.device == device
    if isinstance(value, torch.nn.Module):
        return False
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return True
    for v in value:
        if isinstance(v, torch.Tensor):
            if v.device != device:
                return False
        elif isinstance(v, (dict, list, tuple, torch.nn.Module)):
            return False  # deeper than we look: let Lightning walk it
    return True


def to(self, *args: Any, **kwargs: Any):
    """``_ResultMetric.to`` that returns at once when a move to one device would move nothing."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.device):
        device = args[0]
        if all(_on(v, device) for v in self.__dict__.values()):
            return self
    return _ORIGINAL["to"](self, *args, **kwargs)


def _replace(cls_name: str, attr: str, new, check=None) -> Optional[str]:
    """Put ``new`` in place of Lightning's ``result.<cls_name>.<attr>`` (its original kept in
    ``_ORIGINAL[attr]``) when that is the function this module was written against and
    ``check(original)`` finds nothing amiss. Returns why not, or None when in place."""
    try:
        from lightning.pytorch.trainer.connectors.logger_connector import result
    except ImportError as e:  # pragma: no cover - NeMo needs Lightning
        return f"lightning.pytorch is not importable ({e})"
    cls = getattr(result, cls_name)
    current = cls.__dict__.get(attr)
    if current is new:
        return None
    if current is None or getattr(current, "__module__", None) != result.__name__:
        return f"lightning's {cls_name}.{attr} is not the one this was written against"
    why = check(current) if check is not None else None
    if why:
        return why
    _ORIGINAL[attr] = current
    setattr(cls, attr, new)
    return None


def install() -> Optional[str]:
    """Put :func:`to` in place of ``_ResultMetric.to``. Returns why not, or None when installed."""
    return _replace("_ResultMetric", "to", to)


def uninstall() -> None:
    from lightning.pytorch.trainer.connectors.logger_connector import result

    if "to" in _ORIGINAL:
        result._ResultMetric.to = _ORIGINAL.pop("to")
    if "log" in _ORIGINAL:
        result._ResultCollection.log = _ORIGINAL.pop("log")


def log_progress_bar_off(self, fx: str, name: str, value: Any, *args: Any, **kwargs: Any):
    """``_ResultCollection.log`` with ``prog_bar=False``: see the module's docstring."""
    if args:  # prog_bar is the first parameter after value
        args = (False,) + args[1:]
    else:
        kwargs["prog_bar"] = False
    return _ORIGINAL["log"](self, fx, name, value, *args, **kwargs)


def _takes_prog_bar_fourth(log) -> Optional[str]:
    import inspect

    params = list(inspect.signature(log).parameters)
    if params[1:5] != ["fx", "name", "value", "prog_bar"]:
        return f"lightning's _ResultCollection.log takes {params[1:5]}, not (fx, name, value, prog_bar)"
    return None


def install_progress_bar_off() -> Optional[str]:
    """Log every value without ``prog_bar`` (for a trainer with no progress bar). Returns why
    not, or None when installed; :func:`uninstall` takes it out with :func:`to`."""
    return _replace("_ResultCollection", "log", log_progress_bar_off, check=_takes_prog_bar_fourth)
