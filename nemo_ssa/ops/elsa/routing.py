"""Tile tables and the length-adaptive partition rule of the ELSA scan (host side only).

Everything a GPU tuning pass should touch lives here, as plain tables:

* ``FWD_TILES``: phase-1 ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per input-dtype
  class and padded head dim ``BLOCK_D``;
* ``MERGE_TILES``: phase-2 ``(BLOCK_M, num_warps)`` per ``BLOCK_D``;
* ``ROUTING``: the constants of :func:`num_partitions`.

(The backward's tiles live with the shared backward, ``nemo_ssa/ops/common/bwd_config.py``.)

Under ``TRITON_INTERPRET=1`` (CPU tests) small tiles are used instead, so tiny shapes
still exercise several query blocks, key tiles and partitions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nemo_ssa.ops.common.launch import block_d, is_interpreter  # noqa: F401 (block_d: re-exported)
from nemo_ssa.ops.common.target import target

__all__ = [
    "FWD_TILES",
    "MERGE_TILES",
    "INTERPRET_TILES",
    "TILE_OVERRIDE",
    "ROUTING",
    "ElsaPlan",
    "sm_count",
    "block_d",
    "make_plan",
    "num_partitions",
]

# ---------------------------------------------------------------------------------------
# Tunables. (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by dtype class, then BLOCK_D.
# 16-bit 32/64/128: measured winners of benchmarks/tune_tiles.py (bf16, causal SSA, one
# partition; results in docs/results) (16 follows 32). 256 and fp32: offline sm_90a
# compiles (ptxas -v), configs without register spills for softmax *and* SSA, not timed.
FWD_TILES = {
    "16bit": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 128, 4, 3),
              128: (64, 64, 4, 3), 256: (64, 32, 8, 2)},
    # fp32 IEEE dots run on CUDA cores (FMA): the q/k/v fragments live in registers, so
    # tiles are smaller and warps more (4 warps spill at 64x64 for D >= 64)
    "fp32": {16: (64, 64, 4, 2), 32: (64, 64, 8, 2), 64: (64, 32, 8, 2),
             128: (32, 32, 8, 1), 256: (32, 16, 8, 1)},
}
MERGE_TILES = {16: (64, 4), 32: (64, 4), 64: (64, 4), 128: (32, 4), 256: (16, 4)}
# Interpreter (CPU tests): tiny tiles so N = 63 already spans several tiles/partitions.
INTERPRET_TILES = (16, 16, 1, 1)  # BLOCK_M, BLOCK_N, warps, stages (both phases)
# When set (BLOCK_M, BLOCK_N, warps, stages), used everywhere instead of the tables: lets the
# tiny-shape tests see the same tiling on a GPU as under the interpreter.
TILE_OVERRIDE = None

ROUTING = dict(
    short_n=512,        # Sk <= short_n -> one partition (phase 2 fused into phase 1)
    min_part_keys=512,  # never cut partitions narrower than this many keys
    max_part_keys=16384,  # long inputs: cut at least every max_part_keys keys
    waves=2,            # want >= waves * SMs phase-1 programs
    max_partitions=64,
    summary_budget_bytes=1 << 30,  # cap on fp32 (m, l, acc) summaries for all partitions
    default_sms=8,      # CPU / interpreter stand-in for the SM count
)


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # a device property: a constant to torch.compile
def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (CUDA, ``target.Target.sms``), else
    ``ROUTING['default_sms']``."""
    return target(torch.device(device)).sms or int(ROUTING["default_sms"])


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def fwd_tiles(dtype: torch.dtype, d: int):
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    if is_interpreter():
        return INTERPRET_TILES
    return FWD_TILES[_dtype_class(dtype)][block_d(d)]


