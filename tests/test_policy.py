"""The pinned SSA policy (nemo_ssa.config.policy.resolve_attention)."""

import json
import logging
import os
import sys

import pytest

from nemo_ssa.config.policy import (
    ALIASES,
    ATTENTIONS,
    KERNEL_OPTION_KEYS,
    SSA_OPTION_KEYS,
    AttentionInfo,
    ResolvedAttention,
    SSAPolicy,
    resolve_attention,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PINNED_OPTIONS = {"n": 1.5, "learnable_n": True, "n_min": None, "b": 0.8, "learnable_b": False,
                  "force_contiguous_qkv": True}
EXPERIMENTAL = ["nsa", "nsa_ssa", "elsa", "elsa_ssa"]
NSA_TINY = {"block_len": 4, "stride": 2, "select_block": 8, "top_n": 4, "window": 8}


@pytest.fixture
def policy_log(caplog):
    caplog.set_level(logging.WARNING, logger="nemo_ssa.policy")
    return caplog


def warnings_logged(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "nemo_ssa.policy" and r.levelno == logging.WARNING]


def test_ssa_resolves_to_the_pinned_fused_kernel(policy_log):
    r = resolve_attention("ssa")
    assert (r.requested, r.name, r.family, r.policy) == ("ssa", "ssa_triton", "ssa", "pinned")
    assert r.options == PINNED_OPTIONS
    assert r.warnings == [] and warnings_logged(policy_log) == []


def test_ssa_means_the_reference_on_cpu_and_says_so(policy_log):
    r = resolve_attention("ssa", device="cpu")
    assert r.name == "ssa_reference" and r.options == PINNED_OPTIONS
    assert len(r.warnings) == 1 and "ssa_triton needs a GPU" in r.warnings[0]
    # an explicit kernel name is taken as asked, on any device
    assert resolve_attention("ssa_triton", device="cpu").name == "ssa_triton"
    with pytest.raises(ValueError, match="device='tpu'"):
        resolve_attention("ssa", device="tpu")


def test_ssa_reference_gets_the_same_options():
    assert resolve_attention("ssa_reference").options == PINNED_OPTIONS


@pytest.mark.parametrize("key,value", [("n", 2.0), ("b", 0.5), ("force_contiguous_qkv", False),
                                       ("learnable_n", False), ("n_min", 1.0)])
def test_pinned_override_warns_and_resets(policy_log, key, value):
    r = resolve_attention("ssa", {key: value})
    assert r.options == PINNED_OPTIONS
    logged = warnings_logged(policy_log)
    assert len(logged) == 1 and f"{key}={value}" in logged[0]
    assert r.warnings == logged


def test_learnable_b_is_ignored_with_warning(policy_log):
    r = resolve_attention("ssa", {"learnable_b": True})
    assert r.options["learnable_b"] is False
    logged = warnings_logged(policy_log)
    assert len(logged) == 1 and "Ignoring learnable_b" in logged[0]


def test_values_equal_to_the_policy_or_none_do_not_warn(policy_log):
    r = resolve_attention("ssa", {"n": 1.5, "b": None, "learnable_b": False})
    assert r.options == PINNED_OPTIONS
    assert warnings_logged(policy_log) == [] and r.warnings == []


def test_free_policy_keeps_overrides(policy_log):
    asked = {"n": 2.0, "b": 0.5, "learnable_b": True, "force_contiguous_qkv": False, "n_min": 1.0}
    r = resolve_attention("ssa", asked, policy="free")
    assert r.name == "ssa_triton" and r.policy == "free"
    assert r.options == {**PINNED_OPTIONS, **asked}
    assert warnings_logged(policy_log) == []


def test_softmax_ignores_ssa_options_with_warning(policy_log):
    r = resolve_attention("softmax", {"n": 2.0})
    assert (r.name, r.family, r.options) == ("softmax", "softmax", {})
    logged = warnings_logged(policy_log)
    assert len(logged) == 1 and "ignored" in logged[0] and "'n'" in logged[0]
    policy_log.clear()
    assert resolve_attention("softmax").warnings == [] and warnings_logged(policy_log) == []


@pytest.mark.parametrize("name", EXPERIMENTAL)
def test_experimental_kernels_need_policy_free(name):
    assert ATTENTIONS[name].status == "experimental"
    with pytest.raises(NotImplementedError, match=f"'{name}' is marked experimental.*policy=free"):
        resolve_attention(name)
    assert resolve_attention(name, policy="free").name == name


def test_planned_names_raise_not_implemented_with_available(monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "ssa_future", AttentionInfo("ssa_future", "ssa", "planned", "later"))
    with pytest.raises(NotImplementedError) as err:
        resolve_attention("ssa_future")
    msg = str(err.value)
    assert "'ssa_future'" in msg
    assert "available now: softmax, ssa_reference, softmax_triton, ssa_triton, ssa_flex" in msg


def test_kernel_options_pass_through_and_are_checked():
    r = resolve_attention("elsa_ssa", {"num_partitions": 2, "n": 3.0}, policy="free")
    assert r.options["num_partitions"] == 2 and r.options["n"] == 3.0
    r = resolve_attention("elsa", {"num_partitions": 4}, policy="free")
    assert r.options == {"num_partitions": 4}
    with pytest.raises(ValueError, match="num_partitions"):
        resolve_attention("ssa_triton", {"num_partitions": 2})


def test_nsa_ssa_is_nsa_with_the_ssa_policy(policy_log):
    info = ATTENTIONS["nsa_ssa"]
    assert (info.family, info.transform, info.status) == ("nsa", "ssa", "experimental")
    assert ATTENTIONS["nsa"].transform == "softmax" and ATTENTIONS["elsa_ssa"].transform == "ssa"
    assert KERNEL_OPTION_KEYS["nsa_ssa"] == KERNEL_OPTION_KEYS["nsa"]
    r = resolve_attention("nsa_ssa", dict(NSA_TINY), policy="free")
    assert (r.name, r.family) == ("nsa_ssa", "nsa")
    assert r.options == {**PINNED_OPTIONS, **NSA_TINY}  # the SSA policy's values + NSA sizes
    assert warnings_logged(policy_log) == []
    # free: SSA overrides kept, like every SSA attention
    assert resolve_attention("nsa_ssa", {"n": 2.0, "learnable_b": True}, policy="free").options == \
        {**PINNED_OPTIONS, "n": 2.0, "learnable_b": True}
    # plain nsa has no SSA transform: SSA options are ignored with a warning
    r = resolve_attention("nsa", {"n": 2.0, **NSA_TINY}, policy="free")
    assert r.options == NSA_TINY and "ignored" in r.warnings[0]
    with pytest.raises(ValueError, match="num_partitions"):
        resolve_attention("nsa_ssa", {"num_partitions": 2}, policy="free")


def test_transform_defaults_to_the_family():
    assert AttentionInfo("x", "ssa", "planned", "").transform == "ssa"
    assert AttentionInfo("x", "elsa", "planned", "").transform == "softmax"
    with pytest.raises(ValueError, match="transform"):
        AttentionInfo("x", "nsa", "planned", "", transform="relu")


def _attention_table_rows():
    """The rows of the README's first table (the one under its ``attention=`` header)."""
    with open(os.path.join(REPO, "README.md")) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `attention=`"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


@pytest.mark.parametrize("name", sorted(list(ATTENTIONS) + list(ALIASES)))
def test_every_name_has_a_config_and_a_readme_row(name):
    """``attention=<name>`` works from the launcher (nemo_ssa/configs/attention/<name>.yaml) and is
    documented; the yaml offers only options the policy accepts for it."""
    import yaml

    with open(os.path.join(REPO, "nemo_ssa", "configs", "attention", f"{name}.yaml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["name"] == name
    info = ATTENTIONS.get(name) or ATTENTIONS[SSAPolicy().pinned_kernel]
    allowed = set(KERNEL_OPTION_KEYS.get(name, ())) | (set(SSA_OPTION_KEYS) if info.transform == "ssa" else set())
    assert set(cfg.get("options") or {}) <= allowed
    if info.transform == "ssa":
        assert set(SSA_OPTION_KEYS) <= set(cfg["options"])
    rows = [row for row in _attention_table_rows() if f"`{name}`" in row.split("|")[1]]
    assert len(rows) == 1, name
    assert info.status in rows[0]


def test_experimental_refused_when_pinned_allowed_when_free(monkeypatch):
    monkeypatch.setitem(ATTENTIONS, "ssa_exp", AttentionInfo("ssa_exp", "ssa", "experimental", "test"))
    with pytest.raises(NotImplementedError, match="experimental"):
        resolve_attention("ssa_exp")
    assert resolve_attention("ssa_exp", policy="free").name == "ssa_exp"


def test_pinned_values_come_from_the_policy_object():
    r = resolve_attention("ssa", pinned=SSAPolicy(n=2.5, b=0.3))
    assert r.options["n"] == 2.5 and r.options["b"] == 0.3


@pytest.mark.parametrize("call", [
    lambda: resolve_attention("ssa_nope"),
    lambda: resolve_attention("ssa", {"temperature": 2.0}),
    lambda: resolve_attention("ssa", policy="loose"),
], ids=["unknown_name", "unknown_option", "unknown_policy"])
def test_unknown_inputs_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_unknown_messages_name_the_culprit():
    with pytest.raises(ValueError, match="ssa_nope"):
        resolve_attention("ssa_nope")
    with pytest.raises(ValueError, match="temperature"):
        resolve_attention("ssa", {"temperature": 2.0})
    with pytest.raises(ValueError, match="loose"):
        resolve_attention("ssa", policy="loose")


def test_write_round_trips(tmp_path, policy_log, monkeypatch):
    from nemo_ssa.ops.common.env import ENV_VARS

    for name, _, _ in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    # no fused op imported in this process: no kernel decisions (tests/ops/common/test_dispatch
    # checks the list after calls)
    monkeypatch.delitem(sys.modules, "nemo_ssa.ops.common.dispatch", raising=False)
    r = resolve_attention("ssa", {"n": 3.0})
    path = r.write(str(tmp_path / "run" / "nested"))
    with open(path) as f:
        loaded = json.load(f)
    assert loaded == {"requested": "ssa", "name": "ssa_triton", "family": "ssa",
                      "policy": "pinned", "options": PINNED_OPTIONS, "warnings": r.warnings,
                      "env_overrides": {}, "kernels": []}
    assert len(loaded["warnings"]) == 1
    assert ResolvedAttention(**loaded) == r


def test_record_has_the_deterministic_option_and_every_kernel_override(tmp_path, monkeypatch):
    """Kernel choices that change results or determinism are in attention_policy.json: the
    run-config option, and any debugging variable that was set."""
    from nemo_ssa.ops.common.env import ENV_VARS

    for name, _, _ in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEMO_SSA_BWD", "atomic")
    monkeypatch.setenv("NEMO_SSA_UNRELATED", "1")  # not an ops variable: not recorded
    r = resolve_attention("ssa_triton", {"deterministic": True})
    with open(r.write(str(tmp_path))) as f:
        loaded = json.load(f)
    assert loaded["options"]["deterministic"] is True
    assert loaded["env_overrides"] == {"NEMO_SSA_BWD": "atomic"}
