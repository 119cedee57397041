"""nemo_ssa.megatron.te_spec: our core attention in megatron's Transformer Engine layer spec.

Without Transformer Engine (this machine) the spec is refused at build time, naming what is
missing and the TE-free spec. What it does to megatron's TE layer is tested on a stand-in with
the TE layer's structure (LayerNorms fused away into the linears: ``IdentityOp`` in
``input_layernorm`` / ``pre_mlp_layernorm``, TE's state-dict key map), built from megatron's
local spec and returned by a patched ``get_gpt_layer_with_transformer_engine_spec``: exactly
the ``core_attention`` slot changes, to our class with the policy's params.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import megatron.core.models.gpt.gpt_layer_specs as gpt_layer_specs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_ssa.megatron import te_spec
from nemo_ssa.megatron.core_attention import SoftmaxCoreAttention, SSAReferenceCoreAttention, SSATritonCoreAttention

PKG = Path(te_spec.__file__).resolve().parent


def tiny_config(**overrides) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             use_cpu_initialization=True, **overrides)


def te_shaped_layer() -> ModuleSpec:
    """megatron's local layer, shaped like its TE layer: the norms fused into the linears."""
    layer = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec())
    layer.submodules.input_layernorm = IdentityOp
    layer.submodules.pre_mlp_layernorm = IdentityOp
    layer.submodules.sharded_state_dict_keys_map = {"mlp.0.weight": "mlp.linear_fc1.layer_norm_weight"}
    return layer


@pytest.fixture
def stand_in_te(monkeypatch):
    """TE "available", megatron's TE builder returning :func:`te_shaped_layer`; yields
    (the layer it returned, the argument lists it was called with)."""
    calls, built = [], []

    def get_gpt_layer_with_transformer_engine_spec(*args, **kwargs):
        calls.append((args, kwargs))
        built.append(te_shaped_layer())
        return built[-1]

    monkeypatch.setattr(te_spec, "te_missing", lambda: None)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        get_gpt_layer_with_transformer_engine_spec)
    return built, calls


# ------------------------------------------------------------------------ without TE
@pytest.mark.skipif(te_spec.te_missing() is None, reason="Transformer Engine is usable here")
def test_without_te_the_spec_is_refused_naming_te_and_the_local_spec():
    with pytest.raises(ImportError) as err:
        te_spec.te_layer_spec(tiny_config(), "softmax")
    msg = str(err.value)
    assert "transformer_engine" in msg and "nemo_ssa.megatron.spec.layer_spec" in msg


def test_no_module_here_imports_transformer_engine():
    """TE is megatron's to import (gpt_layer_specs.HAVE_TE); our modules only read the outcome."""
    for name in ("te_spec.py", "bridge.py"):
        tree = ast.parse((PKG / name).read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "transformer_engine" for n in names), (name, names)


# ------------------------------------------------------------------------ the slot
@pytest.mark.parametrize("attention,cls,params", [
    ("softmax", SoftmaxCoreAttention, {"fused_rope_layout": False}),
    ("ssa_reference", SSAReferenceCoreAttention,
     {"force_contiguous_qkv": True, "n_init": 1.5, "b_init": 0.8, "learnable_n": True, "learnable_b": False}),
    ("ssa_triton", SSATritonCoreAttention,
     {"force_contiguous_qkv": True, "fused_rope_layout": False, "n_init": 1.5, "b_init": 0.8,
      "learnable_n": True, "learnable_b": False}),
])
def test_exactly_the_core_attention_slot_changes(stand_in_te, attention, cls, params):
    built, calls = stand_in_te
    spec = te_spec.te_layer_spec(tiny_config(), attention)
    assert calls == [((), {})]  # megatron's defaults: dense MLP, no qk norm, no MLA
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is cls and core.params == params
    expected = te_shaped_layer()
    expected.submodules.self_attention.submodules.core_attention = core
    assert spec == expected  # every other field, recursively, as megatron built it
    assert built[0] == te_shaped_layer(), "megatron's spec object was modified"


def test_ssa_resolves_for_this_machine_and_takes_the_policy_options(stand_in_te):
    spec = te_spec.te_layer_spec(tiny_config(), "ssa", {"n": 2.0}, policy="free")
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is (SSATritonCoreAttention if torch.cuda.is_available() else SSAReferenceCoreAttention)
    assert core.params["n_init"] == 2.0


@pytest.mark.parametrize("attention,options,policy,error,words", [
    ("nope", None, "pinned", ValueError, "known:"),
    ("nsa", None, "free", NotImplementedError, "local spec"),
    ("ssa_triton", {"fused_rope_layout": True}, "pinned", NotImplementedError, "fused_rope_layout"),
])
def test_refused_attentions_name_what_is_supported(stand_in_te, attention, options, policy, error, words):
    with pytest.raises(error, match=words):
        te_spec.te_layer_spec(tiny_config(), attention, options, policy=policy)


@pytest.mark.parametrize("overrides,words", [
    ({"fp8_dot_product_attention": True}, "fp8_dot_product_attention"),
    ({"normalization": "RMSNorm"}, "supported: 'LayerNorm'"),
    ({"qk_layernorm": True}, "qk_layernorm"),
])
def test_refused_configs_name_what_is_supported(stand_in_te, overrides, words):
    with pytest.raises(NotImplementedError, match=words):
        te_spec.te_layer_spec(tiny_config(**overrides), "softmax")


def test_a_layer_without_the_slot_is_a_type_error():
    with pytest.raises(TypeError, match="core_attention slot"):
        te_spec.with_our_core_attention(ModuleSpec(module=IdentityOp), "softmax")
