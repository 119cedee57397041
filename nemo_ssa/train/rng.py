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


def _copy_state(state: Any) -> Any:
    """A copy of one tracker state: a byte tensor, or -- in the cudagraphable tracker megatron's
    CUDA graphs need (nemo_ssa/megatron/cuda_graphs.py) -- a generator, which its draws advance
    in place, so keeping the object itself would keep nothing."""
    if torch.is_tensor(state):
        return state.clone()
    if isinstance(state, torch.Generator):
        return state.clone_state()
    return state


def snapshot_rng() -> RNGSnapshot:
    tracker = _megatron_tracker()
    tracker_states = None
    if tracker is not None and hasattr(tracker, "get_states"):
        tracker_states = {k: _copy_state(v) for k, v in tracker.get_states().items()}
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
            current = tracker.get_states()
            restored = {}
            for k, v in snap.megatron_tracker.items():
                state = v.get_state() if isinstance(v, torch.Generator) else v
                if isinstance(current.get(k), torch.Generator):
                    # in place: a captured CUDA graph holds this generator object and reads its
                    # state at every replay, so a new object would take the stream out of the graph
                    current[k].set_state(state)
                    restored[k] = current[k]
                else:
                    restored[k] = _copy_state(state)
            tracker.set_states(restored)


def tracker_states_as_tensors(states: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Tracker states as byte tensors, whichever tracker held them: what a checkpoint stores
    (a generator does not pickle), and what :func:`restore_rng` sets into either tracker."""
    if states is None:
        return None
    return {k: (v.get_state() if isinstance(v, torch.Generator) else v) for k, v in states.items()}


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
