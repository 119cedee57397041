"""Import boundaries (docs/design.md): ops/ is torch + triton only; only nemo_ssa/nemo imports nemo.

Static (AST) scan of every source file, including imports inside functions and relative
imports, plus one subprocess check of what ``import nemo_ssa.ops`` really pulls in.
"""

import ast
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nemo_ssa"

# nemo_ssa.<sub> trees that ops must not reach; third-party roots ops must not import
OPS_FORBIDDEN_ROOTS = ("megatron", "nemo", "transformer_engine", "apex", "lightning", "hydra")
OPS_FORBIDDEN_INTERNAL = ("nemo_ssa.megatron", "nemo_ssa.nemo", "nemo_ssa.testing", "nemo_ssa.tools", "nemo_ssa.train",
                          "recipes", "scripts")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False):
    """Absolute names of every module imported by ``source`` (relative imports resolved)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append(mod)
            found += [f"{mod}.{a.name}" for a in node.names]  # `from pkg import submodule`
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
            found.append(node.args[0].value)
    return found


def _under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def ops_violations(source: str, module: str, is_package: bool = False):
    bad = []
    for name in imported_modules(source, module, is_package):
        if any(_under(name, r) for r in OPS_FORBIDDEN_ROOTS + OPS_FORBIDDEN_INTERNAL):
            bad.append(name)
    return bad


def nemo_violations(source: str, module: str, is_package: bool = False):
    return [m for m in imported_modules(source, module, is_package) if _under(m, "nemo")]


def _py_files(root: Path):
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_checker_catches_violations():
    mod = "nemo_ssa.ops.attention.fused"
    assert ops_violations("import torch\nimport triton.language as tl", mod) == []
    assert ops_violations("from megatron.core import parallel_state", mod)
    assert ops_violations("def f():\n    import nemo.collections.llm", mod)
    assert ops_violations("from ...megatron import spec", mod) == ["nemo_ssa.megatron", "nemo_ssa.megatron.spec"]
    assert ops_violations("from ... import nemo", mod) == ["nemo_ssa.nemo"]
    assert ops_violations("import importlib\nimportlib.import_module('megatron.core')", mod)
    assert ops_violations("from . import naive", mod) == []
    assert ops_violations("from nemo_ssa.testing import make_qkv", mod) == ["nemo_ssa.testing", "nemo_ssa.testing.make_qkv"]
    assert nemo_violations("import nemo_ssa.ops", "nemo_ssa.megatron.spec") == []
    assert nemo_violations("from nemo.lightning import Trainer", "nemo_ssa.megatron.spec")


def test_ops_imports_only_torch_and_triton():
    files = _py_files(PKG / "ops")
    assert files, "nemo_ssa/ops has no python files"
    errors = []
    for f in files:
        bad = ops_violations(f.read_text(), _module_name(f), f.name == "__init__.py")
        errors += [f"{f.relative_to(ROOT)}: imports {m}" for m in bad]
    assert not errors, "ops/ must import only torch/triton/stdlib:\n" + "\n".join(errors)


def test_only_nemo_subpackage_imports_nemo():
    errors = []
    for f in _py_files(PKG):
        rel = f.relative_to(PKG)
        if rel.parts[0] == "nemo":
            continue
        bad = nemo_violations(f.read_text(), _module_name(f), f.name == "__init__.py")
        errors += [f"{f.relative_to(ROOT)}: imports {m}" for m in bad]
    assert not errors, "only nemo_ssa/nemo (and recipes/, scripts/) may import nemo:\n" + "\n".join(errors)


def test_importing_ops_loads_no_megatron_or_nemo():
    code = (
        "import sys, nemo_ssa\n"
        "assert 'torch' not in sys.modules, 'import nemo_ssa must stay lazy'\n"
        "import nemo_ssa.ops, nemo_ssa.testing\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'nemo', 'transformer_engine')\n"
        "             or m.startswith(('nemo_ssa.megatron', 'nemo_ssa.nemo')))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
