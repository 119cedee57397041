"""The stack nemo-ssa is tested on, and one clear error when a run uses another.

The ranges below are the ones the project runs (pyproject.toml declares the same; the locks
in requirements/ hold the exact tested sets):

- **megatron-core 0.15.3 - 0.16.x**: 0.15.3 on the GPU image and in the CPU lock; 0.16.1
  (the newest for Python 3.11) in the CPU matrix (tests/test_stack_matrix.py: layer spec,
  optimizer setup, two-rank save/resume under numpy 2) and on GPUs through NeMo (the main
  job and a DP2 resume, docs/results/2026-11-27-stack). 0.17+ needs Python 3.12: its slot
  contracts are read from source in CI and 0.19.2 trained on GPUs through plain
  megatron-core (scripts/train_megatron_core.py, which does not call this check) and through
  Megatron-LM's loop from its wheel (``nemo_ssa.megatron.lm_pretrain``, which checks its own
  range, ``lm_pretrain.MEGATRON_CORE`` = 0.19.x); the NeMo path has not run there, so this
  range stays the NeMo path's.
- **nemo_toolkit 2.7.x**: the last line with ``nemo.collections.llm`` (recipes, MegatronStrategy).
  nemo_toolkit 3.0 removed the LLM collection; its recipes moved to Megatron-Bridge.
- **numpy 1.26 - 2.x**: 1.26.4 in the lock, 2.4.6 in the CPU matrix, 2.5.2 on the GPU image
  (megatron-core 0.15's multi-rank checkpoints need ``nemo_ssa.megatron.compat`` there).
- **torch 2.11 - 2.13**, **triton 3.6**: the kernels ran on torch 2.11 + triton 3.6 (GPU) and
  2.13 + 3.6 (CPU, Triton interpreter).

:func:`check_stack` is called where a run is configured (the recipe, the CPU loop); outside
the ranges it raises :class:`UnsupportedStackError` naming the range, or warns when
``NEMO_SSA_ALLOW_UNTESTED_STACK=1`` (a debugging override: the run goes on, untested).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Dict, List, Optional

__all__ = ["SUPPORTED", "NEAREST_STACK", "MEGATRON_LM_LOOP", "DECLARED_MEGATRON_CORE", "UnsupportedStackError", "check_stack", "stack_problems", "installed_version"]

#: distribution -> (specifier, what to do instead)
SUPPORTED: Dict[str, tuple] = {
    "megatron-core": (">=0.15.3,<0.17", "install megatron-core 0.15.3 (Python 3.11/3.12) or 0.16.x"),
    "nemo_toolkit": (">=2.7,<3", "install nemo_toolkit>=2.7,<3 (pip install 'nemo_toolkit[nlp]==2.7.3')"),
    "numpy": (">=1.26,<3", "install numpy 1.26 or 2.x"),
    "torch": (">=2.11,<2.14", "install torch 2.11-2.13"),
    "triton": (">=3.6,<3.7", "install triton 3.6"),
}

#: the megatron-core releases Megatron-LM's loop from the wheel runs on (nemo_ssa.megatron.lm_pretrain):
#: 0.19 is where megatron.training's pretrain() takes the config container that entry builds
MEGATRON_LM_LOOP = ">=0.19,<0.20"

#: what pyproject.toml declares for megatron-core: every release some path of ours ran on --
#: the NeMo path's range (SUPPORTED) and the Megatron-LM loop's; 0.17 and 0.18 never ran
DECLARED_MEGATRON_CORE = ">=0.15.3,!=0.17.*,!=0.18.*,<0.20"

_NEMO3 = ("nemo_toolkit {version} has no LLM collection (nemo.collections.llm, its recipes and "
          "MegatronStrategy were removed in 3.0 and moved to Megatron-Bridge). nemo-ssa's NeMo path "
          "needs nemo_toolkit>=2.7,<3; with a newer stack use the plain megatron-core path "
          "(nemo_ssa.megatron.spec.gpt_layer_spec, docs/megatron-core.md).")

ALLOW_ENV = "NEMO_SSA_ALLOW_UNTESTED_STACK"

#: the one line every refusal ends with: the nearest stack that works (NVIDIA's NeMo FW 25.09
#: and 25.11 sets were measured on CPU and refused: docs/results/2026-11-27-stack)
NEAREST_STACK = ("nearest stack that works: nemo_toolkit 2.7.3 + megatron-core 0.15.3 (0.16.1 runs too) + "
                 "torch 2.11 + triton 3.6 (requirements/gpu-py312.lock, installed with --no-deps); without "
                 "NeMo, megatron-core 0.19.x (python -m nemo_ssa.megatron.lm_pretrain)")


class UnsupportedStackError(RuntimeError):
    """A package outside the tested range (the message names the range)."""


def installed_version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def stack_problems(dists: Optional[List[str]] = None,
                   version_of: Callable[[str], Optional[str]] = installed_version) -> List[str]:
    """One line per installed package outside its tested range (absent packages are not a
    problem here: the import that needs them says so)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    problems = []
    for dist in dists or list(SUPPORTED):
        spec, advice = SUPPORTED[dist]
        v = version_of(dist)
        if v is None:
            continue
        base = Version(v).base_version  # 2.11.0+cu130 -> 2.11.0; rc/dev builds by their release
        if Version(base) in SpecifierSet(spec):
            continue
        if dist == "nemo_toolkit" and Version(base).major >= 3:
            problems.append(_NEMO3.format(version=v))
        else:
            problems.append(f"{dist} {v} is outside the range nemo-ssa is tested on ({dist}{spec}): {advice}")
    return problems


def check_stack(dists: Optional[List[str]] = None,
                version_of: Callable[[str], Optional[str]] = installed_version) -> List[str]:
    """Raise :class:`UnsupportedStackError` if a package is outside its tested range (warn
    instead with ``NEMO_SSA_ALLOW_UNTESTED_STACK=1``); returns the problems found."""
    problems = stack_problems(dists, version_of)
    if problems:
        text = "\n  ".join(problems)
        if os.environ.get(ALLOW_ENV) == "1":
            warnings.warn(f"untested stack ({ALLOW_ENV}=1):\n  {text}", RuntimeWarning, stacklevel=2)
        else:
            raise UnsupportedStackError(f"nemo-ssa: untested stack:\n  {text}\n{NEAREST_STACK}\n"
                                        f"(set {ALLOW_ENV}=1 to run anyway, untested)")
    return problems
