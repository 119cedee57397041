"""``@triton.jit`` helpers shared by the forward and backward attention kernels.

Sequence bounds (dense or packed), tile addressing, the SSA parameters, the key/query
ranges of a block split into an unmasked and a masked stage, score masking, and the
dropout mask. The dropout mask is defined here once, device side (``dropout_keep``,
``dropout_state``) and host side (``dropout_rng_layout``, ``make_rng_state``): the
backward regenerates it, so every forward feeding ``attention_bwd`` must build its mask
with exactly these helpers.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

__all__ = [
    "seq_info",
    "dropout_keep",
    "tile_ptrs",
    "tma_tile",
    "tma_store",
    "load_params",
    "dropout_state",
    "load_kv_tile",
    "mask_scores",
    "online_softmax_step",
    "kv_range_for_q_block",
    "q_range_for_kv_block",
    "dropout_rng_layout",
    "make_rng_state",
]


@triton.jit
def seq_info(CU_Q, CU_K, off_z, SEQ_Q, SEQ_K, VARLEN: tl.constexpr):
    """``(q_start, q_len, k_start, k_len)`` of sequence ``off_z``; starts are int64 rows.

    Dense: starts are 0 and lengths ``SEQ_Q``/``SEQ_K``. Packed (``VARLEN``): read from
    ``cu_seqlens`` (int32).
    """
    if VARLEN:
        q_start = tl.load(CU_Q + off_z)
        q_len = tl.load(CU_Q + off_z + 1) - q_start
        k_start = tl.load(CU_K + off_z)
        k_len = tl.load(CU_K + off_z + 1) - k_start
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    else:
        zero = (off_z * 0).to(tl.int64)
        q_start = zero
        k_start = zero
        q_len = off_z * 0 + SEQ_Q
        k_len = off_z * 0 + SEQ_K
    return q_start, q_len, k_start, k_len


@triton.jit
def dropout_keep(seed, rbase, offs_q, offs_k, RSTRIDE, dropout_p, TRANSPOSED: tl.constexpr):
    """Keep-mask of dropout on ``p`` for rows ``offs_q`` x keys ``offs_k`` (Philox).

    Counter of entry (i, j) = ``rbase + i * RSTRIDE + j`` (int64; ``rbase`` from
    ``dropout_rng_layout``). Returns ``[len(q), len(k)]`` (``TRANSPOSED``: ``[len(k),
    len(q)]``) booleans, True = kept (probability ``1 - dropout_p``).
    """
    if TRANSPOSED:
        idx = rbase + offs_q[None, :].to(tl.int64) * RSTRIDE + offs_k[:, None]
    else:
        idx = rbase + offs_q[:, None].to(tl.int64) * RSTRIDE + offs_k[None, :]
    return tl.rand(seed, idx) >= dropout_p


@triton.jit
def tile_ptrs(X, z64, h64, row, s_z, s_h, s_s, s_d, offs_r, offs_d):
    """Pointers of the ``[len(offs_r), len(offs_d)]`` tile at rows ``row + offs_r`` of head
    ``h64`` of batch ``z64`` (int64 block base, in-tile offsets)."""
    return X + z64 * s_z + h64 * s_h + row * s_s + offs_r[:, None] * s_s + offs_d[None, :] * s_d


@triton.jit
def tma_tile(desc, z, h, row, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``[BLOCK_R, BLOCK_D]`` tile at rows ``row..`` of head ``h`` of batch ``z`` through
    a rank-4 ``[B, H, S, D]`` tensor descriptor (``ops.common.tma``): the tensor-memory
    accelerator reads rows ``>= S`` and columns ``>= D`` as 0 -- no masks, no address
    arithmetic in the threads."""
    return desc.load([z, h, row, 0]).reshape(BLOCK_R, BLOCK_D)


