"""Shims for the megatron-core versions we support: numpy 2 under 0.15, and 0.16's API changes.

**numpy 2 and megatron-core 0.15.x checkpoints.** megatron-core 0.15.x calls
``np.product`` (removed in numpy 2.0) in three places of ``dist_checkpointing``:

- ``exchange_utils._shard_size`` — every save through ``FullyParallelSaveStrategyWrapper``
  (NeMo's default, ``ckpt_parallel_save=True``) with more than one rank;
- ``validation._validate_sharding_for_key_flattened`` — saves of flattened (distributed
  optimizer ``dp_reshardable``) tensors;
- ``mapping.ShardedTensor.local_coordinates`` — loads of such tensors.

With numpy 2 (the GPU image has 2.5) a run on several ranks trains and then dies at its
first checkpoint with ``AttributeError: module 'numpy' has no attribute 'product'``.
megatron-core 0.16 calls ``np.prod``; 0.15.3 stays the GPU bundle's pin (the one run on
GPUs), so the fix lives here.

**megatron-core 0.16.** Two API changes reach us: ``get_megatron_optimizer`` lost
``no_weight_decay_cond`` / ``scale_lr_cond`` / ``lr_mult`` for ``config_overrides``
(:func:`get_megatron_optimizer_compat` for our own calls, :class:`legacy_optimizer_arguments`
around NeMo 2.7.3's, which still passes them), and DDP now records the first backward's
gradient hooks as the pattern of every step (:func:`forget_ddp_grad_hooks` after the
attention warm-up). tests/test_stack_matrix.py runs the suite's core on 0.16.1.

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

__all__ = ["NUMPY2_MODULES", "apply_megatron_compat", "needs_numpy2_shim", "modules_calling_np_product",
           "get_megatron_optimizer_compat", "legacy_optimizer_arguments", "forget_ddp_grad_hooks"]

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


def get_megatron_optimizer_compat(config, model_chunks, no_weight_decay_cond=None):
    """``megatron.core.optimizer.get_megatron_optimizer`` with a weight-decay rule, on every
    megatron-core we support. Up to 0.15 the rule is the ``no_weight_decay_cond(name, param)``
    argument; 0.16 removed it for ``config_overrides`` keyed by ``ParamKey``: the rule then
    becomes one ``ParamWithNamePredicate`` with ``wd_mult=0`` that replaces megatron's
    standard weight-decay key (its other standard overrides, decoupled LR, stay)."""
    import megatron.core.optimizer as mo

    kw = {} if no_weight_decay_cond is None else {"no_weight_decay_cond": no_weight_decay_cond}
    with legacy_optimizer_arguments():
        return mo.get_megatron_optimizer(config, model_chunks, **kw)


def _takes_legacy_optimizer_arguments() -> bool:
    from megatron.core.optimizer import get_megatron_optimizer

    return "no_weight_decay_cond" in inspect.signature(get_megatron_optimizer).parameters


class legacy_optimizer_arguments:
    """Context manager: inside it, ``megatron.core.optimizer.get_megatron_optimizer`` accepts
    the arguments megatron-core 0.16 removed (``no_weight_decay_cond``, ``scale_lr_cond``,
    ``lr_mult``), as NeMo 2.7.3's ``setup_megatron_optimizer`` passes them. It translates them
    to 0.16's ``config_overrides``: the weight-decay rule as in
    :func:`get_megatron_optimizer_compat`, and ``scale_lr_cond`` with ``lr_mult`` as one more
    ``ParamWithNamePredicate`` with that ``lr_mult``. A no-op on megatron-core <= 0.15."""

    def __enter__(self):
        import megatron.core.optimizer as mo

        self._saved = None
        if _takes_legacy_optimizer_arguments():
            return self
        original = mo.get_megatron_optimizer

        def get_megatron_optimizer(config, model_chunks, no_weight_decay_cond=None, scale_lr_cond=None,
                                   lr_mult=1.0, config_overrides=None, **kwargs):
            if config_overrides is None and (no_weight_decay_cond is not None or scale_lr_cond is not None):
                from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

                config_overrides = {k: v for k, v in mo.get_standard_config_overrides(config=config).items()
                                    if no_weight_decay_cond is None or dict(v).get("wd_mult") != 0.0}
                if no_weight_decay_cond is not None:
                    rule = ParamWithNamePredicate(name="nemo_ssa_no_weight_decay",
                                                  fn=lambda p, n: bool(no_weight_decay_cond(n, p)))
                    config_overrides[ParamKey(with_name_predicate=rule)] = {"wd_mult": 0.0}
                if scale_lr_cond is not None and lr_mult != 1.0:
                    scaled = ParamWithNamePredicate(name="nemo_ssa_scale_lr",
                                                    fn=lambda p, n: bool(scale_lr_cond(n, p)))
                    config_overrides[ParamKey(with_name_predicate=scaled)] = {"lr_mult": float(lr_mult)}
            return original(config, model_chunks, config_overrides=config_overrides, **kwargs)

        self._saved = (mo, original)
        mo.get_megatron_optimizer = get_megatron_optimizer
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            mo, original = self._saved
            mo.get_megatron_optimizer = original
        return False


def forget_ddp_grad_hooks(model) -> int:
    """Clear what megatron's DDP recorded of gradient hooks that fired outside a training step
    (a warm-up's backward). megatron-core >= 0.16 takes the hooks of the first backward it
    sees as the "golden" pattern of every later step and asserts that every parameter of a
    bucket was in it; a warm-up that only reaches the attention's n breaks that. Returns
    the bucket groups cleared (0 on megatron-core without the bookkeeping)."""
    cleared = 0
    for mod in model.modules() if hasattr(model, "modules") else ():
        for group in list(getattr(mod, "bucket_groups", []) or []) + list(
                getattr(mod, "expert_parallel_bucket_groups", []) or []):
            if isinstance(getattr(group, "per_param_grad_ready_counts", None), dict):
                group.per_param_grad_ready_counts = {}
                cleared += 1
    return cleared


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
