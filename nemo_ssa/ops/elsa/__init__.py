"""ELSA: exact attention as a two-pass parallel scan over key partitions (softmax or SSA).

Public API: ``elsa_attention`` / ``elsa_softmax_attention`` / ``elsa_ssa_attention``
(kernels in ``scan.py``), the (m, l, acc) monoid in torch (``merge_partials`` & co. in
``monoid.py``) and on the GPU (``merge_finalize_partials``: the phase-2 kernel on caller
partials, for context-parallel / split-K merges), the routing rule (``routing.py``) and
the structural check (``introspect.py``). Math in ``README.md``.
"""

from nemo_ssa.ops.elsa.monoid import combine, finalize_partials, identity_partial, merge_partials
from nemo_ssa.ops.elsa.routing import ElsaPlan, make_plan, num_partitions
from nemo_ssa.ops.elsa.scan import (
    elsa_attention,
    elsa_softmax_attention,
    elsa_ssa_attention,
    merge_finalize_partials,
)

__all__ = [
    "combine",
    "elsa_attention",
    "elsa_softmax_attention",
    "elsa_ssa_attention",
    "finalize_partials",
    "identity_partial",
    "make_plan",
    "merge_finalize_partials",
    "merge_partials",
    "num_partitions",
    "ElsaPlan",
]