def merge_tiles(d: int):
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE[0], TILE_OVERRIDE[2]
    if is_interpreter():
        return INTERPRET_TILES[0], INTERPRET_TILES[2]
    return MERGE_TILES[block_d(d)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_partitions(B: int, Hq: int, Sq: int, Sk: int, D: int, *, block_m: int, block_n: int,
                   sms: int, forced=None) -> int:
    """How many key partitions phase 1 scans in parallel.

    Rule (constants in ``ROUTING``):

    * ``forced`` (the ``num_partitions=`` argument) wins, clamped to ``[1, #key tiles]``;
    * ``Sk <= short_n``: 1 (phase 2 degenerates to the finalisation, fused in phase 1);
    * otherwise ``P = max(ceil(waves * SMs / base), ceil(Sk / max_part_keys))`` with
      ``base = B * Hq * ceil(Sq / BLOCK_M)`` the programs one partition launches: split the
      keys until the GPU is filled (few heads, short query: decode, small batch) and
      bound the keys per program on long inputs (causal load balance);
    * clamped by ``Sk // min_part_keys`` (no tiny partitions), ``max_partitions``,
      the summary memory budget (``P * B * Hq * Sq * (D + 2) * 4`` bytes), and the number
      of key tiles.
    """
    n_tiles = _cdiv(Sk, block_n)
    if forced is not None:
        return max(1, min(int(forced), n_tiles))
    r = ROUTING
    if Sk <= r["short_n"]:
        return 1
    base = B * Hq * _cdiv(Sq, block_m)
    p = max(_cdiv(r["waves"] * sms, base), _cdiv(Sk, r["max_part_keys"]))
    per_part_bytes = B * Hq * Sq * (D + 2) * 4
    p = min(p, Sk // r["min_part_keys"], r["max_partitions"],
            max(1, r["summary_budget_bytes"] // max(1, per_part_bytes)), n_tiles)
    return max(1, p)


@dataclass(frozen=True)
class ElsaPlan:
    """Launch plan of one forward call (what the structural check reports)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    merge_block_m: int
    merge_warps: int
    n_q_blocks: int
    n_key_tiles: int
    num_partitions: int

    def partition_tiles(self, p: int):
        """Key-tile range ``[lo, hi)`` of partition ``p`` (balanced, tile aligned)."""
        return (p * self.n_key_tiles) // self.num_partitions, ((p + 1) * self.n_key_tiles) // self.num_partitions

    def partition_keys(self, p: int, sk: int):
        lo, hi = self.partition_tiles(p)
        return lo * self.block_n, min(hi * self.block_n, sk)

    def live_partitions(self, q_block: int, sq: int, sk: int, causal: bool) -> int:
        """Partitions phase 1 computes for ``q_block`` (those starting before its last visible key)."""
        kv_hi = sk
        if causal:
            last_row = min((q_block + 1) * self.block_m, sq) - 1
            kv_hi = max(0, min(sk, last_row + sk - sq + 1))
        return sum(1 for p in range(self.num_partitions) if self.partition_keys(p, sk)[0] < kv_hi)

    def first_live_q_block(self, p: int, sq: int, sk: int) -> int:
        """Causal: the first query block that sees a key of partition ``p``.

        Closed form, mirrored by the phase-1 kernel's ``COMPACT`` decode: row
        ``start_p + sq - sk`` is the first whose window ``j <= i + sk - sq`` reaches the
        partition's first key; partitions are never empty, so blocks from there on are live.
        """
        return max(self.partition_keys(p, sk)[0] + sq - sk, 0) // self.block_m

    def compact_phase1(self, causal: bool, fused: bool) -> bool:
        """Phase 1 launches only the live (query block, partition) pairs (causal summaries).

        With the fused one-partition epilogue every block must run (blocks without a
        visible key write ``o = 0``); without causal masking every pair is live.
        """
        return bool(causal) and not fused

    def phase1_grid(self, B: int, Hq: int, sq: int, sk: int, causal: bool, fused: bool) -> tuple:
        """Phase-1 launch grid: ``(live pairs, B*Hq)`` if ``compact_phase1``, else the
        rectangle ``(query blocks, P, B*Hq)``."""
        if self.compact_phase1(causal, fused):
            pairs = sum(self.n_q_blocks - self.first_live_q_block(p, sq, sk) for p in range(self.num_partitions))
            return (pairs, B * Hq)
        return (self.n_q_blocks, self.num_partitions, B * Hq)


def make_plan(B: int, Hq: int, Sq: int, Sk: int, D: int, dtype: torch.dtype, device, forced=None) -> ElsaPlan:
    bm, bn, warps, stages = fwd_tiles(dtype, D)
    mbm, mwarps = merge_tiles(D)
    p = num_partitions(B, Hq, Sq, Sk, D, block_m=bm, block_n=bn, sms=sm_count(device), forced=forced)
    return ElsaPlan(bm, bn, block_d(D), warps, stages, mbm, mwarps, _cdiv(Sq, bm), _cdiv(Sk, bn), p)
