"""nemo_ssa.config.attentions: the one attention table, and everything derived from it.

The table and nemo_ssa/configs/attention/*.yaml name the same attentions with the same options;
the policy, the layer spec, the core attentions and the ops registry read their names,
option keys, classes and op keys from it; and the checkpoint keys each attention's layer
writes are the ones recorded below (taken from the code before the table existed), so
checkpoints keep loading.
"""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from nemo_ssa.config import policy
from nemo_ssa.config.attentions import (
    ALIASES,
    ATTENTIONS,
    KERNEL_OPTION_KEYS,
    NSA_OPTION_KEYS,
    SSA_OPTION_KEYS,
    AttentionInfo,
    attention_for_module,
    option_keys,
)
from nemo_ssa.ops import registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _yaml_configs():
    configs = {}
    for path in sorted(glob.glob(os.path.join(REPO, "nemo_ssa", "configs", "attention", "*.yaml"))):
        with open(path) as f:
            cfg = yaml.safe_load(f)
        assert cfg["name"] == os.path.basename(path)[: -len(".yaml")], path
        configs[cfg["name"]] = cfg
    return configs


def test_every_yaml_is_a_table_row_and_every_row_has_a_yaml():
    assert set(_yaml_configs()) == set(ATTENTIONS) | set(ALIASES)


@pytest.mark.parametrize("name", sorted(set(ATTENTIONS) | set(ALIASES)))
def test_yaml_options_are_the_tables(name):
    options = _yaml_configs()[name].get("options") or {}
    assert list(options) == list(option_keys(name))
    if name in ATTENTIONS:  # the config offers the table's defaults
        defaults = dict.fromkeys(SSA_OPTION_KEYS) if ATTENTIONS[name].transform == "ssa" else {}
        defaults.update(ATTENTIONS[name].kernel_options)
        assert options == defaults


def test_option_keys_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="known: .*ssa_triton"):
        option_keys("ssa_trition")


def test_row_fields_are_checked():
    with pytest.raises(ValueError, match="family"):
        AttentionInfo("x", "linear", "stable", "")
    with pytest.raises(ValueError, match="status"):
        AttentionInfo("x", "ssa", "beta", "")


def test_policy_reads_the_table():
    assert policy.ATTENTIONS is ATTENTIONS and policy.KERNEL_OPTION_KEYS is KERNEL_OPTION_KEYS
    assert policy.SSA_OPTION_KEYS is SSA_OPTION_KEYS and policy.ALIASES is ALIASES
    assert KERNEL_OPTION_KEYS == {n: tuple(a.kernel_options) for n, a in ATTENTIONS.items() if a.kernel_options}


def test_nsa_option_keys_are_nsaconfig_fields():
    import dataclasses

    from nemo_ssa.ops.nsa import NSAConfig

    # compress_hidden (φ's hidden width) is not offered as an attention option
    assert set(NSA_OPTION_KEYS) == {f.name for f in dataclasses.fields(NSAConfig)} - {"compress_hidden"}


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_every_op_key_is_registered(name):
    info = ATTENTIONS[name]
    for key in (info.op_key, info.varlen_op_key):
        if key:
            assert callable(registry.get_attention_fn(*key))
    assert info.op_key


def test_nsa_rows_look_up_the_nsa_functions():
    from nemo_ssa.ops.nsa import nsa_attention, nsa_attention_naive

    assert registry.get_attention_fn("nsa", "staged") is nsa_attention
    assert registry.get_attention_fn("nsa", "reference") is nsa_attention_naive


