"""What an A/B against a git ref needs, for the tools that offer ``--ab REF`` (``run.py``,
``sass_ab.py``): REF checked out beside this tree, and a process whose ``nemo_ssa`` is REF's.

``git worktree add`` puts REF in a temp dir (removed afterwards), or REF names a directory
that already holds a tree (``git archive REF | tar -x -C DIR``: a machine with a copy of the
checkout but no ``.git``, such as the lent GPUs); the tool re-runs itself
there with ``--code-root DIR``, and :func:`use_code_root` puts DIR first on ``sys.path``
*and* drops the editable install's import hook: that hook answers for any ``nemo_ssa.*``
module the ref lacks with this checkout's copy (a module added since REF would otherwise be
imported from here into the ref's package, and the A/B would mix the two trees).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_code_root(root: str, tool: str) -> None:
    """Import ``nemo_ssa`` from ``root`` only (call before anything imports it)."""
    if "nemo_ssa" in sys.modules:
        raise SystemExit(f"{tool} --code-root: nemo_ssa was imported before the path was set")
    sys.path.insert(0, os.path.abspath(root))
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Tuple[str, str]]:
    """``(tmp, tree)``: git ref ``ref`` checked out at ``tree`` inside the temp dir ``tmp``;
    a directory ``ref`` holding ``nemo_ssa/`` is used as the tree as it is."""
    tmp = tempfile.mkdtemp(prefix="nemo_ssa_ab_")
    if os.path.isdir(os.path.join(ref, "nemo_ssa")):
        try:
            yield tmp, os.path.abspath(ref)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if os.path.isdir(ref):
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"--ab {ref}: a directory, but no nemo_ssa/ package in it")
    tree = os.path.join(tmp, "tree")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "--quiet", tree, ref], check=True)
    try:
        yield tmp, tree
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
