"""The comparison study (attentions x seeds, seed-paired verdicts): runs ``nemo_ssa.cli.study`` from this checkout.

    python scripts/study.py --attentions softmax,ssa --seeds 3   # = python -m nemo_ssa study ...

The study and its documentation (``--help``) live in the package, so an installed wheel runs
the same thing.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

from nemo_ssa.cli.study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
