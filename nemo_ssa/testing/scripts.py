"""Load a repository script (``scripts/...py``) as a module, for its tests: the scripts are not a
package, and each test loading one by hand repeated the same four lines."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

#: the checkout this package sits in (the scripts are not shipped in the wheel)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(relpath: str, name: str = "") -> ModuleType:
    """``load_script("scripts/device/step_ab.py")``: the file executed as a fresh module."""
    path = os.path.join(REPO, relpath)
    spec = importlib.util.spec_from_file_location(name or os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
