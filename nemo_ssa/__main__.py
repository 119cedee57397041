"""``python -m nemo_ssa <command>`` (also the ``nemo-ssa`` console script).

Commands:
    compare   merge/align/plot/gate loss curves (``scripts/compare_losses.py``)
    pretrain  the hydra launcher, overrides as ``scripts/pretrain.py`` takes them (``nemo_ssa.cli.pretrain``)
    slurm     render the sbatch script of a multi-node pretrain (nemo-run's Slurm executor)
    study     attentions x seeds and their seed-paired verdicts (``nemo_ssa.cli.study``)

Every command runs from an installed package; none needs the repository checkout. Outputs
(``runs/``, and the embedded corpus under ``data/`` outside a checkout) go under the current
directory.
"""

from __future__ import annotations

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
    if cmd == "pretrain":
        # Run as ``__main__`` (not by calling its ``main``): Lightning starts the other GPU
        # processes of ``train.num_gpus_per_node=N`` by re-running ``__main__`` with
        # ``sys.argv[1:]``, which must then be ``-m nemo_ssa.cli.pretrain <overrides>``.
        sys.argv = [sys.argv[0], *rest]
        runpy.run_module("nemo_ssa.cli.pretrain", run_name="__main__", alter_sys=True)
        return 0
    if cmd == "study":
        from nemo_ssa.cli.study import main as study_main

        return study_main(rest)
    print(f"nemo_ssa: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
