"""Compatibility path: the config checks live in ``nemo_ssa.config.check``. Kept for
importers not yet moved (nemo_ssa/config_fuzz.py, nemo_ssa/nemo/cpu_loop.py); remove once
they import the new path."""

from nemo_ssa.config.check import *  # noqa: F401,F403
from nemo_ssa.config.check import (  # noqa: F401
    CP_ATTENTIONS,
    POLICIES,
    PRECISIONS,
    TP_ATTENTIONS,
    check_parallel,
    check_run_config,
)
