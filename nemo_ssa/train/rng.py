"""Snapshot and restore every RNG state a training run draws from.

Warm-up (kernel compilation, autotuning, allocator warm-up) must not change the run:
it draws random inputs, and without a restore the dropout masks, data shuffles and any
later initialisation of the run would shift. Covered: Python ``random``, NumPy's global generator, torch's CPU
generator, every CUDA device's generator, and megatron's CUDA RNG tracker states (the
streams dropout forks into), when megatron is importable and its tracker initialised.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch


@dataclass
class RNGSnapshot:
    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: Optional[List[torch.Tensor]]
    megatron_tracker: Optional[Dict[str, Any]]


def _megatron_tracker():
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except Exception:  # megatron not installed: nothing to snapshot there
        return None
    if not getattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return mrandom.get_cuda_rng_tracker()


def snapshot_rng() -> RNGSnapshot:
    tracker = _megatron_tracker()
    tracker_states = None
    if tracker is not None and hasattr(tracker, "get_states"):
        tracker_states = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in tracker.get_states().items()}
    return RNGSnapshot(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch_cpu=torch.get_rng_state(),
        torch_cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        megatron_tracker=tracker_states,
    )


def restore_rng(snap: RNGSnapshot) -> None:
    random.setstate(snap.python)
    np.random.set_state(snap.numpy)
    torch.set_rng_state(snap.torch_cpu)
    if snap.torch_cuda is not None:
        torch.cuda.set_rng_state_all(snap.torch_cuda)
    if snap.megatron_tracker is not None:
        tracker = _megatron_tracker()
        if tracker is not None:
            tracker.set_states({k: (v.clone() if torch.is_tensor(v) else v) for k, v in snap.megatron_tracker.items()})


@contextlib.contextmanager
def preserved_rng(enabled: bool = True):
    """Everything inside the block leaves every RNG exactly as it found it."""
    if not enabled:
        yield
        return
    snap = snapshot_rng()
    try:
        yield
    finally:
        restore_rng(snap)
