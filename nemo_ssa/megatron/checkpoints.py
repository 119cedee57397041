"""What a megatron distributed checkpoint holds, read without building a model.

Both training paths write megatron ``dist_checkpointing`` directories (torch_dist):
the CPU loop under ``<run_dir>/checkpoints/step_NNNNNNN`` and NeMo under
``<run_dir>/<name>/checkpoints/<name>--step=N-...[-last]``. A directory is complete when
``metadata.json`` exists (megatron writes it last) and, for NeMo, no ``-unfinished``
marker sits beside it; only complete ones are resumed from.

The optimizer type matters when resuming: megatron-core reshards a checkpoint across
TP/CP/DP, but a distributed-optimizer checkpoint loads only into a distributed optimizer
(and a regular one only into a regular one). :func:`uses_distributed_optimizer` tells which
one wrote a checkpoint, so ``distributed_optimizer=auto`` can follow it and an explicit
mismatch can fail with one clear line.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from typing import Any, Dict, Optional

__all__ = ["is_complete", "uses_distributed_optimizer", "nemo_resume_checkpoint", "describe_optimizer",
           "read_ssa_scalars", "checkpoint_problem", "nemo_checkpoints"]

_UNFINISHED = "-unfinished"


def is_complete(path: str) -> bool:
    """A finished dist checkpoint: metadata.json written, no NeMo ``-unfinished`` marker."""
    path = path.rstrip("/")
    return os.path.isfile(os.path.join(path, "metadata.json")) and not os.path.exists(path + _UNFINISHED)


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the complete checkpoint at ``path`` cannot load, in one line; None when it looks loadable.

    Reads only metadata and file sizes (cheap, and the same answer on every rank of a
    shared file system): megatron's ``metadata.json`` must parse; a torch_dist checkpoint's
    ``.metadata`` must load, and every shard it indexes must exist and hold the bytes it
    indexes (a killed copy, a full disk or a lost file leaves a short or missing ``.distcp``);
    ``common.pt`` must load. A damaged byte inside a shard of the right length is not seen here.
    """
    import json

    meta = os.path.join(path, "metadata.json")
    try:
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend", "torch_dist")
    except (OSError, ValueError, AttributeError) as e:
        return f"metadata.json unreadable ({type(e).__name__}: {_first_line(e)})"
    if backend == "torch_dist":
        from torch.distributed.checkpoint import FileSystemReader

        try:
            index = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001 -- any failure to read the index is the answer
            return f".metadata unreadable ({type(e).__name__}: {_first_line(e)})"
        need: Dict[str, int] = {}
        for info in (index.storage_data or {}).values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
        for name in sorted(need):
            f = os.path.join(path, name)
            if not os.path.isfile(f):
                return f"shard {name} is missing"
            size = os.path.getsize(f)
            if size < need[name]:
                return f"shard {name} is truncated ({size} of {need[name]} bytes)"
    common = os.path.join(path, "common.pt")
    if os.path.exists(common):
        import torch

        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            return f"common.pt unreadable ({type(e).__name__}: {_first_line(e)})"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def _find_key(obj: Any, key: str, depth: int = 0) -> bool:
    if depth > 6:
        return False
    if isinstance(obj, dict):
        if key in obj:
            return True
        return any(_find_key(v, key, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_find_key(v, key, depth + 1) for v in obj)
    return False


def uses_distributed_optimizer(path: str) -> Optional[bool]:
    """True / False for a checkpoint with optimizer state written by the distributed / a
    regular megatron optimizer; None if it has no optimizer state (or cannot be read)."""
    common = os.path.join(path, "common.pt")
    if not os.path.isfile(common):
        return None
    import torch

    try:
        state = torch.load(common, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 -- unreadable: say "unknown"
        return None
    opt = state.get("optimizer") if isinstance(state, dict) else None
    if not opt:
        return None
    return _find_key(opt, "param_state_sharding_type")


def describe_optimizer(flag: Optional[bool]) -> str:
    return {True: "the distributed optimizer", False: "a regular (non-distributed) optimizer",
            None: "no optimizer state"}[flag]


_STEP_RE = re.compile(r"step=(\d+)")


def weights_dir(d: str) -> str:
    w = os.path.join(d, "weights")
    return w if os.path.isdir(w) else d


def nemo_checkpoints(checkpoint_dir: str, last_only: bool = True) -> list:
    """NeMo's complete checkpoint directories in ``checkpoint_dir``, newest step first
    (``*-last`` ones only by default: the ones NeMo's AutoResume looks at)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    pattern = "*last" if last_only else "*step=*"
    cands = [d for d in glob.glob(os.path.join(checkpoint_dir, pattern))
             if os.path.isdir(d) and not os.path.exists(d.rstrip("/") + _UNFINISHED) and is_complete(weights_dir(d))]

    def key(d):
        m = _STEP_RE.search(os.path.basename(d))
        return (int(m.group(1)) if m else -1, os.path.getmtime(d))

    return sorted(cands, key=key, reverse=True)


def nemo_resume_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The checkpoint NeMo's AutoResume would pick in ``checkpoint_dir``: the newest complete
    ``*-last`` directory, as the path of its dist checkpoint (NeMo 2 writes it under
    ``<name>-last/weights/``, beside ``context/``); None if there is none."""
    cands = nemo_checkpoints(checkpoint_dir)
    return weights_dir(cands[0]) if cands else None


# the model's SSA scalars in a checkpoint: ``<prefix>decoder.layers.[K.]self_attention.[core_attention.](n|b)``
# with any model prefix (``module.`` in NeMo's, none in the CPU loop's). Megatron stacks the
# layers of a TransformerBlock into one tensor with a leading layer axis. Optimizer-state keys
# (``optimizer.state.exp_avg.<param key>``, the distributed optimizer's too) also end in
# ``.n`` and are excluded by their ``optimizer.`` start.
_SSA_CKPT_KEY = re.compile(r"^(?!optimizer\.)(?:\w+\.)*?decoder\.layers\.(?:(\d+)\.)?self_attention\."
                           r"(?:core_attention\.)?(n|b)$")


def read_ssa_scalars(path: str) -> Dict[str, Dict[int, float]]:
    """SSA's n and b per layer (1-based) as saved in the dist checkpoint at ``path``
    (``{"n": {1: 1.52, ...}, "b": {...}}``), read from its torch_dist shards in this process,
    without a process group or a model. Empty dicts for a checkpoint without SSA.

    A scalar is replicated over TP/CP/DP ranks and saved once, so this is the value training
    would resume from; whether the ranks agreed is what the per-rank files of the metrics
    callback show."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    keys = {k: m for k, m in meta.items() if _SSA_CKPT_KEY.match(k) and hasattr(m, "size")}
    out: Dict[str, Dict[int, float]] = {"n": {}, "b": {}}
    if not keys:
        return out
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in keys.items()}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended here
        warnings.simplefilter("ignore", UserWarning)
        load(state, storage_reader=reader, no_dist=True)
    for k, t in state.items():
        layer, name = _SSA_CKPT_KEY.match(k).groups()
        if layer is not None:  # one tensor per layer (no stacking)
            out[name][int(layer) + 1] = t.reshape(-1)[0].item()
        else:  # stacked: row i is layer i + 1
            for i, v in enumerate(t.reshape(t.shape[0], -1)[:, 0].tolist()):
                out[name][i + 1] = v
    return out
