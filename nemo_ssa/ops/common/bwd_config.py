"""Tile choice of the attention backward and which backward a call takes.

* ``BwdConfig`` and the static tables ``BWD_CONFIGS`` (two-kernel backward) and
  ``SINGLE_CONFIGS`` (single pass), keyed by the head-dim bucket ``d_bucket`` (the padded
  ``BLOCK_D``, which the forward's table shares), causal and dtype kind; small tiles
  under the interpreter; candidate lists for ``NEMO_SSA_AUTOTUNE=1``.
* ``single_pass_pays``: where the single-pass (atomic ``dq``) backward is the faster one;
  ``ops.common.dispatch.backward_plan`` makes the choice with it.
* ``fused_delta``: whether the dQ kernel computes ``delta`` itself.
The measurements behind the tables and choices are in docs/results.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.env import BWD_MODES
from nemo_ssa.ops.common.launch import is_interpreter, next_pow2
from nemo_ssa.ops.common.transforms import TRANSFORM_SSA

__all__ = [
    "BwdConfig",
    "BWD_CONFIGS",
    "SINGLE_CONFIGS",
    "INTERPRETER_BWD_CONFIG",
    "BWD_TUNE_DQ",
    "BWD_TUNE_KV",
    "BWD_MODES",
    "d_bucket",
    "bwd_config",
    "pointer_bwd_config",
    "pointer_single_config",
    "single_config",
    "single_pass_pays",
    "fused_delta",
]


class BwdConfig(NamedTuple):
    """Block sizes / launch params of the two backward kernels."""

    block_m_dq: int
    block_n_dq: int
    warps_dq: int
    stages_dq: int
    block_m_kv: int
    block_n_kv: int
    warps_kv: int
    stages_kv: int
    tma_dq: int = 0  # 1: tiles through TMA tensor descriptors where the layout allows (ops.common.tma)
    tma_kv: int = 0


_D_BUCKET: Dict[int, int] = {}  # d_bucket by head dim: the tables and the plan ask it on every call


def d_bucket(head_dim: int) -> int:
    """Config bucket = the padded ``BLOCK_D`` (16 shares 32's row)."""
    b = _D_BUCKET.get(head_dim)
    if b is None:
        b = _D_BUCKET[head_dim] = max(32, next_pow2(head_dim))
    return b


# (BLOCK_D bucket, causal, "16bit" | "fp32") -> BwdConfig(dq: BM, BN, warps, stages,
# dkv: BM, BN, warps, stages). 16-bit rows 32/64/128: the measured winners of
# benchmarks/tune_tiles.py (bf16, causal SSA; results in docs/results). The D=32 row is
# the best for both the model shape (B4 N4K) and N=16K. 256 and fp32 are still
# compile-time estimates (largest tiles without spills; fp32 uses IEEE dots on FMA units,
# hence small tiles). NEMO_SSA_AUTOTUNE=1 tunes instead.
# D64 / D128: the Hopper path (TMA tiles, ``tune_tiles --tma``, B2 N8K, SSA and softmax;
# docs/results/2026-11-26-hopper): dQ 1.01-1.03x, dK/dV 1.04-1.17x the pointer kernels
_BWD_16 = {32: BwdConfig(64, 32, 4, 2, 64, 64, 4, 2),
           64: BwdConfig(64, 128, 4, 3, 64, 64, 4, 2, 1, 1),
           128: BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 1, 1),
           256: BwdConfig(32, 32, 4, 2, 32, 32, 8, 2)}    # estimate: regs 235 / 247
_BWD_32 = {32: BwdConfig(32, 32, 4, 2, 32, 32, 8, 2),
           64: BwdConfig(32, 32, 4, 2, 16, 16, 4, 2),
           128: BwdConfig(32, 32, 8, 2, 16, 16, 4, 2),
           256: BwdConfig(16, 16, 8, 2, 16, 16, 8, 2)}
# what a TMA row falls back to where a call cannot take the TMA path (pre-Hopper GPU,
# packed THD, unaligned strides, short call): the pointer kernels' measured winners
_BWD_16_POINTERS = {64: BwdConfig(64, 128, 4, 2, 64, 64, 4, 2), 128: BwdConfig(64, 64, 4, 2, 32, 64, 4, 2)}
BWD_CONFIGS: Dict[Tuple[int, bool, str], BwdConfig] = {}
for _causal in (False, True):
    for _bd in (32, 64, 128, 256):
        BWD_CONFIGS[(_bd, _causal, "16bit")] = _BWD_16[_bd]
        BWD_CONFIGS[(_bd, _causal, "fp32")] = _BWD_32[_bd]
INTERPRETER_BWD_CONFIG = BwdConfig(16, 16, 1, 1, 16, 16, 1, 1)

# The single-pass backward's dK/dV(+dQ) kernel: (BLOCK_D bucket, "16bit" | "fp32") ->
# (BLOCK_M, BLOCK_N, warps, stages); it carries the dq tile and (SSA) the dn sums on top
# of the dK/dV kernel's registers, so it gets its own row (16-bit rows 32/64/128 measured
# with benchmarks/tune_tiles.py bwd_single, results in docs/results; 256 and fp32: estimates).
_SINGLE_16 = {32: (64, 64, 4, 2),
              64: (64, 64, 4, 3, 1),   # TMA (dq by bulk tensor reduce): tune_tiles --tma, B2 N8K H16
              128: (32, 128, 8, 2),
              256: (32, 32, 8, 2)}    # estimate
