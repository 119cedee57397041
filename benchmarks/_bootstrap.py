"""Put this checkout's root first on ``sys.path`` (imported only when a script runs as a file).

``python benchmarks/x.py`` starts with ``benchmarks/`` on the path, so neither ``benchmarks.*``
nor this checkout's ``nemo_ssa`` would be found first (an installed ``nemo_ssa`` -- the
offline bundle holds one, the editable install points at another checkout -- would win).
Every script starts with::

    if __name__ == "__main__" and not __package__:  # run as a file
        import _bootstrap  # noqa: F401

``python -m benchmarks.x`` (the root is already first) and imports (tests, importlib) leave the
path to the importer.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]
