"""Whole-block specs, one callable per attention, for Megatron-LM's ``--spec``::

    torchrun --nproc-per-node 1 -m nemo_ssa.megatron.lm_pretrain --spec nemo_ssa.megatron.block_specs ssa_triton

``nemo_ssa.megatron.layer_specs.<name>`` is one layer's ``ModuleSpec``: megatron repeats it and
adds its own final norm, which without Transformer Engine refuses zero-centred gamma
(``--apply-layernorm-1p``), and it keeps megatron's MLP (the fused MLP needs the config). A
callable here is ``(config, vp_stage=None) -> TransformerBlockSubmodules``, which megatron-core
0.19's ``GPTModelBuilder`` calls with the run's config: every layer plus our final LayerNorm1P,
the fused squared-ReLU MLP where the config allows it (``fused_mlp="auto"``), the pinned SSA
policy -- the NeMo recipe's model (nemo_ssa.megatron.spec.layer_spec). Megatron-LM's older
``pretrain_gpt.py`` (up to 0.16) hands ``--spec`` to ``GPTModel`` as it is and needs the
``layer_specs`` form.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from nemo_ssa.megatron.layer_specs import ALL as _LAYER_SPECS
from nemo_ssa.megatron.spec import layer_spec


def _block_spec(name: str) -> Callable:
    def spec(config, vp_stage: Optional[int] = None):
        # megatron.training's GPTModelConfig proxies the TransformerConfig; hand the real one
        return layer_spec(getattr(config, "transformer", config), name, fused_mlp="auto", vp_stage=vp_stage)

    spec.__name__ = spec.__qualname__ = name
    spec.__doc__ = f"The block spec of {name!r} for ``config`` (see the module docstring)."
    return spec


#: name -> callable(config, vp_stage=None), the names of nemo_ssa.megatron.layer_specs
ALL: Dict[str, Callable] = {name: _block_spec(name) for name in _LAYER_SPECS}
# real module globals: megatron's import_module reads ``vars(module)[name]``
globals().update(ALL)

__all__ = ["ALL", *ALL]
