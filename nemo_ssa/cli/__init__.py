"""The command-line entry points: the hydra launcher (``pretrain``) and the comparison study (``study``).

They live in the package, beside their hydra tree (``nemo_ssa/configs``, shipped as package
data), so ``python -m nemo_ssa pretrain`` and ``python -m nemo_ssa study`` run from an installed
wheel; ``scripts/pretrain.py`` and ``scripts/study.py`` are wrappers that run them from a
checkout. Both start runs as child processes; :func:`pretrain_command` and :func:`child_env`
say how, so a child imports the same ``nemo_ssa`` as its parent wherever that came from.

This module imports no hydra: ``python -m nemo_ssa study --summarize-only`` and ``--help``
need only the base dependencies.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional

#: the hydra tree: attention/<name>.yaml, model/, train/, data/ and config.yaml
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

#: the directory that holds the running ``nemo_ssa`` (a checkout's root, or site-packages)
_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_file(*parts: str) -> str:
    """Path of one file of the hydra tree, e.g. ``config_file("train", "cpu_smoke.yaml")``."""
    return os.path.join(CONFIG_DIR, *parts)


def pretrain_command(*args: str) -> List[str]:
    """The command of one launcher run: ``python -m nemo_ssa.cli.pretrain <args>``.

    A module, not a file path, so the same command serves a checkout and an installed
    package; run it with :func:`child_env` so the child finds the parent's copy."""
    return [sys.executable, "-m", "nemo_ssa.cli.pretrain", *args]


def child_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's environment) with the directory holding this
    ``nemo_ssa`` first on ``PYTHONPATH``: a checkout run through ``scripts/`` from another
    directory, or with an installed wheel on ``PYTHONPATH`` (the offline bundle), starts
    children that run this code, not another copy or none."""
    env = dict(os.environ if env is None else env)
    if os.path.basename(_IMPORT_ROOT) in ("site-packages", "dist-packages"):
        return env  # an interpreter's own install: every child finds it, and it must not go before the stdlib
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != _IMPORT_ROOT]
    env["PYTHONPATH"] = os.pathsep.join([_IMPORT_ROOT, *rest])
    return env