@triton.jit
def tma_store(desc, z, h, row, x, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the ``[BLOCK_R, BLOCK_D]`` tile ``x`` where ``tma_tile`` reads it; rows ``>= S``
    and columns ``>= D`` are dropped by the hardware."""
    desc.store([z, h, row, 0], x.reshape(1, 1, BLOCK_R, BLOCK_D))


@triton.jit
def load_params(NP, BP, TRANSFORM: tl.constexpr):
    """SSA ``(n, b)`` as fp32 from 1-element tensors of any float dtype; ``0.0`` otherwise."""
    if TRANSFORM == 1:
        n = tl.load(NP).to(tl.float32)
        b = tl.load(BP).to(tl.float32)
    else:
        n = 0.0
        b = 0.0
    return n, b


@triton.jit
def dropout_state(RNG, dropout_p, HAS_DROPOUT: tl.constexpr):
    """``(seed, Philox offset, 1 / (1 - dropout_p))`` from ``rng_state``; ``(0, 0, 1.0)``
    without dropout."""
    if HAS_DROPOUT:
        seed = tl.load(RNG)
        rng_off = tl.load(RNG + 1)
        inv_keep = 1.0 / (1.0 - dropout_p)
    else:
        seed = 0
        rng_off = 0
        inv_keep = 1.0
    return seed, rng_off, inv_keep


@triton.jit
def load_kv_tile(ptrs, cols, k_len, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASKED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A key/value tile, ``[BLOCK_D, BLOCK_N]`` (``TRANSPOSED``) or ``[BLOCK_N, BLOCK_D]``;
    keys ``cols >= k_len`` are masked only on the ``MASKED`` stage."""
    if TRANSPOSED:
        if MASKED:
            t = tl.load(ptrs, mask=(cols < k_len)[None, :] & (offs_d < HEAD_DIM)[:, None], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
    else:
        if MASKED:
            t = tl.load(ptrs, mask=(cols < k_len)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return t


@triton.jit
def mask_scores(z2, offs_m, offs_n, k_len, off_c, CAUSAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``-inf`` where key ``offs_n`` is past ``k_len`` or (``CAUSAL``) after query row
    ``offs_m`` (bottom-right aligned by ``off_c``); ``z2`` is ``[M, N]`` or (``TRANSPOSED``)
    ``[N, M]``."""
    if TRANSPOSED:
        valid = (offs_n < k_len)[:, None]
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + off_c)
    else:
        valid = (offs_n < k_len)[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + off_c)
    return tl.where(valid, z2, float("-inf"))


@triton.jit
def online_softmax_step(z2, m_i, l_i, MAY_BE_EMPTY: tl.constexpr):
    """One key tile of the online softmax, log2 domain (ops/attention/README.md), for every
    schedule that streams keys past a block of query rows (flash, ELSA's scan, NSA's range
    and selected branches; the Gluon forward keeps its own copy: Gluon cannot call
    ``@triton.jit`` helpers).

    ``z2`` ``[M, N]``: the tile's transformed scores, masked ones ``-inf``; ``m_i``,
    ``l_i`` ``[M]``: the rows' running max and normaliser. Returns ``(p, alpha, m_new,
    l_new)``: ``p = exp2(z2 - m_new)``, ``alpha = exp2(m_i - m_new)`` (the caller rescales
    its accumulators by it) and the updated statistics. ``MAY_BE_EMPTY`` (tiles with
    masks): a row that has seen no key yet keeps ``m = -inf`` and gets ``p = 0``,
    ``alpha = 0`` (0 is subtracted instead of ``-inf``: no NaN).
    """
    m_new = tl.maximum(m_i, tl.max(z2, 1))
    if MAY_BE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(z2 - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def kv_range_for_q_block(start_m, q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    """Key range of a query block: ``[0, full)`` needs no mask, ``[full, hi)`` does.

    Causal is bottom-right aligned: row i sees key j iff ``j <= i + (k_len - q_len)``.
    ``full`` is a multiple of ``BLOCK_N`` and ``<= k_len``, so unmasked blocks are in
    bounds; the masked stage covers the diagonal band and the ragged tail.
    """
    if CAUSAL:
        off_c = k_len - q_len
        hi = tl.maximum(tl.minimum(k_len, start_m + BLOCK_M + off_c), 0)
        full = tl.maximum(tl.minimum(start_m + off_c + 1, k_len), 0)
        full = (full // BLOCK_N) * BLOCK_N
    else:
        hi = k_len
        full = (k_len // BLOCK_N) * BLOCK_N
    return full, hi


@triton.jit
def q_range_for_kv_block(start_n, q_len, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    """Query range of a key block: ``[lo, mid)`` masked, ``[mid, q_len)`` unmasked."""
    q_end = ((q_len + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if CAUSAL:
        off_c = k_len - q_len
        first = tl.maximum(start_n - off_c, 0)  # first row that sees key start_n
        lo = (first // BLOCK_M) * BLOCK_M
        full = tl.maximum(start_n + BLOCK_N - 1 - off_c, 0)  # rows >= full see the block
        mid = ((full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        lo = q_len * 0
        mid = q_len * 0
    # a ragged last key block always takes the masked path (keys >= k_len must weigh 0)
    mid = tl.where(start_n + BLOCK_N > k_len, q_end, mid)
    mid = tl.minimum(mid, q_end)
    lo = tl.minimum(lo, mid)
    return lo, mid



def dropout_rng_layout(num_heads_q: int, seqlen_q: int, seqlen_k: int, varlen: bool,
                       total_q: Optional[int] = None) -> Tuple[int, int, int]:
    """Philox counter layout ``(RNG_SZ, RNG_SH, RNG_SS)`` of the dropout mask.

    Entry (batch z, query head h, row i, key j) uses counter
    ``offset + z*RNG_SZ + h*RNG_SH + (q_start + i)*RNG_SS + j`` (``q_start`` = 0 dense;
    packed: the sequence's first token). Dense: ``(Hq*Sq*Sk, Sq*Sk, Sk)``; packed
    (``seqlen_k`` = max_seqlen_k, ``total_q`` = T_q): ``(0, T_q*max_k, max_k)``.
    """
    if varlen:
        return 0, int(total_q) * int(seqlen_k), int(seqlen_k)
    return int(num_heads_q) * int(seqlen_q) * int(seqlen_k), int(seqlen_q) * int(seqlen_k), int(seqlen_k)


def make_rng_state(device, seed: Optional[int] = None, offset: int = 0) -> torch.Tensor:
    """int64 ``[2]`` tensor ``(seed, offset)`` on ``device`` read by the dropout kernels.

    ``seed=None`` draws both from the device's default generator (``torch.randint``): no
    host sync, follows ``torch.manual_seed`` / Megatron's RNG-tracker forks, and is
    traceable by ``torch.compile``. An int seed gives a reproducible mask.
    """
    if seed is None:
        return torch.randint(0, 2 ** 62, (2,), device=device, dtype=torch.int64)
    return torch.tensor([int(seed), int(offset)], dtype=torch.int64, device=device)
