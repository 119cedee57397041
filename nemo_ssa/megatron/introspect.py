"""Find our core attentions and SSA parameters inside a built (possibly wrapped) model."""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from nemo_ssa.megatron.core_attention import SSAScalars, _TransformedSoftmaxAttention

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
#: where SSA scalars live: a core attention's, or NSASelfAttention's (nsa_ssa: no core attention)
_SSA_PARAM_RE = re.compile(r"(^|\.)(core_attention|self_attention)\.(n|b)$")


def core_attentions(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every core attention in the model, in layer order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _TransformedSoftmaxAttention)]


def ssa_values(model: torch.nn.Module) -> Dict[str, Dict[int, float]]:
    """Current SSA scalars per layer: ``{"n": {1: 1.5, ...}, "b": {...}}`` (layers 1-based).

    Every module holding :class:`SSAScalars` counts: the SSA core attentions and
    ``NSASelfAttention`` with the SSA transform (``nsa_ssa``).
    """
    out: Dict[str, Dict[int, float]] = {"n": {}, "b": {}}
    mods = ssa_modules(model)
    if not mods:
        return out
    # one device-to-host read for every layer's n and b, instead of two syncs per layer
    vals = torch.cat([t.detach().float().reshape(-1)[:1] for _, m in mods for t in (m.n, m.b)]).tolist()
    for i, (layer, _) in enumerate(mods):
        out["n"][layer], out["b"][layer] = vals[2 * i], vals[2 * i + 1]
    return out


def ssa_modules(model: torch.nn.Module) -> List[Tuple[int, torch.nn.Module]]:
    """``[(layer (1-based), module)]`` for every module holding SSA scalars, in model order."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, SSAScalars) and getattr(mod, "n", None) is not None:
            layer = getattr(mod, "layer_number", None)
            match = _LAYER_RE.search(name + ".")
            if match is not None:
                layer = int(match.group(1)) + 1
            found.append((layer, mod))
    return found


def is_ssa_parameter(name: str) -> bool:
    """``...core_attention.n``/``.b`` (SSA core attentions) or ``...self_attention.n``/``.b``
    (``nsa_ssa``; megatron's own self attention has no such attribute)."""
    return _SSA_PARAM_RE.search(name) is not None


def no_weight_decay_cond(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default rule (biases and 1-d tensors are exempt) plus SSA's n and b by name.

    The name check keeps n exempt even if a future implementation stores it with another
    shape (a 0-d tensor would otherwise be decayed by the default rule).
    """
    return name.endswith(".bias") or len(param.shape) == 1 or is_ssa_parameter(name)
