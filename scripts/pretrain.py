"""Pretrain with a selectable core attention: runs ``nemo_ssa.cli.pretrain`` (hydra) from this checkout.

    python scripts/pretrain.py attention=softmax compare_to=[]   # = python -m nemo_ssa pretrain ...

The launcher, its documentation and its hydra tree (``nemo_ssa/configs``) live in the package,
so an installed wheel runs the same thing. This file stays the path the README, torchrun and
Lightning's re-launch of the other GPU processes (which re-runs ``sys.argv[0]``) execute.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout first, even where an installed nemo_ssa (e.g. the offline bundle's wheel on
# PYTHONPATH) would otherwise shadow the code being run.
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

from nemo_ssa.cli.pretrain import main  # noqa: E402

if __name__ == "__main__":
    main()
