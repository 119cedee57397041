"""``python -m nemo_ssa <command>`` (also the ``nemo-ssa`` console script).

Commands:
    compare   merge/align/plot/gate loss curves (``scripts/compare_losses.py``)
    pretrain  the hydra launcher (``scripts/pretrain.py``; needs the repository checkout)
    slurm     render the sbatch script of a multi-node pretrain (nemo-run's Slurm executor)
    study     attentions x seeds and their seed-paired verdicts (``scripts/study.py``)
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

USAGE = "usage: python -m nemo_ssa {compare,pretrain,slurm,study} [args...]  (see --help of each)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or ""))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "compare":
        from nemo_ssa.tools.compare import main as compare_main

        return compare_main(rest)
    if cmd == "slurm":
        from nemo_ssa.nemo.slurm import main as slurm_main

        return slurm_main(rest)
    if cmd in ("pretrain", "study"):
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", f"{cmd}.py")
        if not os.path.isfile(script):
            print(f"nemo_ssa {cmd}: {script} not found; run from a repository checkout", file=sys.stderr)
            return 2
        sys.argv = [script, *rest]
        runpy.run_path(script, run_name="__main__")
        return 0
    print(f"nemo_ssa: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
