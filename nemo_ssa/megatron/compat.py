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

**megatron-core 0.17-0.19.** Each API change that reaches us is decided in one function
below, from the fact it depends on (a signature, the shape of a spec slot), never from a
version number; each records what it decided and why (:func:`decisions`, printed by
``python -m nemo_ssa.megatron.compat``):

- :func:`local_layer_spec`: 0.17 made ``get_gpt_layer_local_spec(*args, **kwargs)`` forward
  to ``get_gpt_layer_local_submodules``; our keywords are checked against whichever declares them;
- :func:`mlp_slot`: 0.18 builds the MLP slot as ``partial(MLP.as_mlp_submodule,
  submodules=...)`` instead of ``ModuleSpec(MLP, submodules=...)`` (no ``.submodules``);
- :func:`accepted_kwargs`: 0.18 added ``name=`` to megatron's modules; we hand it on only to
  the megatron constructors that take it;
- :func:`default_save_sharded_strategy`: 0.19 dropped the ``version`` argument of
  ``get_default_save_sharded_strategy``.

0.19 also loads a checkpoint's common state with ``torch.load(weights_only=True)``:
nemo_ssa/train/checkpoint_io.py keeps that state to plain containers, numbers and tensors.
tests/megatron/test_contracts.py checks these decisions against the 0.16-0.19 sources.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import types
from typing import Any, Dict, List, Tuple

import numpy

__all__ = ["NUMPY2_MODULES", "apply_megatron_compat", "needs_numpy2_shim", "modules_calling_np_product",
           "get_megatron_optimizer_compat", "legacy_optimizer_arguments", "forget_ddp_grad_hooks",
           "decisions", "local_layer_spec", "local_spec_parameters", "mlp_slot", "accepted_kwargs",
           "default_save_sharded_strategy", "save_strategy_args"]

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------ megatron-core 0.17-0.19 API
_DECISIONS: Dict[str, str] = {}


def _decided(thing: str, what: str) -> None:
    """Record (and log once) what was decided for ``thing``."""
    if _DECISIONS.get(thing) != what:
        _DECISIONS[thing] = what
        log.info("megatron-core compat: %s: %s", thing, what)


def decisions() -> Dict[str, str]:
    """What each adapter below decided in this process, and why."""
    return dict(_DECISIONS)


def local_spec_parameters(spec_builder: Any = None, submodules_builder: Any = None) -> Tuple[List[str], str]:
    """The keywords megatron's local GPT layer spec takes, and which function declares them:
    ``get_gpt_layer_local_spec`` itself, or (0.17+, where it is ``(*args, **kwargs)``)
    ``get_gpt_layer_local_submodules``, which it forwards to. The builders default to the
    installed ones; tests pass signatures parsed from other versions."""
    if spec_builder is None:
        import megatron.core.models.gpt.gpt_layer_specs as specs

        spec_builder = inspect.signature(specs.get_gpt_layer_local_spec)
        fn = getattr(specs, "get_gpt_layer_local_submodules", None)
        submodules_builder = None if fn is None else inspect.signature(fn)
    P = inspect.Parameter
    params = list(spec_builder.parameters.values())
    if any(p.kind == P.VAR_KEYWORD for p in params):
        if submodules_builder is None:
            raise RuntimeError("megatron-core's get_gpt_layer_local_spec takes **kwargs and there is no "
                               "get_gpt_layer_local_submodules to read its keywords from; supported: "
                               "megatron-core 0.15-0.19")
        params, where = list(submodules_builder.parameters.values()), "get_gpt_layer_local_submodules"
    else:
        where = "get_gpt_layer_local_spec"
    return [p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)], where


