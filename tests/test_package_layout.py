"""The package root shows its roles (docs/design.md, layout): role packages plus a few root modules,
and ``python -m nemo_ssa --help`` lists every subcommand ``nemo_ssa/__main__.py`` dispatches."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nemo_ssa"

ROLE_PACKAGES = {
    "ops",            # torch + triton kernels and references
    "megatron",       # megatron-aware layers and spec
    "nemo",           # nemo-aware steps, callbacks, the trainer parts the CPU loop reuses
    "data",           # corpus and tokenizer
    "study",          # the comparison study
    "testing",        # tolerance helpers, input factories, fuzzers
    "tools",          # compare, metrics log, profile summary
    "train",          # the CPU training loop
    "config",         # the attention table, the policy, the config checks
    "cli",            # the pretrain launcher and the study behind python -m nemo_ssa and scripts/
    "configs",        # the launcher's hydra tree (package data, no Python)
    "_offline_stubs",  # stand-ins for packages an offline install lacks
}
ROOT_MODULES = {
    "__init__.py",
    "__main__.py",      # python -m nemo_ssa <command>
    "versions.py",      # the supported stack ranges
}


def _root_entries():
    return {p.name for p in PKG.iterdir() if p.name != "__pycache__" and not p.name.endswith(".pyc")}


def test_package_root_holds_only_role_packages_and_listed_modules():
    entries = _root_entries()
    unexpected = sorted(e for e in entries if e not in ROLE_PACKAGES | ROOT_MODULES)
    assert not unexpected, (f"nemo_ssa/ root holds {unexpected}: put each module in the role package it "
                            f"belongs to ({sorted(ROLE_PACKAGES)}) or list it in ROOT_MODULES with its reason")
    for role in ("testing", "tools", "train"):
        assert (PKG / role / "__init__.py").is_file(), f"nemo_ssa/{role}/ is not a package"


def test_layout_check_sees_a_loose_module(tmp_path, monkeypatch):
    """Negative control: a loose module at the root fails the check above."""
    fake = tmp_path / "nemo_ssa"
    fake.mkdir()
    for name in ("__init__.py", "compare.py"):
        (fake / name).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    try:
        test_package_root_holds_only_role_packages_and_listed_modules()
    except AssertionError as e:
        assert "compare.py" in str(e)
    else:
        raise AssertionError("a loose compare.py at the package root passed the layout check")


def _dispatched_commands():
    """Every ``cmd == "x"`` / ``cmd in ("x", ...)`` test in ``__main__.main``."""
    tree = ast.parse((PKG / "__main__.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "cmd":
            for comp in node.comparators:
                consts = comp.elts if isinstance(comp, (ast.Tuple, ast.List, ast.Set)) else [comp]
                found |= {c.value for c in consts if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return found


def test_help_lists_every_subcommand():
    commands = _dispatched_commands()
    assert {"compare", "pretrain", "slurm", "study"} <= commands, commands
    r = subprocess.run([sys.executable, "-m", "nemo_ssa", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    usage = re.search(r"\{([^}]*)\}", r.stdout.splitlines()[0])
    assert usage, r.stdout
    assert set(usage.group(1).split(",")) == commands
    for cmd in commands:
        assert re.search(rf"^\s+{cmd}\s", r.stdout, re.M), f"--help does not describe {cmd!r}:\n{r.stdout}"


def test_unknown_subcommand_names_the_supported_ones():
    r = subprocess.run([sys.executable, "-m", "nemo_ssa", "no-such-command"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown command 'no-such-command'" in r.stderr and "compare,pretrain,slurm,study" in r.stderr


CODE_SUFFIXES = (".py", ".sh", ".cu", ".cpp", ".c", ".diff", ".patch", ".ipynb")


def code_in_records(root: Path):
    """Code files under docs/results: records hold results and commands as text; what an
    experiment ran lives in git history, cited by commit (issue 48)."""
    return sorted(str(p.relative_to(root)) for p in (root / "docs" / "results").rglob("*")
                  if p.is_file() and p.suffix in CODE_SUFFIXES)


def test_records_hold_no_code():
    assert code_in_records(ROOT) == []


def test_the_record_check_sees_code(tmp_path):
    (tmp_path / "docs" / "results" / "r" / "commands").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "r" / "README.md").write_text("# r")
    (tmp_path / "docs" / "results" / "r" / "commands" / "call1.sh").write_text("echo")
    assert code_in_records(tmp_path) == ["docs/results/r/commands/call1.sh"]


def records_missing_from_index(root: Path):
    """Record folders under docs/results that its README's table does not link: the index is
    how a reader finds a record from a claim (three had gone unlisted)."""
    results = root / "docs" / "results"
    index = (results / "README.md").read_text()
    return sorted(p.name for p in results.iterdir()  # a folder beside its record NAME.md counts as linked
                  if p.is_dir() and f"({p.name}/" not in index and f"({p.name}.md)" not in index)


def test_every_record_is_in_the_index():
    assert records_missing_from_index(ROOT) == []


def test_the_index_check_sees_a_missing_record(tmp_path):
    results = tmp_path / "docs" / "results"
    (results / "2026-01-01-a").mkdir(parents=True)
    (results / "2026-01-02-b").mkdir()
    (results / "README.md").write_text("| [2026-01-01-a](2026-01-01-a/README.md) | a |\n")
    assert records_missing_from_index(tmp_path) == ["2026-01-02-b"]
