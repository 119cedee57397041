"""Plugin-side fixes for megatron-core 0.15.3's optimizers (no edits to the package).

Two checkpointing gaps block what training SSA needs (n in fp32 inside bf16 models; the
distributed optimizer with save and resume). Both are fixed on the optimizer *instances*
the training path builds — ``patch_megatron_optimizer`` is called by the CPU loop after
``get_megatron_optimizer`` and by NeMo through :class:`nemo_ssa.nemo.optim.
SSAMegatronOptimizerModule` (the recipe's ``optim``) — never on megatron's classes:

1. **An fp32 parameter inside a bf16/fp16 model** (``Float16OptimizerWithFloat16Params``).
   megatron's ``sharded_state_dict`` numbers the model parameters by enumerating only the
   half-precision ones, while the optimizer's state ids count every parameter of every
   group: one fp32 parameter (SSA's ``n``) shifts every later id, and the checkpoint maps
   Adam moments to the wrong tensors ("Optimizer shape (1,) does not match model shape
   (768,)", recorded in docs/results/2026-11-22-gpu-proof.md). :func:`_float16_sharded_state_dict`
   enumerates the parameters in the optimizer's own order (each fp32 master copy stands
   for its half-precision model parameter, an fp32 parameter for itself). With no fp32
   parameter it produces exactly megatron's state dict (tested), so it is installed only
   where one exists.

2. **The distributed optimizer with torch's Adam** (no Transformer Engine, no Apex — the
   project's GPU image). megatron reads the Adam ``step`` from per-parameter state, which
   torch creates at the first ``step()``; before it (a resume builds the optimizer, then
   asks for the *loading* template) ``state_dict()`` fails ``assert len(steps) == 1``.
   :func:`_init_adam_state` allocates the state (zeros, step 0; the checkpoint then
   overwrites it) before a loading template is built. The *saving* side has a separate
   limit: megatron's default ``dp_reshardable`` format puts torch Adam's 0-d ``step`` into
   a flat bucket and asserts (``AssertionError: (torch.Size([]), 0, 768)``, the H200 run
   above, with softmax as much as SSA); the ``fully_reshardable`` format (NeMo's
   ``ckpt_optim_fully_reshardable=True``, which the recipe sets with the distributed
   optimizer) saves it correctly and also reshards across TP/CP/DP.

3. **The distributed optimizer with fp32 parameters inside a half-precision model.**
   ``DistributedOptimizer`` records each model parameter's position in its optimizer group
   (``model_param_group_index_map``) in buffer order, then builds the group as
   ``[*fp32 shards, *fp32 masters of half shards]``: with both kinds in one group every
   recorded position is wrong, and checkpointing reads another parameter's state ("output
   with shape [1] doesn't match the broadcast shape [32]" on CPU; silently wrong state
   where shapes happen to agree). :func:`_fix_group_index_map` rebuilds the map from the
   groups as built (checked element by element). Training itself never reads the map.

4. **Loading the fully reshardable format with torch's Adam.** megatron copies every key
   of the live per-parameter state (torch Adam's ``step`` included) from the loaded
   tensors, which never carry ``step`` (it is restored from the param groups):
   ``KeyError: 'step'`` on every resume. :func:`_set_main_param_and_optimizer_states`
   copies the keys the checkpoint has and refuses any other missing one.

5. **One shared Adam step after a distributed-optimizer load (torch's Adam).**
   ``DistributedOptimizer.load_state_dict`` puts the *same* ``step`` tensor into every
   parameter's state; torch's Adam increments each parameter's step in place, so after
   the first step of a resumed run the shared counter has advanced once per parameter and
   every bias correction is wrong (the resumed curve leaves the uninterrupted one at the
   second step after the resume; tested). The wrapped ``load_state_dict`` gives every
   parameter its own copy.
"""

from __future__ import annotations

import types
from typing import Iterable, List

import torch

__all__ = ["patch_megatron_optimizer", "inner_optimizers"]


