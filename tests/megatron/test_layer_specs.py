"""nemo_ssa.megatron.layer_specs: the ready-made specs, read the way Megatron-LM's
``pretrain_gpt.py --spec MODULE NAME`` reads them (megatron's ``import_module``: the module
attribute itself), each one layer with the named core attention, LayerNorm1P and no config
needed; a GPTModel built from one on CPU runs forward."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.spec_utils import ModuleSpec, import_module

from nemo_ssa.megatron import layer_specs
from nemo_ssa.megatron.core_attention import SSAReferenceCoreAttention, SSATritonCoreAttention
from nemo_ssa.megatron.layernorm import LayerNorm1P


@pytest.mark.parametrize("name,cls", [("ssa_triton", SSATritonCoreAttention),
                                      ("ssa_reference", SSAReferenceCoreAttention)])
def test_megatron_lm_spec_argument_reads_a_module_spec(name, cls):
    spec = import_module(("nemo_ssa.megatron.layer_specs", name))
    assert isinstance(spec, ModuleSpec)
    assert spec.submodules.self_attention.submodules.core_attention.module is cls
    assert spec.submodules.input_layernorm is LayerNorm1P


def test_every_pinned_attention_is_there_and_ssa_resolves_for_this_machine():
    assert {"ssa", "ssa_triton", "ssa_reference", "softmax", "softmax_triton"} <= set(layer_specs.ALL)
    want = SSATritonCoreAttention if torch.cuda.is_available() else SSAReferenceCoreAttention
    assert layer_specs.ssa.submodules.self_attention.submodules.core_attention.module is want


def test_gpt_model_from_the_layer_spec_runs(megatron_cpu):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from nemo_ssa.megatron.cpu import cpu_device_shims

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, add_bias_linear=False, apply_rope_fusion=False,
                            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False)
    with cpu_device_shims():
        model = GPTModel(cfg, transformer_layer_spec=layer_specs.ssa_reference, vocab_size=64,
                         max_sequence_length=16, position_embedding_type="rope")
        tokens = torch.randint(0, 64, (2, 16))
        out = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
    assert out.shape == (2, 16) and torch.isfinite(out).all()
    cores = [m for m in model.modules() if isinstance(m, SSAReferenceCoreAttention)]
    assert len(cores) == 2
