"""Environment variables the ops read: debugging and A/B overrides, all in one table.

Every variable is optional; unset (or empty) gives the default behaviour. They exist to
check a kernel (poisoned outputs), to time one choice against another on a GPU, or to
turn a fast path off when it is suspected of a bug -- not to configure training runs,
which choose through function arguments (``deterministic=`` on the public ops, set from
the run config's attention options). A run records the ones that were set in its
``attention_policy.json`` (``env_overrides``).

``ENV_VARS`` lists ``(name, default, meaning)``; each has one accessor below, and no other
module in ``nemo_ssa.ops`` reads ``os.environ``. Accessors read the variable when called;
the callers that turn one into a module constant (poison, fast launch) say so.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Tuple

__all__ = [
    "ENV_VARS",
    "BWD_MODES",
    "poison_outputs",
    "fast_launch",
    "autotune",
    "bwd_mode",
    "fused_delta",
    "poly_log2",
    "mlp_tiles",
    "ce_compile",
    "ce_path",
    "ce_chunk",
]

BWD_MODES = ("auto", "atomic", "deterministic")

#: (name, default, meaning) of every variable read under ``nemo_ssa.ops``.
ENV_VARS: Tuple[Tuple[str, str, str], ...] = (
    ("NEMO_SSA_POISON", "0",
     "1: allocate every kernel output NaN-filled, so an element a kernel forgets to write "
     "shows up as NaN (read once, when ops.common.alloc is imported)"),
    ("NEMO_SSA_FAST_LAUNCH", "1",
     "0: every Triton launch goes through JITFunction.run instead of the cached launcher "
     "(read once, when ops.common.launch is imported)"),
    ("NEMO_SSA_AUTOTUNE", "0",
     "1: triton.autotune over candidate tiles instead of the static tables (GPU only)"),
    ("NEMO_SSA_BWD", "auto",
     "attention backward: auto (single pass where it pays, two kernels when torch is "
     "deterministic), atomic (single pass always), deterministic (two kernels always); "
     "an op called with deterministic=True (the run config's attention option, or megatron's "
     "deterministic_mode) takes the two kernels whatever this says"),
    ("NEMO_SSA_FUSED_DELTA", "",
     "0 or 1: force the delta = rowsum(o * do) pass out of / into the dQ kernel "
     "(default: fused for softmax, separate for SSA)"),
    ("NEMO_SSA_POLY_LOG2", "0",
     "1: split the SSA log2 between MUFU and a polynomial (forward and backward alike)"),
    ("NEMO_SSA_TMA", "1",
     "0: the attention kernels never take the Hopper TMA path (tensor descriptors); the "
     "tables' pointer rows run instead (A/B runs, or a driver that mishandles descriptors)"),
    ("NEMO_SSA_GLUON", "1",
     "0: the attention never takes its Gluon Hopper kernels (the flash forward, "
     "ops.attention.hopper; the single-pass backward, ops.common.hopper_bwd); the Triton "
     "kernels run instead (A/B runs)"),
    ("NEMO_SSA_MLP_TILES", "",
     "fused MLP tiles, e.g. fwd=128x256x64/3/8,bwd=128x128x64/4/4 (default: DEFAULT_TILES)"),
    ("NEMO_SSA_CE_COMPILE", "1",
     "0: the chunked/fused cross entropy runs eagerly instead of under torch.compile on CUDA"),
    ("NEMO_SSA_CE_PATH", "chunked",
     "loss: the GPT model keeps megatron's output layer and fuses only the loss (A/B timing "
     "of the fused output layer + cross entropy, nemo_ssa.megatron.output_layer)"),
    ("NEMO_SSA_CE_CHUNK", "",
     "tokens per chunk of the fused output layer + cross entropy (default: the op's "
     "DEFAULT_CHUNK)"),
)


# ``os.environ.get`` runs four Python frames per read (Mapping.get, __getitem__, the key's
# encoder); the attention reads several of these variables on every call, and the recipe's
# micro batch is host-bound. On POSIX ``os.environ`` keeps its own bytes -> bytes dict in
# ``_data``, which every write through ``os.environ`` (``os.environ[k] = v``, ``del``,
# ``monkeypatch.setenv``, ``mock.patch.dict``) updates before returning: one lookup there
# gives ``os.environ.get``'s answer. Anything else (another OS, ``os.environ`` replaced by
# a plain mapping) takes ``os.environ.get``.
_POSIX = os.name == "posix"
_FS_ENCODING = sys.getfilesystemencoding()


def _get(name: str) -> str:
    """``os.environ.get(name, "")``, without its Python frames where ``os.environ`` allows."""
    data = getattr(os.environ, "_data", None)
    if not _POSIX or type(data) is not dict:
        return os.environ.get(name, "")
    value = data.get(name.encode(_FS_ENCODING, "surrogateescape"))
    return "" if value is None else value.decode(_FS_ENCODING, "surrogateescape")


def _flag(name: str, default: bool) -> bool:
    """Unset -> ``default``; ``""`` or ``"0"`` -> False; anything else -> True (the store's
    bytes compared as they are: a flag is read on every attention call)."""
    data = getattr(os.environ, "_data", None)
    if not _POSIX or type(data) is not dict:
        raw = os.environ.get(name)
        return default if raw is None else raw not in ("", "0")
    raw = data.get(name.encode(_FS_ENCODING, "surrogateescape"))
    return default if raw is None else raw not in (b"", b"0")


def poison_outputs() -> bool:
    """``NEMO_SSA_POISON``: NaN-fill every kernel output."""
    return _flag("NEMO_SSA_POISON", False)


def fast_launch() -> bool:
    """``NEMO_SSA_FAST_LAUNCH``: the cached launch path (on unless set to ``0`` or empty)."""
    return _flag("NEMO_SSA_FAST_LAUNCH", True)


def autotune() -> bool:
    """``NEMO_SSA_AUTOTUNE``: autotune instead of the static tile tables."""
    return _flag("NEMO_SSA_AUTOTUNE", False)


def bwd_mode() -> str:
    """``NEMO_SSA_BWD``: one of ``BWD_MODES`` (unset or empty: ``auto``)."""
    mode = _get("NEMO_SSA_BWD") or "auto"
    if mode not in BWD_MODES:
        raise ValueError(f"NEMO_SSA_BWD={mode!r}; supported: {', '.join(BWD_MODES)}")
    return mode


def fused_delta() -> Optional[bool]:
    """``NEMO_SSA_FUSED_DELTA``: True/False when set to ``1``/``0``, else None (the
    default choice applies)."""
    forced = _get("NEMO_SSA_FUSED_DELTA")
    if forced in ("0", "1"):
        return forced == "1"
    return None


def poly_log2() -> bool:
    """``NEMO_SSA_POLY_LOG2``: the MUFU + polynomial SSA ``log2``."""
    return _flag("NEMO_SSA_POLY_LOG2", False)


def tma() -> bool:
    """``NEMO_SSA_TMA``: the attention kernels may take the TMA path (on by default)."""
    return _flag("NEMO_SSA_TMA", True)


def gluon() -> bool:
    """``NEMO_SSA_GLUON``: the attention may take its Gluon Hopper kernels, forward and
    backward (on by default)."""
    return _flag("NEMO_SSA_GLUON", True)


def mlp_tiles() -> str:
    """``NEMO_SSA_MLP_TILES``: the raw tile spec (stripped; ``""`` = defaults)."""
    return _get("NEMO_SSA_MLP_TILES").strip()


def ce_compile() -> bool:
    """``NEMO_SSA_CE_COMPILE``: torch.compile the cross entropy on CUDA (on by default)."""
    return _flag("NEMO_SSA_CE_COMPILE", True)


CE_PATHS = ("chunked", "loss")


def ce_path() -> str:
    """``NEMO_SSA_CE_PATH``: one of ``CE_PATHS`` (unset or empty: ``chunked``)."""
    path = _get("NEMO_SSA_CE_PATH") or "chunked"
    if path not in CE_PATHS:
        raise ValueError(f"NEMO_SSA_CE_PATH={path!r}: supported: {', '.join(CE_PATHS)}")
    return path


def ce_chunk() -> Optional[int]:
    """``NEMO_SSA_CE_CHUNK``: a positive token count, or None (unset or empty: the op's default)."""
    raw = _get("NEMO_SSA_CE_CHUNK").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"NEMO_SSA_CE_CHUNK={raw!r}: supported: a positive number of tokens")
    return int(raw)
