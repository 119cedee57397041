"""Ready-made GPT layer specs, one module attribute per attention, for plain megatron-core
and Megatron-LM (no NeMo)::

    # Megatron-LM (megatron.core.transformer.spec_utils.import_module reads the attribute)
    python pretrain_gpt.py --spec nemo_ssa.megatron.layer_specs ssa_triton --transformer-impl local \\
        --no-rope-fusion ...

    # megatron-core
    from nemo_ssa.megatron.layer_specs import ssa_triton
    model = GPTModel(config, transformer_layer_spec=ssa_triton, vocab_size=..., max_sequence_length=...)

Each is :func:`nemo_ssa.megatron.spec.gpt_layer_spec` of that name under the pinned SSA
policy (n = 1.5 learnable, b = 0.8 fixed; docs/megatron-core.md), resolved for this
machine (``ssa`` is the fused kernel with CUDA, the reference without). For other options
call ``gpt_layer_spec(name, options, policy="free")`` -- also the way to the attentions the
pinned policy marks experimental (NSA), which are not here. ``ALL`` maps each name to its spec.
"""

from __future__ import annotations

from nemo_ssa.megatron.spec import gpt_layer_spec
from nemo_ssa.config.attentions import ATTENTIONS


def _pinned():
    specs = {}
    for name in ("ssa", *ATTENTIONS):
        try:
            specs[name] = gpt_layer_spec(name)
        except NotImplementedError:  # experimental under the pinned policy (nsa, ...): policy="free"
            continue
    return specs


ALL = _pinned()
# real module globals, derived from ALL: Megatron-LM's --spec reads them with
# ``vars(module)[name]`` (megatron.core.transformer.spec_utils.import_module), which a
# module ``__getattr__`` would not serve
globals().update(ALL)

__all__ = ["ALL", *ALL]
