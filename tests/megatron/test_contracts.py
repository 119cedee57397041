"""nemo_ssa.megatron.contracts: our modules take every call megatron makes into their slots.

Read from megatron's source (``ast``), for the installed megatron-core (0.15.3) and for the
0.16-0.19 sources scripts/env.sh unpacks into ``<venv>/sources/`` (requirements/sources/);
the compat adapters' expectations are checked against the same sources. Without the
sources the tests skip, naming why; under ``CI`` they fail.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os

import pytest

from nemo_ssa.megatron import compat, contracts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINNED = contracts.pinned_versions(os.path.join(REPO, "requirements", "sources", "megatron-core.txt"))


def source_root(version: str) -> str:
    root = contracts.source_roots([version])[version]
    if root is None:
        msg = (f"megatron-core {version} sources missing under {contracts.sources_dir()}; run the tests "
               "through scripts/env.sh, which unpacks requirements/sources/megatron-core.txt")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return root


def parsed(root: str, rel: str, cls, name: str) -> inspect.Signature:
    with open(os.path.join(root, "megatron", "core", rel), encoding="utf-8") as f:
        fn = contracts.parse_function(f.read(), cls, name)
    assert fn is not None, f"{rel}: {cls}.{name} not found"
    return contracts.signature_from_ast(fn, bound=cls is not None)


# ------------------------------------------------------------------------------ the reader
SNIPPET = '''
class TransformerLayer:
    def __init__(self, submodules):
        kw = {}
        kw["tp_group"] = 1
        self.mlp = build_module(submodules.mlp, config=self.config, **kw)

    def _forward_mlp(self, x, padding_mask, extra):
        a = apply_module(self.mlp)(x, padding_mask=padding_mask)
        b = tensor_parallel.checkpoint(functools.partial(apply_module(self.mlp), padding_mask=padding_mask), False, x)
        c = self.mlp(x, **extra)
        return self.other(x)

    def _forward_mlp_router(self, x):
        return self.mlp(None, intermediate_tensors=(x, x))
'''


def test_the_reader_finds_direct_wrapped_and_built_calls():
    calls = contracts.find_calls(SNIPPET, ("self.mlp",), ("TransformerLayer",))
    got = [(c.where.split(".")[1], c.positional, sorted(c.keywords), c.opaque) for c in calls]
    assert got == [("_forward_mlp", 1, ["padding_mask"], ()), ("_forward_mlp", None, ["padding_mask"], ()),
                   ("_forward_mlp", 1, [], ("extra",)), ("_forward_mlp_router", 1, ["intermediate_tensors"], ())]
    built = contracts.find_calls(SNIPPET, ("submodules.mlp",), ("TransformerLayer",))
    assert [(b.positional, sorted(b.keywords)) for b in built] == [(0, ["config", "tp_group"])]


def test_a_signature_that_misses_a_keyword_is_a_problem():
    call = contracts.find_calls(SNIPPET, ("self.mlp",), ("TransformerLayer",))[0]

    def old(hidden_states, per_token_scale=None):
        pass

    def new(hidden_states, per_token_scale=None, padding_mask=None):
        pass

    assert contracts._problems(inspect.signature(old), call) == ["keyword 'padding_mask' not accepted"]
    assert contracts._problems(inspect.signature(new), call) == []


# ------------------------------------------------------------------------------ every version
def test_the_installed_megatron_calls_only_what_our_modules_take():
    version, problems, report = contracts.check(contracts.installed_root())
    assert report, "no call into any slot found"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", PINNED)
def test_megatron_source_calls_only_what_our_modules_take(version):
    root = source_root(version)
    got, problems, report = contracts.check(root)
    assert ".".join(map(str, got)) == version
    slots = {line.split(":")[0] for line in report}
    assert {"mlp construction", "mlp forward", "self_attention construction", "self_attention forward",
            "qkv tensors", "qkv buffer",
            "core_attention construction", "core_attention forward", "layer norm construction",
            "layer norm forward", "final layer norm construction", "final layer norm forward"} <= slots, slots
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", PINNED)
def test_the_old_fused_mlp_forward_fails_the_check(version, monkeypatch):
    """The check can fail: the forward we shipped (no ``padding_mask``) against 0.16+."""
    from nemo_ssa.megatron.mlp import FusedReLU2MLP

    root = source_root(version)

    def forward(self, hidden_states, per_token_scale=None):
        raise AssertionError("never run")

    monkeypatch.setattr(FusedReLU2MLP, "forward", forward)
    _, problems, _ = contracts.check(root)
    assert any(p.startswith("mlp forward") and "'padding_mask' not accepted" in p for p in problems), problems


@pytest.mark.parametrize("version", PINNED)
def test_every_opaque_argument_is_one_we_read(version):
    """``**extra_kwargs`` into the core attention (0.18+) comes from
    ``core_attention_extra_kwargs``, which no call in Attention/SelfAttention passes."""
    root = source_root(version)
    with open(os.path.join(root, "megatron", "core", "transformer", "attention.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("Attention", "SelfAttention"):
            passed = [kw.arg for c in ast.walk(node) if isinstance(c, ast.Call) for kw in c.keywords]
            assert "core_attention_extra_kwargs" not in passed, f"{node.name} now passes extra core-attention kwargs"
    slot = next(s for s in contracts.SLOTS if s.name == "core_attention forward")
    opaque = {e for c in contracts.slot_calls(root, slot) for e in c.opaque}
    assert opaque <= {e for (name, e) in contracts.OPAQUE_OK if name == slot.name}


# ------------------------------------------------------------------------------ the QKV buffer
def attention_source(version: str) -> str:
    root = contracts.installed_root() if version == "installed" else source_root(version)
    with open(os.path.join(root, "megatron", "core", "transformer", "attention.py"), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("version", ["installed"] + PINNED)
def test_get_query_key_value_tensors_returns_the_buffer_before_the_split(version):
    """What FusedRopeSelfAttention reads q, k, v from: split_qkv=False returns the projection's
    output viewed [s, b, ng, (np/ng + 2) * hn], (q heads, k, v) per group, nothing applied."""
    assert contracts.qkv_buffer_problems(attention_source(version)) == []


@pytest.mark.parametrize("change,problem", [
    # a q norm moved before the early return: the buffer path would skip it
    (("        # Return unsplit mixed_qkv and split_arg_list\n",
      "        mixed_qkv = self.q_layernorm(mixed_qkv)\n"), "reads ['q_layernorm']"),
    # k and v swapped in the split: the kernel would read v as k
    (("            self.hidden_size_per_attention_head,\n            self.hidden_size_per_attention_head,\n        ]",
      "            self.hidden_size_per_attention_head,\n            2 * self.hidden_size_per_attention_head,\n        ]"),
     "split_arg_list"),
    (("hidden_states, key_value_states=None, split_qkv=True", "hidden_states, key_value_states=None, unsplit=False"),
     "does not bind"),
    (("        if not split_qkv:\n            return mixed_qkv, split_arg_list",
      "        if not split_qkv:\n            return mixed_qkv.flatten(2), split_arg_list"), "no `if not split_qkv"),
    (("        if not split_qkv:\n", "        if self.config.test_mode:\n            pass\n        if not split_qkv:\n"),
     "a branch before the buffer is returned"),
])
def test_the_qkv_buffer_check_fails_on_a_changed_megatron(change, problem):
    import megatron.core

    if not megatron.core.__version__.startswith("0.15."):  # the Python 3.13 row installs 0.19
        pytest.skip(f"the edits are written against megatron-core 0.15's text; {megatron.core.__version__} installed")
    source = attention_source("installed")
    old, new = change
    assert source.count(old) >= 1, old
    problems = contracts.qkv_buffer_problems(source.replace(old, new))
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("version", [v for v in PINNED if tuple(map(int, v.split("."))) >= (0, 16)])
def test_an_override_without_output_gate_fails_the_0_16_check(version, monkeypatch):
    """The qkv-tensors slot can fail: 0.16+ passes ``output_gate=``."""
    from nemo_ssa.megatron.self_attention import FusedRopeSelfAttention

    root = source_root(version)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *, split_qkv=True):
        raise AssertionError("never run")

    monkeypatch.setattr(FusedRopeSelfAttention, "get_query_key_value_tensors", get_query_key_value_tensors)
    _, problems, _ = contracts.check(root)
    assert any(p.startswith("qkv tensors") and "'output_gate' not accepted" in p for p in problems), problems


# ------------------------------------------------------------------------------ compat's expectations
@pytest.mark.parametrize("version", PINNED)
def test_local_spec_keywords_come_from_the_function_that_declares_them(version):
    root = source_root(version)
    rel = "models/gpt/gpt_layer_specs.py"
    spec = parsed(root, rel, None, "get_gpt_layer_local_spec")
    try:
        sub = parsed(root, rel, None, "get_gpt_layer_local_submodules")
    except AssertionError:
        sub = None
    names, where = compat.local_spec_parameters(spec, sub)
    assert "normalization" in names  # the keyword gpt_layer_spec passes
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in spec.parameters.values())
    assert where == ("get_gpt_layer_local_submodules" if takes_kwargs else "get_gpt_layer_local_spec")


def test_local_layer_spec_names_what_megatron_takes():
    names, where = compat.local_spec_parameters()
    assert where == "get_gpt_layer_local_spec" and "normalization" in names  # megatron-core 0.15/0.16
    with pytest.raises(TypeError, match="normalisation"):
        compat.local_layer_spec(normalisation="LayerNorm")
    assert compat.decisions()["local layer spec"].endswith("get_gpt_layer_local_spec")


@pytest.mark.parametrize("version", PINNED)
def test_save_strategy_arguments_bind_to_each_version(version):
    root = source_root(version)
    sig = parsed(root, "dist_checkpointing/serialization.py", None, "get_default_save_sharded_strategy")
    args, why = compat.save_strategy_args(sig)
    sig.bind(*args)
    assert args == (("torch_dist", 1) if "version" in sig.parameters else ("torch_dist",)), why
    assert args[0] == "torch_dist"


def test_save_strategy_on_the_installed_megatron():
    strategy = compat.default_save_sharded_strategy("torch_dist")
    assert type(strategy).__name__ == "TorchDistSaveShardedStrategy"
    assert "version" in compat.decisions()["save strategy"]


@pytest.mark.parametrize("version", [v for v in PINNED if tuple(map(int, v.split("."))) >= (0, 18)])
def test_the_0_18_mlp_slot_is_a_partial_of_as_mlp_submodule(version):
    """What compat.mlp_slot expects of 0.18+: the local spec's dense MLP slot is
    ``partial(MLP.as_mlp_submodule, submodules=...)``, and our ``as_mlp_submodule`` takes
    every parameter megatron's does."""
    from nemo_ssa.megatron.mlp import FusedReLU2MLP

    root = source_root(version)
    with open(os.path.join(root, "megatron", "core", "models", "gpt", "gpt_layer_specs.py"), encoding="utf-8") as f:
        fn = contracts.parse_function(f.read(), None, "get_mlp_module_spec_for_backend")
    text = ast.unparse(fn)
    assert "module = MLP.as_mlp_submodule" in text
    partials = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == "partial"]
    assert any(ast.unparse(c.args[0]) == "module" and [k.arg for k in c.keywords] == ["submodules"] for c in partials)
    theirs = parsed(root, "transformer/mlp.py", "MLP", "as_mlp_submodule")
    ours = inspect.signature(FusedReLU2MLP.as_mlp_submodule)
    assert list(theirs.parameters) == list(ours.parameters)


def test_mlp_slot_keeps_megatrons_submodules(monkeypatch):
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from nemo_ssa.megatron.mlp import FusedReLU2MLP

    subs = MLPSubmodules(linear_fc1="fc1", linear_fc2="fc2")
    spec = compat.mlp_slot(ModuleSpec(module=MLP, submodules=subs), FusedReLU2MLP)
    assert spec.module is FusedReLU2MLP and spec.submodules is subs
    # the 0.18+ shape, on the installed megatron: MLP gets the classmethod it has there
    def as_mlp_submodule(cls, **kw):
        return cls

    monkeypatch.setattr(MLP, "as_mlp_submodule", classmethod(as_mlp_submodule), raising=False)
    slot = compat.mlp_slot(functools.partial(MLP.as_mlp_submodule, submodules=subs), FusedReLU2MLP)
    assert slot.func == FusedReLU2MLP.as_mlp_submodule and slot.keywords == {"submodules": subs}
    with pytest.raises(TypeError, match="supported: ModuleSpec"):
        compat.mlp_slot(ModuleSpec(module=FusedReLU2MLP, submodules=subs), FusedReLU2MLP)