def local_layer_spec(**kwargs):
    """``get_gpt_layer_local_spec(**kwargs)`` with the keywords checked first, so an argument
    a version renamed or removed is an error naming what that version takes, not a
    ``TypeError`` from deep inside the builder."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    names, where = local_spec_parameters()
    _decided("local layer spec", f"keywords checked against {where}")
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise TypeError(f"megatron-core's local GPT layer spec takes no {unknown} ({where} takes {names})")
    return get_gpt_layer_local_spec(**kwargs)


def mlp_slot(slot: Any, module: type):
    """megatron's dense MLP slot of the local layer spec, with ``module`` (an ``MLP``
    subclass) in place of ``MLP``.

    - ``ModuleSpec(module=MLP, submodules=...)`` (megatron-core <= 0.17): the same spec with
      ``module``; TransformerLayer builds it through ``build_module``.
    - ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` (0.18+): the same partial
      of ``module.as_mlp_submodule``; TransformerLayer calls it with ``config``,
      ``pg_collection``, ``is_mtp_layer`` and ``name``.
    """
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(slot, ModuleSpec) and slot.module is MLP:
        _decided("mlp slot", "ModuleSpec(MLP, submodules=...) -> ModuleSpec(ours, same submodules and params)")
        return ModuleSpec(module=module, params=dict(slot.params), submodules=slot.submodules)
    func = getattr(slot, "func", None)
    if isinstance(slot, functools.partial) and getattr(func, "__name__", "") == "as_mlp_submodule" \
            and getattr(func, "__self__", None) is MLP:
        _decided("mlp slot", "partial(MLP.as_mlp_submodule, ...) -> partial(ours.as_mlp_submodule, same arguments)")
        return functools.partial(module.as_mlp_submodule, *slot.args, **slot.keywords)
    raise TypeError(f"MLP slot {slot!r} is not megatron's dense MLP; supported: ModuleSpec(module=MLP, ...) "
                    "(megatron-core <= 0.17) or functools.partial(MLP.as_mlp_submodule, submodules=...) (0.18+)")


def accepted_kwargs(target: Any, **optional) -> Dict[str, Any]:
    """The ``optional`` keywords (None values left out) that ``target`` -- a class, a
    ``ModuleSpec`` or a function -- declares: ``name=`` reaches megatron's modules from 0.18
    on, and an older constructor must not be handed it."""
    cls = getattr(target, "module", target)
    fn = cls.__init__ if isinstance(cls, type) else cls
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in optional.items() if v is not None and (k in params or var_kw)}


def save_strategy_args(signature: inspect.Signature, backend: str = "torch_dist") -> Tuple[tuple, str]:
    """The arguments for ``get_default_save_sharded_strategy`` of this signature, and why:
    up to 0.18 it takes ``(backend, version)`` and we pass version 1 (torch_dist's only
    one); 0.19 removed ``version``."""
    if "version" in signature.parameters:
        return (backend, 1), "get_default_save_sharded_strategy(backend, version=1)"
    return (backend,), "get_default_save_sharded_strategy(backend): this megatron-core has no version argument"


def default_save_sharded_strategy(backend: str = "torch_dist"):
    """megatron's default save strategy for ``backend`` on every megatron-core we support."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    args, why = save_strategy_args(inspect.signature(get_default_save_sharded_strategy), backend)
    _decided("save strategy", why)
    return get_default_save_sharded_strategy(*args)


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
    names, where = local_spec_parameters()
    print(f"local layer spec keywords: from {where}")
    print(f"save strategy: {save_strategy_args(_save_strategy_signature())[1]}")
    if missing:
        print(f"NOT covered: {missing}")
        return 1
    return 0


def _save_strategy_signature() -> inspect.Signature:
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    return inspect.signature(get_default_save_sharded_strategy)


if __name__ == "__main__":
    raise SystemExit(main())


def yarn_concentration_factor(config) -> float:
    """YaRN's attention concentration factor (``mscale``) for ``config``, which megatron's own
    RoPE applies: megatron-core's function where it has one (0.15+), else 1.0 -- megatron-core
    0.14's SelfAttention applies RoPE without it."""
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )
    except ImportError:
        return 1.0
    return _yarn_get_concentration_factor_from_config(config)
