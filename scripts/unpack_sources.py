"""Unpack the ``megatron/`` package of downloaded wheels into ``DEST/<name>-<version>/``.

    python scripts/unpack_sources.py WHEEL_DIR DEST

Called by scripts/env.sh after ``pip download`` of requirements/sources/*.txt: the tests
read these sources (tests/megatron/test_contracts.py), they never import them. Only ``.py``
files are kept; an existing folder of the same version is replaced.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile


def unpack(wheel: str, dest: str) -> str:
    name, version = os.path.basename(wheel).split("-")[:2]
    target = os.path.join(dest, f"{name.replace('_', '-')}-{version}")
    shutil.rmtree(target, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.startswith("megatron/") and m.endswith(".py")]
        if not members:
            raise SystemExit(f"{wheel}: no megatron/*.py inside")
        z.extractall(target, members)
    return target


def main(argv) -> int:
    wheels, dest = argv
    found = sorted(f for f in os.listdir(wheels) if f.endswith(".whl"))
    if not found:
        print(f"[unpack_sources] no wheels in {wheels}", file=sys.stderr)
        return 1
    for w in found:
        print(f"[unpack_sources] {w} -> {unpack(os.path.join(wheels, w), dest)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
