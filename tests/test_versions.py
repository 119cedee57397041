"""nemo_ssa.versions: the tested ranges, and the one error a run outside them gets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_ssa import versions

REPO = Path(__file__).resolve().parents[1]
GOOD = {"megatron-core": "0.15.3", "nemo_toolkit": "2.7.3", "numpy": "1.26.4", "torch": "2.13.0+cpu",
        "triton": "3.6.0"}


def fake(**over):
    table = {**GOOD, **{k.replace("_", "-") if k == "megatron_core" else k: v for k, v in over.items()}}
    return lambda dist: table.get(dist)


@pytest.mark.parametrize("over", [{}, {"megatron_core": "0.16.1"}, {"numpy": "2.5.2"}, {"torch": "2.11.0+cu130"}])
def test_the_tested_stacks_pass(over):
    assert versions.check_stack(version_of=fake(**over)) == []


def test_this_environment_is_a_tested_stack():
    assert versions.stack_problems() == []


@pytest.mark.parametrize("over,words", [
    ({"megatron_core": "0.19.2"}, ["megatron-core 0.19.2", "megatron-core>=0.15.3,<0.17"]),
    ({"megatron_core": "0.14.0"}, ["megatron-core 0.14.0", ">=0.15.3,<0.17"]),
    ({"nemo_toolkit": "3.0.0"}, ["nemo_toolkit 3.0.0 has no LLM collection", "Megatron-Bridge", ">=2.7,<3",
                                 "megatron-core path"]),
    ({"triton": "3.3.1"}, ["triton 3.3.1", "triton>=3.6,<3.7"]),
])
def test_outside_the_range_one_error_names_it(over, words, monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UnsupportedStackError) as e:
        versions.check_stack(version_of=fake(**over))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert versions.ALLOW_ENV in str(e.value)


def test_the_override_warns_instead(monkeypatch):
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="megatron-core 0.19.2"):
        problems = versions.check_stack(version_of=fake(megatron_core="0.19.2"))
    assert len(problems) == 1


def test_pyproject_declares_the_same_ranges():
    text = (REPO / "pyproject.toml").read_text()
    deps = dict(re.findall(r'"([A-Za-z_\-]+)([<>=!~][^"]*)"', text))
    for dist, (spec, _) in versions.SUPPORTED.items():
        assert dist in deps, f"pyproject.toml does not declare {dist}"
        want = versions.DECLARED_MEGATRON_CORE if dist == "megatron-core" else spec
        assert set(deps[dist].split(",")) == set(want.split(",")), (dist, deps[dist], want)


@pytest.mark.parametrize("version, declared", [
    ("0.15.3", True), ("0.16.1", True), ("0.16.9", True), ("0.19.0", True), ("0.19.2", True),
    ("0.15.2", False), ("0.17.1", False), ("0.18.2", False), ("0.20.0", False)])
def test_declared_megatron_core_is_exactly_the_paths_that_ran(version, declared):
    """pyproject's megatron-core range = the NeMo path's range + the Megatron-LM loop's."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    v = Version(version)
    assert (v in SpecifierSet(versions.DECLARED_MEGATRON_CORE)) is declared
    some_path = v in SpecifierSet(versions.SUPPORTED["megatron-core"][0]) or v in SpecifierSet(versions.MEGATRON_LM_LOOP)
    assert some_path is declared


def test_the_locks_are_inside_the_ranges():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    for lock in sorted((REPO / "requirements").glob("*.lock")):
        pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s#]+)", lock.read_text(), re.M))
        pins = {k.lower().replace("_", "-"): v for k, v in pins.items()}
        for dist, (spec, _) in versions.SUPPORTED.items():
            v = pins.get(dist.lower().replace("_", "-"))
            if v is not None:
                assert Version(Version(v).base_version) in SpecifierSet(spec), (lock.name, dist, v)


@pytest.mark.parametrize("container, over", [
    # NVIDIA NeMo FW containers' sets (Megatron-Bridge's software-versions table), measured on
    # CPU and refused: docs/results/2026-11-27-stack/nemo-fw-25.09-cpu.md, nemo-fw-25.11-cpu.md
    ("25.09", dict(nemo_toolkit="2.5.0", megatron_core="0.14.0", torch="2.8.0", triton="3.4.0")),
    ("25.11", dict(nemo_toolkit="2.6.0", megatron_core="0.15.0", torch="2.9.1", triton="3.5.1")),
])
def test_the_nemo_fw_containers_before_26_02_are_refused_naming_the_nearest_stack(container, over, monkeypatch):
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UnsupportedStackError) as e:
        versions.check_stack(version_of=fake(**over))
    msg = str(e.value)
    for dist, v in over.items():
        assert v in msg, (dist, msg)
    assert versions.NEAREST_STACK in msg and "gpu-py312.lock" in msg
