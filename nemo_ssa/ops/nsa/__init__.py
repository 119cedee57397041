"""Native Sparse Attention (Yuan et al. 2025): compressed, selected and sliding-window
branches mixed by learned gates. Math and conventions in README.md.

``nsa_attention`` (layer.py) runs the Triton kernels on CUDA and torch stages elsewhere;
``nsa_attention_naive`` (naive.py) is the fp32 reference. The Triton modules
(``range_attn``, ``select``, ``selected_attn``) are imported lazily, so importing this
package never compiles or decorates a kernel (tests pick TRITON_INTERPRET first).
"""

from nemo_ssa.ops.nsa.layer import IMPLS, STAGES, nsa_attention, resolve_impl
from nemo_ssa.ops.nsa.naive import (
    BRANCHES,
    COMPRESS_MODES,
    NSAConfig,
    PhiParams,
    compress_kv,
    init_phi_params,
    nsa_attention_naive,
    num_compressed_blocks,
    num_select_blocks,
    select_blocks,
    selection_importance,
)

__all__ = [
    "BRANCHES",
    "COMPRESS_MODES",
    "IMPLS",
    "STAGES",
    "NSAConfig",
    "PhiParams",
    "compress_kv",
    "init_phi_params",
    "nsa_attention",
    "nsa_attention_naive",
    "num_compressed_blocks",
    "num_select_blocks",
    "resolve_impl",
    "select_blocks",
    "selection_importance",
]