_SINGLE_32 = {32: (32, 32, 8, 2), 64: (16, 16, 4, 2), 128: (16, 16, 4, 2), 256: (16, 16, 8, 2)}
_SINGLE_16_POINTERS: Dict[int, Tuple[int, int, int, int]] = {64: (64, 64, 4, 2)}  # pointer rows of TMA entries
SINGLE_CONFIGS: Dict[Tuple[int, str], Tuple[int, ...]] = {}
for _bd in (32, 64, 128, 256):
    SINGLE_CONFIGS[(_bd, "16bit")] = _SINGLE_16[_bd]
    SINGLE_CONFIGS[(_bd, "fp32")] = _SINGLE_32[_bd]

# candidates when autotuning (GPU only; NEMO_SSA_AUTOTUNE=1)
BWD_TUNE_DQ = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for s in (2, 3)]
BWD_TUNE_KV = [(bm, bn, w, s) for bm in (16, 32, 64) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def bwd_config(head_dim: int, causal: bool, dtype: torch.dtype, interpret: Optional[bool] = None) -> BwdConfig:
    """Look up the backward block sizes (small 16x16 blocks under the interpreter)."""
    if interpret is None:
        interpret = is_interpreter()
    if interpret:
        return INTERPRETER_BWD_CONFIG
    kind = "fp32" if dtype == torch.float32 else "16bit"
    return BWD_CONFIGS[(d_bucket(head_dim), bool(causal), kind)]


def pointer_bwd_config(cfg: BwdConfig, head_dim: int, dq: bool) -> BwdConfig:
    """``cfg`` with the dQ (``dq``) or dK/dV kernel's fields replaced by the pointer row
    where the table asked for TMA and the call cannot take it."""
    ptr = _BWD_16_POINTERS.get(d_bucket(head_dim))
    if dq and cfg.tma_dq:
        return cfg._replace(**({} if ptr is None else dict(zip(BwdConfig._fields[:4], ptr[:4]))), tma_dq=0)
    if not dq and cfg.tma_kv:
        return cfg._replace(**({} if ptr is None else dict(zip(BwdConfig._fields[4:8], ptr[4:8]))), tma_kv=0)
    return cfg


def pointer_single_config(cfg: BwdConfig, head_dim: int) -> BwdConfig:
    """The single pass's pointer row where the table asked for TMA and the call cannot
    take it."""
    if not cfg.tma_kv:
        return cfg
    ptr = _SINGLE_16_POINTERS.get(d_bucket(head_dim))
    return cfg._replace(tma_kv=0) if ptr is None else BwdConfig(0, 0, 0, 0, *ptr)


def single_config(head_dim: int, dtype: torch.dtype, interpret: Optional[bool] = None) -> BwdConfig:
    """Tiles of the single-pass backward (the dK/dV fields of a ``BwdConfig``; the dQ
    fields are unused there)."""
    if interpret is None:
        interpret = is_interpreter()
    if interpret:
        return INTERPRETER_BWD_CONFIG
    return _SINGLE_ROWS[(d_bucket(head_dim), "fp32" if dtype == torch.float32 else "16bit")]


def _single_row(row: Tuple[int, ...]) -> BwdConfig:
    bm, bn, w, s, *tma = row
    return BwdConfig(0, 0, 0, 0, bm, bn, w, s, tma_kv=tma[0] if tma else 0)


# SINGLE_CONFIGS as the BwdConfig each backward call takes: built once, not per call
_SINGLE_ROWS: Dict[Tuple[int, str], BwdConfig] = {key: _single_row(row) for key, row in SINGLE_CONFIGS.items()}


def single_pass_pays(transform: str, head_dim: int, tma: bool = False, gluon: bool = False) -> bool:
    """Where the single-pass backward is the faster one (measured, bf16, causal; results
    in docs/results).

    * ``gluon`` (the call can take the warp-specialised Gluon single pass,
      ``ops.common.hopper_bwd.gluon_bwd_capable``, whose table holds only the rows measured
      faster): softmax D128 1.62 against the two kernels' 1.77 ms (H100, B2 N8K H8,
      docs/results/2026-11-26-gluon); SSA D128 (docs/results/2026-11-26-gluon-ssa).
    * SSA at head dim <= 32, whose dQ kernel spends many instructions per score
      recomputing what the dK/dV loop already has; and SSA at D64 on the TMA path (``tma``:
      the call can take it, ``ops.common.tma``), where each dq tile is added by one bulk
      tensor reduce: 2.43 ms against the two kernels' 2.80 (H200, B2 N8K H16,
      docs/results/2026-11-26-hopper).
    * Otherwise the two Triton kernels: softmax's dQ loop is cheap and the fp32 atomics
      (``D / BLOCK_N`` per score, per-thread ``red`` into L2) cost more than it (softmax D64
      1.88 against 1.90 ms)."""
    if gluon:
        return True
    if transform not in ("ssa", TRANSFORM_SSA):
        return False
    bucket = d_bucket(int(head_dim))
    return bucket == 32 or (bucket == 64 and bool(tma))


def fused_delta(is_ssa: bool) -> bool:
    """Fold the delta pass into the dQ kernel? Softmax yes, SSA no: SSA's dQ kernel, with
    the dn/db partials on top, measured slower with the extra o tile.
    ``NEMO_SSA_FUSED_DELTA=0|1`` forces either for A/B runs."""
    forced = env.fused_delta()
    if forced is not None:
        return forced
    return not is_ssa
