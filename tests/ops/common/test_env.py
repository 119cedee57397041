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
    "NEMO_SSA_CE_PATH": (env.ce_path, [(None, "chunked"), ("", "chunked"), ("loss", "loss")]),
    "NEMO_SSA_CE_CHUNK": (env.ce_chunk, [(None, None), ("", None), (" 4096 ", 4096)]),
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


@pytest.mark.parametrize("name,raw,supported", [("NEMO_SSA_CE_PATH", "fused", "chunked, loss"),
                                                 ("NEMO_SSA_CE_CHUNK", "0", "a positive number"),
                                                 ("NEMO_SSA_CE_CHUNK", "1k", "a positive number")])
def test_a_bad_value_names_what_is_supported(monkeypatch, name, raw, supported):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=supported):
        CASES[name][0]()


#: the package's NEMO_SSA_* variables read outside the table, and why they are not in it:
#: none changes what a kernel computes or which kernel runs
OUTSIDE_THE_TABLE = {
    "NEMO_SSA_FAULT": "train/faults.py: fault injection for the resume tests (kills or holds a rank)",
    "NEMO_SSA_DATA_DIR": "data/corpus.py: where the local corpus is cached",
    "NEMO_SSA_ALLOW_UNTESTED_STACK": "versions.py: lets an untested stack start (printed at start)",
    "NEMO_SSA_MEGATRON_SOURCES": "megatron/contracts.py: where the megatron-core sources are unpacked",
}


def test_every_variable_the_package_reads_is_in_the_table_or_named_here():
    root = os.path.normpath(os.path.join(os.path.dirname(env.__file__), os.pardir, os.pardir))
    table = {n for n, _, _ in env.ENV_VARS}
    read = set()
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and os.path.join(d, f) != env.__file__:
                read |= set(re.findall(r"NEMO_SSA_[A-Z0-9_]+", open(os.path.join(d, f)).read()))
    stray = sorted(read - table - set(OUTSIDE_THE_TABLE))
    assert stray == [], f"NEMO_SSA_* variables neither in ops.common.env.ENV_VARS nor named here: {stray}"


def test_reads_follow_every_way_of_changing_the_environment(monkeypatch):
    """The accessors answer what ``os.environ.get`` answers right after each kind of write
    (they read os.environ's own store on POSIX, nothing cached)."""
    import unittest.mock

    name = "NEMO_SSA_POLY_LOG2"
    monkeypatch.delenv(name, raising=False)
    assert env.poly_log2() is False
    os.environ[name] = "1"
    try:
        assert env.poly_log2() is True
        del os.environ[name]
        assert env.poly_log2() is False
        with unittest.mock.patch.dict(os.environ, {name: "1"}):
            assert env.poly_log2() is True
        assert env.poly_log2() is False
        os.environ.update({name: "1", "NEMO_SSA_BWD": "atomic"})
        assert (env.poly_log2(), env.bwd_mode()) == (True, "atomic")
        os.environ.pop(name)
        os.environ.pop("NEMO_SSA_BWD")
        assert (env.poly_log2(), env.bwd_mode()) == (False, "auto")
    finally:
        os.environ.pop(name, None)
        os.environ.pop("NEMO_SSA_BWD", None)
    # os.environ replaced by a plain mapping: read through it
    monkeypatch.setattr(os, "environ", {name: "1", "NEMO_SSA_MLP_TILES": " x "})
    assert env.poly_log2() is True and env.mlp_tiles() == "x"
    monkeypatch.setattr(os, "environ", {})
    assert env.poly_log2() is False and env.bwd_mode() == "auto"


def test_non_ascii_values_read_as_os_environ_reads_them(monkeypatch):
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", "fwd=ä")
    assert env.mlp_tiles() == os.environ.get("NEMO_SSA_MLP_TILES").strip() == "fwd=ä"
