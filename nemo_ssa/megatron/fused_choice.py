"""One rule for the ``model.fused_*`` switches of the layers we fuse (the MLP, the layer norms).

``auto`` (or None): the fused module where the config supports it and CUDA exists, else the
stock module with one log line naming why; ``true``: the fused module, or a ValueError when
the model is built naming what is supported; ``false``: the stock module.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

VALUES = ("auto", "true", "false")


def parse_flag(value: Any, key: str) -> Optional[bool]:
    """``auto``/None -> None, ``true``/``false`` (bool or string) -> bool; else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in VALUES:
        v = value.strip().lower()
        return None if v == "auto" else v == "true"
    raise ValueError(f"{key}={value!r}; supported: auto, true, false")


def choose(key: str, value: Any, reason: Callable[[], Optional[str]], supported: str, stock: str) -> bool:
    """Whether to build the fused module for switch ``key`` set to ``value``; ``reason()``
    says why the config cannot take it (None: it can); ``stock`` names what runs instead."""
    flag = parse_flag(value, key)
    if flag is False:
        return False
    why = reason()
    if why is not None:
        if flag:
            raise ValueError(f"{key}=true: {why}; supported: {supported} ({key}=auto or false keeps {stock})")
        log.info("%s off (%s=auto): %s; %s runs", key, key, why, stock)
        return False
    return True if flag else torch.cuda.is_available()
