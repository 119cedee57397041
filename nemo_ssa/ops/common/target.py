"""What the device of a call can run, decided in one place.

Every kernel choice that depends on the hardware -- whether the Triton kernels run at all,
PTX fast math, TMA tensor descriptors, Hopper's warpgroup MMA (the Gluon kernels), the
streaming-multiprocessor count a split heuristic divides by -- asks :func:`target` for the
tensor's device instead of probing ``torch.cuda`` itself. So the answers agree with each
other, are cached once per device, and can be *stood in for*: :func:`stand_in` makes every
call answer as another device would (``H100``), which is how a CPU machine compiles the
exact kernels an H100 would launch (``benchmarks/sass_ab.py``) and how the CPU tests
exercise the sm_90 dispatch rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch

from nemo_ssa.ops.common.launch import is_interpreter

__all__ = ["Target", "H100", "backend", "target", "stand_in", "use_fast_math"]


@dataclass(frozen=True)
class Target:
    """``backend``: ``"cuda"`` (NVIDIA), ``"rocm"``, ``"interpreter"`` (CPU tensors, kernels
    built for ``TRITON_INTERPRET=1``), ``"cpu"`` (no kernels) or ``"unsupported"`` (CUDA
    tensors in a process whose kernels were built for the interpreter). ``capability``:
    CUDA's ``(major, minor)``; ``sms``: streaming multiprocessors (CUDA only)."""

    backend: str
    capability: Optional[Tuple[int, int]] = None
    sms: Optional[int] = None

    @property
    def runs_kernels(self) -> bool:
        """The Triton kernels can run on this device in this process."""
        return self.backend in ("cuda", "rocm", "interpreter")

    @property
    def fast_math(self) -> bool:
        """Inline PTX (``lg2.approx`` and friends): NVIDIA only, never the interpreter."""
        return self.backend == "cuda"

    @property
    def tma(self) -> bool:
        """Tensor descriptors: NVIDIA compute capability >= 9.0, or the interpreter."""
        return self.backend == "interpreter" or (self.backend == "cuda" and self.capability >= (9, 0))

    @property
    def wgmma(self) -> bool:
        """Hopper's warpgroup MMA, which the Gluon kernels are built on: sm_90(a) exactly --
        not Blackwell or later, not the interpreter."""
        return self.backend == "cuda" and self.capability == (9, 0)


#: The stand-in of the tools that compile for an H100 on a CPU machine.
H100 = Target("cuda", (9, 0), 132)

_STAND_IN: Optional[Target] = None
_CUDA: Dict[int, Target] = {}


def backend(device: torch.device) -> str:
    """``Target.backend`` of ``device`` without querying the device: the host code that
    ``torch.compile`` traces (device checks, the fast-math default) asks this."""
    if _STAND_IN is not None:
        return _STAND_IN.backend
    if is_interpreter():
        return "interpreter" if device.type == "cpu" else "unsupported"
    if device.type != "cuda":
        return "cpu"
    return "rocm" if torch.version.hip is not None else "cuda"


def target(device: torch.device) -> Target:
    """The :class:`Target` of ``device`` (cached per CUDA device; :func:`stand_in` first)."""
    if _STAND_IN is not None:
        return _STAND_IN
    kind = backend(device)
    if kind not in ("cuda", "rocm"):
        return Target(kind)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    t = _CUDA.get(idx)
    if t is None:
        props = torch.cuda.get_device_properties(idx)
        t = _CUDA[idx] = Target(kind, (int(props.major), int(props.minor)), int(props.multi_processor_count))
    return t


def use_fast_math(device: torch.device) -> bool:
    """Default for ``fast_math`` (PTX ``lg2.approx``): CUDA (not ROCm), not interpreted."""
    return backend(device) == "cuda"


@contextlib.contextmanager
def stand_in(t: Target = H100) -> Iterator[Target]:
    """Inside, every :func:`target` call answers ``t`` whatever the tensor's device: the
    dispatcher, tile tables and device checks then decide as on that device (nothing can
    *run* on it: pair with a compile-only launch, as ``benchmarks/sass_ab.py`` does)."""
    global _STAND_IN
    saved, _STAND_IN = _STAND_IN, t
    try:
        yield t
    finally:
        _STAND_IN = saved
