"""Compatibility of the megatron-core versions we support with the numpy they run beside.

**numpy 2 and megatron-core 0.15.x checkpoints.** megatron-core 0.15.x calls
``np.product`` (removed in numpy 2.0) in three places of ``dist_checkpointing``:

- ``exchange_utils._shard_size`` — every save through ``FullyParallelSaveStrategyWrapper``
  (NeMo's default, ``ckpt_parallel_save=True``) with more than one rank;
- ``validation._validate_sharding_for_key_flattened`` — saves of flattened (distributed
  optimizer ``dp_reshardable``) tensors;
- ``mapping.ShardedTensor.local_coordinates`` — loads of such tensors.

With numpy 2 (the GPU image has 2.5) a run on several ranks trains and then dies at its
first checkpoint with ``AttributeError: module 'numpy' has no attribute 'product'``.
megatron-core 0.16 calls ``np.prod``, but NeMo 2.7.3's training path does not run on 0.16
(it passes ``get_megatron_optimizer`` arguments 0.16 removed), so the fix lives here.

The shim is as narrow as it can be: it touches neither numpy nor any megatron function.
In those three modules only, the module-global name ``np`` is rebound to a view of numpy
that also has ``product`` (= ``np.prod``, the function numpy 1 aliased it to). It is
applied only where it is needed: numpy without ``product`` *and* a megatron-core module
whose source calls ``np.product``. Nothing changes on numpy 1 or on megatron-core >= 0.16.

:func:`apply_megatron_compat` is called by the recipe builder (so every NeMo rank gets it
before its trainer is built) and by the CPU training loop; it is idempotent and returns
what it patched. tests/megatron/test_compat.py saves and resumes a two-rank checkpoint
under numpy 2 with and without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types
from typing import List

import numpy

__all__ = ["NUMPY2_MODULES", "apply_megatron_compat", "needs_numpy2_shim", "modules_calling_np_product"]

#: megatron-core modules that call ``np.product`` (0.15.x; tests check the list against the
#: installed package's source)
NUMPY2_MODULES = (
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.validation",
    "megatron.core.dist_checkpointing.mapping",
)


class _NumpyWithProduct(types.ModuleType):
    """numpy as seen by one megatron module: every attribute is numpy's, plus ``product``."""

    def __init__(self, base: types.ModuleType):
        super().__init__(base.__name__, base.__doc__)
        self.__dict__["_base"] = base
        self.__dict__["product"] = base.prod

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_base"], name)

    def __repr__(self) -> str:
        return f"<numpy {self._base.__version__} with product=prod (nemo_ssa.megatron.compat)>"


def needs_numpy2_shim(np_module: types.ModuleType = numpy) -> bool:
    """True where ``np.product`` is gone (numpy >= 2)."""
    return not hasattr(np_module, "product")


def _calls_np_product(module: types.ModuleType) -> bool:
    try:
        return "np.product(" in inspect.getsource(module)
    except (OSError, TypeError):  # no source (compiled-only install): assume the known list
        return True


def modules_calling_np_product() -> List[str]:
    """Every module of the installed ``megatron.core.dist_checkpointing`` whose source calls
    ``np.product`` (what the shim must cover; a test compares it with :data:`NUMPY2_MODULES`)."""
    import pkgutil

    import megatron.core.dist_checkpointing as dc

    found = []
    for info in pkgutil.walk_packages(dc.__path__, dc.__name__ + "."):
        try:
            spec = importlib.util.find_spec(info.name)
            with open(spec.origin, encoding="utf-8") as f:
                if "np.product(" in f.read():
                    found.append(info.name)
        except (OSError, TypeError, AttributeError, ImportError):
            continue
    return sorted(found)


def apply_megatron_compat(np_module: types.ModuleType = numpy) -> List[str]:
    """Apply the numpy 2 shim where it is needed; returns the modules patched by this call
    (empty on numpy 1, on megatron-core without ``np.product``, or when already applied)."""
    if not needs_numpy2_shim(np_module):
        return []
    patched = []
    for name in NUMPY2_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "np", None)
        if isinstance(current, _NumpyWithProduct) or current is not np_module:
            continue  # already shimmed, or the module no longer uses numpy as ``np``
        if not _calls_np_product(module):
            continue
        module.np = _NumpyWithProduct(np_module)
        patched.append(name)
    return patched


def main() -> int:
    """``python -m nemo_ssa.megatron.compat``: what this environment needs and gets (run it
    on a new image: exit 1 if megatron still calls a numpy function the installed numpy lacks)."""
    import megatron.core

    calls = modules_calling_np_product()
    patched = apply_megatron_compat()
    print(f"numpy {numpy.__version__}, megatron-core {megatron.core.__version__}")
    print(f"modules calling np.product: {calls or 'none'}")
    print(f"numpy 2 shim: {'applied to ' + ', '.join(patched) if patched else 'not needed'}")
    import sys

    missing = [m for m in calls if needs_numpy2_shim()
               and not isinstance(getattr(sys.modules.get(m), "np", None), _NumpyWithProduct)]
    if missing:
        print(f"NOT covered: {missing}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
