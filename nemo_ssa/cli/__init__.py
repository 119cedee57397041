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
from typing import Dict, List, Mapping, Optional, Tuple

#: the hydra tree: attention/<name>.yaml, model/, train/, data/ and config.yaml
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

#: the directory that holds the running ``nemo_ssa`` (a checkout's root, or site-packages)
_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_file(*parts: str) -> str:
    """Path of one file of the hydra tree, e.g. ``config_file("train", "cpu_smoke.yaml")``."""
    return os.path.join(CONFIG_DIR, *parts)


def split_overrides(argv: List[str]) -> Tuple[List[str], List[str]]:
    """``[options..., "--", overrides...]`` -> (options, launcher overrides); no ``--``: no overrides."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


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


def compared_cuda_graphs(names: List[str], overrides: List[str], default: str = "auto"):
    """Runs compared with each other (a story, a study) take megatron's graphs all or none under
    ``model.cuda_graphs=auto``: a run decides alone (``resolve_cuda_graphs``), so a baseline
    without graphs beside an attention with them would compare their speeds unlike with like.
    ``(overrides, why)``: ``model.cuda_graphs=none`` added (any earlier setting of the key
    dropped) and the line to print when some attention in ``names`` has not run under graphs;
    ``(overrides, None)`` unchanged otherwise, or when the overrides set none / local."""
    from nemo_ssa.config.check import cuda_graph_attention

    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    set_to = [o.split("=", 1)[1] for o in overrides if key(o) == "model.cuda_graphs" and "=" in o]
    value = set_to[-1] if set_to else default
    if str(value).strip().lower() != "auto":
        return list(overrides), None
    without = [n for n in dict.fromkeys(names) if not cuda_graph_attention(n)]
    if not without:
        return list(overrides), None
    return ([o for o in overrides if key(o) != "model.cuda_graphs"] + ["model.cuda_graphs=none"],
            f"model.cuda_graphs=auto -> none for every run: {', '.join(without)} has not run under graphs, and "
            "runs compared with each other compare their speeds like with like (softmax_triton and ssa compare "
            "graphed)")