# ------------------------------------------------------------------- megatron side
@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_modules_take_name_and_op_from_their_row(name):
    from nemo_ssa.megatron.spec import CORE_ATTENTIONS

    info = ATTENTIONS[name]
    if info.family == "nsa":
        assert name not in CORE_ATTENTIONS
        assert attention_for_module(info.module, info.transform) is info
        return
    cls = CORE_ATTENTIONS[name]
    assert f"{cls.__module__}:{cls.__name__}" == info.module
    assert (cls.attention_name, cls.op_key, cls.varlen_op_key) == (name, info.op_key, info.varlen_op_key)
    assert cls.supported_head_dims == info.head_dims
    assert cls.supports_fused_rope_layout == ("fused_rope_layout" in info.kernel_options)


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_no_docstring_states_a_status_other_than_the_rows(name):
    """The status lives in the table; a class or op docstring that names one agrees with it
    (``ssa_flex`` was "experimental" in two docstrings and "stable" in the table)."""
    import importlib
    import re

    info = ATTENTIONS[name]
    module, cls = info.module_path
    docs = [getattr(importlib.import_module(module), cls).__doc__ or ""]
    docs.append(getattr(registry.get_attention_fn(*info.op_key), "__doc__", "") or "")
    stated = {w for d in docs for w in re.findall(r"\b(experimental|stable)\b", d.split("\n\n")[0])}
    assert stated <= {info.status}, (name, info.status, stated)


def test_core_attentions_are_every_non_nsa_row():
    from nemo_ssa.megatron.spec import CORE_ATTENTIONS

    assert set(CORE_ATTENTIONS) == {n for n, a in ATTENTIONS.items() if a.family != "nsa"}


def test_attention_for_module_needs_one_row():
    with pytest.raises(ValueError, match="expected one"):
        attention_for_module("nemo_ssa.megatron.nsa_attention:NSASelfAttention")  # nsa and nsa_ssa
    with pytest.raises(ValueError, match="expected one"):
        attention_for_module("nowhere:Nothing")


#: every layer's keys outside its attention (LayerNorm1P, megatron's local linears and MLP)
LAYER_KEYS = [
    "input_layernorm.bias", "input_layernorm.weight",
    "mlp.linear_fc1._extra_state", "mlp.linear_fc1.weight", "mlp.linear_fc2._extra_state", "mlp.linear_fc2.weight",
    "pre_mlp_layernorm.bias", "pre_mlp_layernorm.weight",
    "self_attention.linear_proj._extra_state", "self_attention.linear_proj.weight",
    "self_attention.linear_qkv._extra_state", "self_attention.linear_qkv.weight",
]
_SSA_CORE = ["self_attention.core_attention.b", "self_attention.core_attention.n"]
_NSA = ["self_attention.linear_gate._extra_state", "self_attention.linear_gate.bias",
        "self_attention.linear_gate.weight"] + [f"self_attention.phi_{kv}.{p}" for kv in "kv"
                                                for p in ("b1", "b2", "pe", "w1", "w2")]
#: the attention's own keys of one GPT layer (gpt_layer_spec(name, policy="free")), as the
#: code wrote them before the attention table: checkpoints depend on these names
ATTENTION_KEYS = {
    "softmax": [],
    "softmax_triton": [],
    "elsa": [],
    "ssa_reference": _SSA_CORE,
    "ssa_triton": _SSA_CORE,
    "ssa_flex": _SSA_CORE,
    "elsa_ssa": _SSA_CORE,
    "nsa": _NSA,
    "nsa_ssa": _NSA + ["self_attention.b", "self_attention.n"],
}


def test_checkpoint_key_list_covers_the_table():
    assert set(ATTENTION_KEYS) == set(ATTENTIONS)


@pytest.mark.parametrize("name", sorted(ATTENTION_KEYS))
def test_checkpoint_keys_unchanged(megatron_cpu, name):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.megatron.spec import gpt_layer_spec

    # head dim 16: the smallest the fused Triton kernels build for
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, add_bias_linear=False, apply_rope_fusion=False,
                            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False, attention_dropout=0.0)
    with cpu_device_shims():
        layer = build_module(gpt_layer_spec(name, policy="free"), config=cfg, layer_number=1)
    expected = sorted(LAYER_KEYS + ATTENTION_KEYS[name])
    assert sorted(layer.state_dict()) == expected
    assert sorted(layer.sharded_state_dict(prefix="decoder.layers.")) == [f"decoder.layers.{k}" for k in expected]
