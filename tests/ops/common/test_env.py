"""ops/common/env.py: every NEMO_SSA_* override the ops read, parsed in one place."""

import os
import re

import pytest

from nemo_ssa.ops.common import env

# variable -> (accessor, [(raw value or None for unset, expected)])
CASES = {
    "NEMO_SSA_POISON": (env.poison_outputs, [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)]),
    "NEMO_SSA_FAST_LAUNCH": (env.fast_launch, [(None, True), ("", False), ("0", False), ("1", True)]),
    "NEMO_SSA_AUTOTUNE": (env.autotune, [(None, False), ("", False), ("0", False), ("1", True)]),
    "NEMO_SSA_BWD": (env.bwd_mode, [(None, "auto"), ("", "auto"), ("auto", "auto"), ("atomic", "atomic"),
                                    ("deterministic", "deterministic")]),
    "NEMO_SSA_FUSED_DELTA": (env.fused_delta, [(None, None), ("", None), ("0", False), ("1", True), ("2", None)]),
    "NEMO_SSA_POLY_LOG2": (env.poly_log2, [(None, False), ("", False), ("0", False), ("1", True)]),
    "NEMO_SSA_TMA": (env.tma, [(None, True), ("", False), ("0", False), ("1", True)]),
    "NEMO_SSA_GLUON": (env.gluon, [(None, True), ("", False), ("0", False), ("1", True)]),
    "NEMO_SSA_MLP_TILES": (env.mlp_tiles, [(None, ""), ("  fwd=1x2x3/4/5 ", "fwd=1x2x3/4/5")]),
    "NEMO_SSA_CE_COMPILE": (env.ce_compile, [(None, True), ("", False), ("0", False), ("1", True)]),
}


@pytest.mark.parametrize("name,raw,want", [(n, r, w) for n, (_, cs) in CASES.items() for r, w in cs],
                         ids=lambda x: repr(x) if x is None or x == "" else str(x))
def test_each_override_parsed(monkeypatch, name, raw, want):
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert CASES[name][0]() == want


def test_bad_bwd_mode_names_the_supported_ones(monkeypatch):
    monkeypatch.setenv("NEMO_SSA_BWD", "fast")
    with pytest.raises(ValueError, match="auto, atomic, deterministic"):
        env.bwd_mode()


def test_table_lists_exactly_the_accessors_variables():
    names = [n for n, _, _ in env.ENV_VARS]
    assert len(names) == len(set(names))
    assert set(names) == set(CASES)
    assert all(meaning for _, _, meaning in env.ENV_VARS)


def test_table_defaults_are_the_unset_behaviour(monkeypatch):
    """A variable set to its documented default behaves as if unset."""
    for name, default, _ in env.ENV_VARS:
        accessor = CASES[name][0]
        monkeypatch.delenv(name, raising=False)
        unset = accessor()
        monkeypatch.setenv(name, default)
        assert accessor() == unset, name


def test_no_other_module_in_ops_reads_the_environment():
    ops = os.path.normpath(os.path.join(os.path.dirname(env.__file__), os.pardir))
    readers = []
    for root, _, files in os.walk(ops):
        for f in files:
            path = os.path.join(root, f)
            if f.endswith(".py") and path != env.__file__:
                if re.search(r"os\.environ(\.get|\[)|os\.getenv", open(path).read()):
                    readers.append(os.path.relpath(path, ops))
    assert readers == []