def inner_optimizers(opt) -> List:
    """The megatron optimizers inside ``opt`` (a ChainedOptimizer, NeMo's wrapper, or one)."""
    opt = getattr(opt, "mcore_optimizer", opt)
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def patch_megatron_optimizer(opt) -> List[str]:
    """Install the fixes above on every inner optimizer that needs them; returns what was done."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    done = []
    for inner in inner_optimizers(opt):
        if getattr(inner, "_nemo_ssa_patched", False):
            continue
        if isinstance(inner, DistributedOptimizer):
            _wrap_loading_template(inner)
            done.append("distributed optimizer: Adam state allocated before a loading template")
            if _fix_group_index_map(inner):
                done.append("distributed optimizer: parameter positions of mixed fp32/half groups")
            _wrap_load_state_dict(inner)
            done.append("distributed optimizer: one Adam step tensor per parameter after a load")
            if not inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                inner._set_main_param_and_optimizer_states = types.MethodType(
                    _set_main_param_and_optimizer_states, inner)
                done.append("distributed optimizer: load without torch Adam's step in the tensors")
        elif isinstance(inner, Float16OptimizerWithFloat16Params) and not inner.is_stub_optimizer \
                and any(len(g) for g in inner.fp32_from_fp32_groups):
            inner.sharded_state_dict = types.MethodType(_float16_sharded_state_dict, inner)
            done.append("float16 optimizer: fp32 parameters mapped in optimizer order")
        inner._nemo_ssa_patched = True
    return done


# ----------------------------------------------------------------------- fix 1: float16


def _model_params_in_optimizer_order(self) -> Iterable[torch.nn.Parameter]:
    """For each parameter of the torch optimizer (group by group): the model parameter it
    stands for (a half-precision parameter for its fp32 master copy, else itself)."""
    main_to_model = {}
    for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            main_to_model[id(main_param)] = model_param
    for group in self.optimizer.param_groups:
        for p in group["params"]:
            yield main_to_model.get(id(p), p)


def _float16_sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """``Float16OptimizerWithFloat16Params.sharded_state_dict`` with fp32 parameters allowed."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    id_to_sharded_param_map = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, _model_params_in_optimizer_order(self))
    # fp32 master copies of the half-precision parameters, under their own optimizer ids
    groups = state_dict["optimizer"]["param_groups"]
    assert len(groups) == len(self.optimizer.param_groups) == len(self.fp32_from_float16_groups)
    fp32_from_fp16 = []
    for state_group, opt_group, main_group in zip(groups, self.optimizer.param_groups, self.fp32_from_float16_groups):
        main_ids = {id(p) for p in main_group}
        ids = [pid for pid, p in zip(state_group["params"], opt_group["params"]) if id(p) in main_ids]
        assert len(ids) == len(main_group)
        fp32_from_fp16.append([
            make_sharded_optimizer_tensor(id_to_sharded_param_map[pid], main, prefix="optimizer.state.fp32_param")
            for pid, main in zip(ids, main_group)
        ])
    state_dict["fp32_from_fp16_params"] = fp32_from_fp16
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


# ------------------------------------------------------------ fix 2: distributed optimizer


def _init_adam_state(inner) -> None:
    """Allocate torch Adam's per-parameter state (zeros, step 0) where it is missing."""
    opt = inner.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
                opt.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _wrap_loading_template(inner) -> None:
    from megatron.core.optimizer import distrib_optimizer as dmod

    original = inner.sharded_state_dict

    def sharded_state_dict(model_sharded_state_dict=None, is_loading: bool = False, *args, **kwargs):
        if is_loading and not dmod.HAVE_APEX_OR_TE:
            _init_adam_state(inner)
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original(model_sharded_state_dict, is_loading, *args, **kwargs)

    inner.sharded_state_dict = sharded_state_dict


def _fix_group_index_map(inner) -> bool:
    """Rebuild ``model_param_group_index_map`` as the groups were built (fix 3). True if
    anything changed."""
    if inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or inner.optimizer is None:
        return False
    changed = False
    new_map = {}
    for g, group in enumerate(inner.optimizer.param_groups):
        models = list(inner.model_fp32_groups[g]) + list(inner.model_float16_groups[g])
        shards = list(inner.shard_fp32_groups[g]) + list(inner.shard_fp32_from_float16_groups[g])
        if len(models) != len(group["params"]) or any(a is not b for a, b in zip(shards, group["params"])):
            raise RuntimeError("nemo_ssa optimizer fix: the distributed optimizer's groups are not "
                               "[*fp32 shards, *fp32 masters] as megatron-core 0.15.3 builds them; "
                               "refusing to remap parameter positions")
        for i, model_param in enumerate(models):
            new_map[model_param] = (g, i)
            changed |= inner.model_param_group_index_map.get(model_param) != (g, i)
    if set(new_map) != set(inner.model_param_group_index_map):
        raise RuntimeError("nemo_ssa optimizer fix: parameter sets differ; refusing to remap")
    inner.model_param_group_index_map = new_map
    return changed


def _set_main_param_and_optimizer_states(self, model_param, tensors):
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` copying the keys the
    loaded ``tensors`` have (fix 4); the Adam ``step`` comes from the param groups."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    dst_tensors = {"param": main_param, **self.optimizer.state[main_param]}
    missing = set(dst_tensors) - set(tensors) - {"step"}
    if missing:
        raise KeyError(f"optimizer state keys {sorted(missing)} missing from the checkpoint")
    for key, value in tensors.items():
        dst_tensors[key].copy_(value)


def _wrap_load_state_dict(inner) -> None:
    original = inner.load_state_dict

    def load_state_dict(state_dict):
        out = original(state_dict)
        opt = inner.optimizer
        if isinstance(opt, torch.optim.Optimizer):
            for st in opt.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].detach().clone()
        return out

    inner.load_state_dict = load_state_dict
