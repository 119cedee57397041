"""Compatibility path: the policy lives in ``nemo_ssa.config.policy``. Kept for importers
not yet moved (nemo_ssa/config_fuzz.py); remove once they import the new path."""

from nemo_ssa.config.policy import *  # noqa: F401,F403
from nemo_ssa.config.policy import ATTENTIONS, PINNED, resolve_attention  # noqa: F401
