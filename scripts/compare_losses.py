"""Compare loss curves of runs against a baseline (see nemo_ssa/tools/compare.py for the rules).

    python scripts/compare_losses.py runs/softmax-s1234 runs/ssa-s1234 --out runs/compare
    python scripts/compare_losses.py ref=runs/ssa_reference-s1234 tri=runs/ssa_triton-s1234 \
        --ema 0.9 --from-step 100 --max-delta 0.05          # exit 1 if |Δ| > 0.05 anywhere
    python -m nemo_ssa compare ...                           # the same tool

Exit codes: 0 ok, 1 a gate failed, 2 unusable input (the message names run, file and step).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

from nemo_ssa.tools.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
