"""NSA block selection in Triton: selection scores from the compressed branch, then top-n.

Two kernels, both without gradient (the selection is an index choice):

* ``_importance_kernel``: one program per (tile of queries, kv head) walks the selection
  blocks the tile can choose (causal: up to its last row's own block; later blocks are
  neither computed nor stored) in tiles of ``BLOCK_S``; per tile it recomputes the
  compressed branch's probabilities ``p = exp2(z2 - lse)`` from its saved ``lse`` (log2
  domain) for each query head of the GQA group and accumulates
  ``imp[t, j] = Σ_h Σ_i p[h, t, i] · M[i, j]`` with ``M`` the overlap fraction of
  compressed block ``i`` inside selection block ``j`` (``naive.overlap_matrix``). Only
  the compressed blocks overlapping the selection tile are visited, so the work is one
  pass over the visible compressed keys per head, like the compressed forward; the
  heaviest (latest) query tiles are launched first. Default order (``HEADS_INNER``): per
  chunk of compressed blocks, ``p`` is summed over the group's heads first and multiplied
  by ``M`` once (linear), as a hi/lo split into two tf32 dots (fp32-accurate). The banded
  order (``IMPORTANCE_BANDED``, the default where its chunks align) visits each compressed chunk once per query
  tile and multiplies it into the two ``STEP``-wide windows of selection blocks it can
  overlap, carrying the upper one to the next chunk.
* ``_topn_kernel``: per query row, forced blocks (first, current, previous) get ``+inf``,
  blocks that have not started ``-inf``, then ``top_n`` rounds of "take the maximum,
  lowest index on ties" -- the same deterministic choice as ``naive.select_blocks``. Rows
  are launched in ranges by the power-of-two width their candidates need (a query at
  ``t`` only chooses among blocks ``0 .. t // l'``).

Scores are fp32. The host processes queries in chunks so the ``[B, Hkv, T, Nsel]``
score buffer stays below ``max_buffer_elems`` (256 MiB by default) at any N.
Output: ``block_idx [B, Hkv, N, top_n]`` int32, valid indices ascending then ``-1``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from nemo_ssa.ops.common.transforms import score_fwd
from nemo_ssa.ops.common.launch import is_interpreter, next_pow2
from nemo_ssa.ops.nsa._common import block_d, check_kernel_tensors, dot_precision, fast_log2, ssa_scalars
from nemo_ssa.ops.nsa.naive import NSAConfig, num_select_blocks

__all__ = ["importance_scores", "topn_blocks", "select_blocks_triton"]


@triton.jit
def _chunk_p_sum(start_c, kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok, b, hk, Hq, N, NC,
                 skn, skd, sqh, scale, n_ssa, b_ssa, CSTRIDE, CLEN, GROUP,
                 TRANSFORM: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr, BLOCK_C: tl.constexpr,
                 FAST_LOG2: tl.constexpr = 0):
    """``(offs_c, p_sum)``: the compressed blocks ``start_c + [0, BLOCK_C)`` and ``p`` summed over
    the group's heads ``[BLOCK_M, BLOCK_C]``. ``MASKED``: apply the visibility rule (chunks
    at the diagonal); else every row sees every block of the chunk."""
    offs_c = start_c + tl.arange(0, BLOCK_C)
    if MASKED:
        kc = tl.load(kc_base + offs_c.to(tl.int64)[:, None] * skn + offs_d[None, :] * skd,
                     mask=(offs_c < NC)[:, None] & d_ok[None, :], other=0.0)
        vis = ((offs_c * CSTRIDE + CLEN - 1)[None, :] <= offs_m[:, None]) & (offs_c < NC)[None, :]
    else:
        kc = tl.load(kc_base + offs_c.to(tl.int64)[:, None] * skn + offs_d[None, :] * skd,
                     mask=d_ok[None, :], other=0.0)
    p_sum = tl.zeros([offs_m.shape[0], BLOCK_C], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        q = tl.load(q_base + h * sqh, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        # rows past T1 read lse = +inf: p = 0 with or without the mask
        lse = tl.load(LSE + (b * Hq + h) * N + offs_m, mask=m_ok, other=float("inf"))
        qk = tl.dot(q, tl.trans(kc), input_precision=PREC)  # [BLOCK_M, BLOCK_C]
        z2 = score_fwd(qk, scale, n_ssa, b_ssa, TRANSFORM, FAST_LOG2)
        if MASKED:
            p_sum += tl.exp2(tl.where(vis, z2 - lse[:, None], float("-inf")))
        else:
            p_sum += tl.exp2(z2 - lse[:, None])
    return offs_c, p_sum


@triton.jit
def _overlap_product(acc, p_sum, offs_c, offs_s, CSTRIDE, CLEN, SBLK, W_PREC: tl.constexpr):
    """``acc + p_sum @ M`` for compressed blocks ``offs_c`` and selection blocks ``offs_s``,
    ``M`` the overlap fraction of compressed block c inside selection block s."""
    cs = (offs_c * CSTRIDE)[:, None]
    ss = (offs_s * SBLK)[None, :]
    ov = tl.minimum(cs + CLEN, ss + SBLK) - tl.maximum(cs, ss)
    w = tl.where(ov > 0, ov.to(tl.float32), 0.0) / CLEN
    if W_PREC == "split":
        # p_sum = hi + lo with hi exact in tf32 (low 13 mantissa bits cleared) and w
        # exact in tf32 for the usual sizes (multiples of 1/CLEN): two tf32 dots
        # give the product to ~2^-20 relative; one would round each head-summed
        # p to 2^-11 and move the top-n on near-ties (measured in the record)
        p_hi = (p_sum.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        acc += tl.dot(p_hi, w, input_precision="tf32")
        acc += tl.dot(p_sum - p_hi, w, input_precision="tf32")
    else:
        acc += tl.dot(p_sum, w, input_precision=W_PREC)
    return acc


@triton.jit
def _importance_chunks(imp, start, end, kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok, offs_s, b, hk, Hq, N, NC,
                       skn, skd, sqh, scale, n_ssa, b_ssa, CSTRIDE, CLEN, SBLK, GROUP,
                       TRANSFORM: tl.constexpr, PREC: tl.constexpr, W_PREC: tl.constexpr,
                       MASKED: tl.constexpr, BLOCK_C: tl.constexpr, FAST_LOG2: tl.constexpr = 0):
    """``HEADS_INNER`` order over the compressed chunks ``[start, end)`` of one selection tile
    ``offs_s``: per chunk, ``p`` summed over the group's heads, times the overlap matrix once."""
    for start_c in range(start, end, BLOCK_C):
        offs_c, p_sum = _chunk_p_sum(start_c, kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok, b, hk, Hq, N, NC,
                                     skn, skd, sqh, scale, n_ssa, b_ssa, CSTRIDE, CLEN, GROUP,
                                     TRANSFORM, PREC, MASKED, BLOCK_C, FAST_LOG2)
        imp = _overlap_product(imp, p_sum, offs_c, offs_s, CSTRIDE, CLEN, SBLK, W_PREC)
    return imp


@triton.jit
def _importance_band(carry, start, end, out_row, sij, NS, kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok,
                     b, hk, Hq, N, NC, skn, skd, sqh, scale, n_ssa, b_ssa, CSTRIDE, CLEN, SBLK, GROUP,
                     TRANSFORM: tl.constexpr, PREC: tl.constexpr, W_PREC: tl.constexpr, MASKED: tl.constexpr,
                     BLOCK_C: tl.constexpr, STEP: tl.constexpr, FAST_LOG2: tl.constexpr = 0):
    """``BANDED`` order over the chunk-aligned compressed blocks ``[start, end)``: chunk ``k``
    (blocks ``k*BLOCK_C ..``) overlaps only selection blocks ``k*STEP .. (k+2)*STEP - 1``
    (``STEP = BLOCK_C * CSTRIDE / SBLK``). Its product goes to two ``STEP``-wide windows:
    the lower one is complete with the previous chunk's ``carry`` and is stored, the upper
    one becomes the next ``carry``. Each compressed block is visited once per query tile and
    the overlap product is ``2 x STEP`` wide, not a whole selection tile."""
    offs_w = tl.arange(0, STEP)
    for start_c in range(start, end, BLOCK_C):
        offs_c, p_sum = _chunk_p_sum(start_c, kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok, b, hk, Hq, N, NC,
                                     skn, skd, sqh, scale, n_ssa, b_ssa, CSTRIDE, CLEN, GROUP,
                                     TRANSFORM, PREC, MASKED, BLOCK_C, FAST_LOG2)
        lo = (start_c // BLOCK_C) * STEP + offs_w
        done = _overlap_product(carry, p_sum, offs_c, lo, CSTRIDE, CLEN, SBLK, W_PREC)
        tl.store(out_row + lo[None, :] * sij, done, mask=m_ok[:, None] & (lo < NS)[None, :])
        carry = _overlap_product(tl.zeros_like(carry), p_sum, offs_c, lo + STEP, CSTRIDE, CLEN, SBLK, W_PREC)
    return carry


@triton.jit
def _importance_kernel(
    Q, KC, LSE, IMP, NP, BP,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    sib, sih, sin, sij,
    Hq, Hkv, N, NC, NS, D, GROUP, T0, T1,
    scale, CSTRIDE, CLEN, SBLK,
    TRANSFORM: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS_INNER: tl.constexpr = False, W_PREC: tl.constexpr = "ieee", FAST_LOG2: tl.constexpr = 0,
    STEP: tl.constexpr = 0,
):
    # heaviest query tiles (most visible compressed blocks) first: better tail balance.
    # HEADS_INNER: per chunk of compressed blocks, sum p over the group's heads first and
    # multiply by the overlap matrix once (one [BLOCK_M, BLOCK_C] x [BLOCK_C, BLOCK_S] dot
    # per chunk instead of one per head: the sum is linear); else one dot per head.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)  # B * Hkv
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    n_ssa = tl.load(NP).to(tl.float32)
    b_ssa = tl.load(BP).to(tl.float32)

    offs_m = T0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # absolute query positions
    m_ok = offs_m < T1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_last = tl.minimum(T0 + pid_m * BLOCK_M + BLOCK_M, T1) - 1
    # causal: no row of the tile can select a block after its own, so later selection
    # blocks are neither computed nor stored (top-n never reads them)
    s_end = tl.minimum(m_last // SBLK + 1, NS)
    # compressed blocks visible to the last query of the tile (i*d + l - 1 <= t)
    c_vis = tl.where(m_last >= CLEN - 1, tl.maximum(m_last - CLEN + 1, 0) // CSTRIDE + 1, 0)
    m_first = T0 + pid_m * BLOCK_M  # ... and to its first query
    c_vis_first = tl.where(m_first >= CLEN - 1, tl.maximum(m_first - CLEN + 1, 0) // CSTRIDE + 1, 0)
    kc_base = KC + b * skb + hk * skh
    q_base = Q + b * sqb + offs_m.to(tl.int64)[:, None] * sqn + offs_d[None, :] * sqd
    if STEP > 0:  # BANDED (heads summed per chunk): one pass over the chunks, 2 x STEP-wide products
        out_row = IMP + b * sib + hk * sih + (offs_m - T0).to(tl.int64)[:, None] * sin
        # chunks every row of the tile sees whole need no mask; then up to the last row's
        # visible blocks, rounded up to whole chunks (blocks past NC are masked)
        band_full = c_vis_first // BLOCK_C * BLOCK_C
        band_end = tl.cdiv(c_vis, BLOCK_C) * BLOCK_C
        band_args = (out_row, sij, NS, kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok, b, hk, Hq, N, NC, skn, skd,
                     sqh, scale, n_ssa, b_ssa, CSTRIDE, CLEN, SBLK, GROUP)
        carry = tl.zeros([BLOCK_M, STEP], dtype=tl.float32)
        carry = _importance_band(carry, 0, band_full, *band_args, TRANSFORM, PREC, W_PREC, False, BLOCK_C, STEP,
                                 FAST_LOG2)
        carry = _importance_band(carry, band_full, band_end, *band_args, TRANSFORM, PREC, W_PREC, True, BLOCK_C,
                                 STEP, FAST_LOG2)
        # the last chunk's upper window (all zeros when the tile sees no compressed block);
        # with it every selection block up to the tile's last row's own block is written
        last = (band_end // BLOCK_C) * STEP + tl.arange(0, STEP)
        tl.store(out_row + last[None, :] * sij, carry, mask=m_ok[:, None] & (last < NS)[None, :])
    for j0 in range(0, 0 if STEP > 0 else s_end, BLOCK_S):
        offs_s = j0 + tl.arange(0, BLOCK_S)
        # compressed blocks overlapping selection blocks [j0, j0 + BLOCK_S)
        x = j0 * SBLK - CLEN
        c_lo = tl.where(x >= 0, tl.maximum(x, 0) // CSTRIDE + 1, 0)
        c_hi = tl.minimum(tl.minimum(((j0 + BLOCK_S) * SBLK + CSTRIDE - 1) // CSTRIDE, NC), c_vis)
        imp = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
        if HEADS_INNER:
            # chunks every row of the tile sees whole (c*d + l - 1 <= first row) need no
            # visibility mask; the rest (the diagonal) keep it
            c_full = tl.maximum(tl.minimum(c_vis_first, c_hi) - c_lo, 0) // BLOCK_C * BLOCK_C + c_lo
            args = (kc_base, q_base, LSE, offs_m, m_ok, offs_d, d_ok, offs_s, b, hk, Hq, N, NC, skn, skd, sqh,
                    scale, n_ssa, b_ssa, CSTRIDE, CLEN, SBLK, GROUP)
            imp = _importance_chunks(imp, c_lo, c_full, *args, TRANSFORM, PREC, W_PREC, False, BLOCK_C, FAST_LOG2)
            imp = _importance_chunks(imp, c_full, c_hi, *args, TRANSFORM, PREC, W_PREC, True, BLOCK_C, FAST_LOG2)
        for g in range(0 if HEADS_INNER else GROUP):
            h = hk * GROUP + g
            # the tile's q rows are re-read per selection tile: L1/L2 hits after the first
            q = tl.load(q_base + h * sqh, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(LSE + (b * Hq + h) * N + offs_m, mask=m_ok, other=float("inf"))
            for start_c in range(c_lo, c_hi, BLOCK_C):
                offs_c = start_c + tl.arange(0, BLOCK_C)
                kc = tl.load(kc_base + offs_c.to(tl.int64)[:, None] * skn + offs_d[None, :] * skd,
                             mask=(offs_c < NC)[:, None] & d_ok[None, :], other=0.0)
                qk = tl.dot(q, tl.trans(kc), input_precision=PREC)  # [BLOCK_M, BLOCK_C]
                z2 = score_fwd(qk, scale, n_ssa, b_ssa, TRANSFORM, FAST_LOG2)
                vis = ((offs_c * CSTRIDE + CLEN - 1)[None, :] <= offs_m[:, None]) & (offs_c < NC)[None, :]
                # mask the exponent, not the result: an invisible (future) block can score
                # far above the row's lse, and exp2 of that overflows to inf (harmless under
                # the where, NaN as soon as anything multiplies it)
                p = tl.exp2(tl.where(vis, z2 - lse[:, None], float("-inf")))
                # overlap fraction of compressed block c inside selection block s: [BLOCK_C, BLOCK_S]
                cs = (offs_c * CSTRIDE)[:, None]
                ss = (offs_s * SBLK)[None, :]
                ov = tl.minimum(cs + CLEN, ss + SBLK) - tl.maximum(cs, ss)
                w = tl.where(ov > 0, ov.to(tl.float32), 0.0) / CLEN
                imp += tl.dot(p, w, input_precision=PREC)
        out = IMP + b * sib + hk * sih + (offs_m - T0).to(tl.int64)[:, None] * sin + offs_s[None, :] * sij
        tl.store(out, imp, mask=m_ok[:, None] & (offs_s < NS)[None, :])


@triton.jit
def _topn_kernel(
    IMP, IDX,
    sib, sih, sin, sij,
    sxb, sxh, sxn, sxs,
    Hkv, NS, T0, R0, R1, SBLK,
    TOPN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # rows T0 + R0 .. T0 + R1 - 1 (absolute positions); IMP / IDX rows are relative to T0.
    # The host guarantees every such row's own block is < BLOCK_S.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    offs_m = T0 + R0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T0 + R1
    offs_s = tl.arange(0, BLOCK_S)
    cur = offs_m // SBLK
    # entries after a row's own block were never written (causal): not read either
    imp = tl.load(IMP + b * sib + hk * sih + (offs_m - T0).to(tl.int64)[:, None] * sin + offs_s[None, :] * sij,
                  mask=m_ok[:, None] & (offs_s[None, :] <= cur[:, None]) & (offs_s < NS)[None, :], other=0.0)
    s2 = offs_s[None, :]
    eligible = (s2 <= cur[:, None]) & (s2 < NS)
    forced = (s2 == 0) | (s2 == cur[:, None]) | (s2 == cur[:, None] - 1)
    score = tl.where(eligible, tl.where(forced, float("inf"), imp), float("-inf"))
    out = IDX + b * sxb + hk * sxh + (offs_m - T0).to(tl.int64) * sxn
    for slot in tl.static_range(TOPN):
        best = tl.max(score, 1)  # [BLOCK_M]
        arg = tl.min(tl.where(score == best[:, None], s2, BLOCK_S), 1)  # lowest index on ties
        tl.store(out + slot * sxs, tl.where(best > float("-inf"), arg, -1), mask=m_ok)
        score = tl.where(s2 == arg[:, None], float("-inf"), score)


# ------------------------------------------------------------------------------ launchers
#: ``_importance_kernel`` tiles on a GPU: (BLOCK_M queries, BLOCK_C compressed blocks,
#: BLOCK_S selection blocks, warps). A selection tile visits the compressed blocks that
#: overlap it, so a wider BLOCK_S revisits fewer of them at tile edges.
#: Measured (H200, D64 GQA16, docs/results/2026-11-26-hopper): heads summed per chunk with
#: (64, 64, 128, 4) takes the selection from 16.6 to 8.4 ms at 64K (1.42 to 0.74 at 16K) and
#: matches the fp64 top-n exactly at 16K, where the per-head order (64, 32, 16, 4) missed 1.1%.
IMPORTANCE_TILES = (64, 64, 128, 4)
#: groups of at least this many query heads per kv head take ``IMPORTANCE_TILES_WIDE``:
#: 128 compressed blocks per chunk (the banded order's STEP 32). H100, N=64K GQA16
#: (docs/results/2026-11-26-nsa-qmajor-dq, call 7): the selection 10.5 against 15.2 ms at
#: D128, 6.9 against 7.3 at D64, 9.2 against 9.6 with SSA, 0.95 against 1.20 at D128 16K;
#: the same selections in every row. GQA 3 keeps 64 (7.4 against 7.7 ms at D64, 8.3 against
#: 8.6 at D128).
IMPORTANCE_TILES_WIDE = (64, 128, 128, 4)
IMPORTANCE_WIDE_MIN_GROUP = 16
#: loop order of the importance kernel (``_importance_kernel``'s ``HEADS_INNER``)
IMPORTANCE_HEADS_INNER = True
#: the banded order (``_importance_band``, heads summed per chunk) where the configuration
#: allows it (``banded_step``; BLOCK_S is then unused). Its importance pass measured 0.95 ms
#: faster at D64 GQA16 64K (8.06 against 9.02 with the same top-n), 1.65 at GQA 3 and 1.66
#: at D128 (H200, docs/results/2026-11-26-nsa-selected, call 6). Against an fp64 selection
#: (kv head 0; H100, docs/results/2026-11-26-gluon, call 1) it misses no more rows than the
#: tile order at any shape checked (64K: 4 of 65,536 rows at D64 GQA16 for both, 4 against 5
#: at D128; none at GQA 3 64K and at D64 GQA16 16K), and the importance its misses lose is
#: fp32 noise (at most 2e-7 of the row's largest importance). TILE_OVERRIDE["banded"] = False
#: restores the tile order
IMPORTANCE_BANDED = True
#: tuning hook: ``{"importance": (bm, bc, bs, warps), "heads_inner": bool, "banded": bool}``
#: overrides the tiles (either table), the loop order and the banded order above
TILE_OVERRIDE: dict = {}


def banded_step(block_c: int, stride: int, block_len: int, select_block: int) -> int:
    """``STEP`` of the banded importance order, or 0 where it does not apply: a chunk of
    ``block_c`` compressed blocks must start on a selection-block boundary and advance by a
    power-of-two number ``STEP`` of selection blocks (``block_c * stride = STEP * l'``), and
    a block's overhang past its stride (``l - d``) must fit in the next ``STEP`` blocks, so
    each chunk touches two ``STEP``-wide windows. On a GPU ``STEP >= 16`` (an MMA tile)."""
    if (block_c * stride) % select_block:
        return 0
    step = block_c * stride // select_block
    if step < 1 or step & (step - 1) or block_len - stride > step * select_block:
        return 0
    if step < 16 and not is_interpreter():
        return 0
    return step


def _chunk_rows(bsz, hkv, ns, n_tok, max_buffer_elems, align):
    rows = max(align, (max_buffer_elems // max(1, bsz * hkv * ns)) // align * align)
    return min(rows, triton.cdiv(n_tok, align) * align)


def importance_scores(q, k_cmp, lse_cmp, config: NSAConfig, *, transform="softmax", n=None, b=None,
                      softmax_scale=None, t0: int = 0, t1: Optional[int] = None,
                      fill_future: bool = True) -> torch.Tensor:
    """Selection scores ``[B, Hkv, t1 - t0, Nsel]`` (fp32) for queries ``t0 .. t1-1``.

    ``lse_cmp [B, Hq, N]`` is the compressed branch's log2-domain log-sum-exp
    (``range_attn.compressed_attention``); ``k_cmp [B, Hkv, Nc, D]``. Scores of blocks
    after a query's own block are 0 (``fill_future=False``: left unwritten -- what the
    top-n uses, it never reads them).
    """
    check_kernel_tensors({"q": q, "k_cmp": k_cmp})
    bsz, hq, n_tok, d = q.shape
    hkv, nc = k_cmp.shape[1], k_cmp.shape[2]
    t1 = n_tok if t1 is None else t1
    ns = num_select_blocks(n_tok, config)
    if nc == 0 or t1 <= t0:
        return torch.zeros(bsz, hkv, t1 - t0, ns, device=q.device, dtype=torch.float32)
    # the kernel writes only entries (t, j) with j <= t // l' (a query cannot select a later
    # block); the rest are zeros, or -- for the top-n, which never reads them -- left
    # unwritten (NaN-poisoned under the interpreter, so a read there would show in tests)
    shape = (bsz, hkv, t1 - t0, ns)
    if fill_future:
        imp = torch.zeros(shape, device=q.device, dtype=torch.float32)
    elif is_interpreter():
        imp = torch.full(shape, math.nan, device=q.device, dtype=torch.float32)
    else:
        imp = torch.empty(shape, device=q.device, dtype=torch.float32)
    tid, n_t, b_t = ssa_scalars(transform, n, b, q.device)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if is_interpreter():
        bm, bc, bs, warps = 16, 16, 16, 1
    else:
        wide = hq // hkv >= IMPORTANCE_WIDE_MIN_GROUP
        bm, bc, bs, warps = TILE_OVERRIDE.get("importance", IMPORTANCE_TILES_WIDE if wide else IMPORTANCE_TILES)
    heads_inner = TILE_OVERRIDE.get("heads_inner", IMPORTANCE_HEADS_INNER)
    # the overlap product of the head-summed p (HEADS_INNER): for 16-bit inputs a hi/lo split
    # into two tf32 dots ("split", ~fp32 accurate); fp32 inputs: IEEE. Triton's tf32x3 is as
    # exact but measured 3x slower here; plain tf32 moved 3.9% of the top-n rows off the fp64
    # selection at 16K (the per-head order: 1.1%)
    w_prec = TILE_OVERRIDE.get("w_prec", "split" if dot_precision(q.dtype) == "tf32" else "ieee")
    banded = heads_inner and TILE_OVERRIDE.get("banded", IMPORTANCE_BANDED)
    step = banded_step(bc, config.stride, config.block_len, config.select_block) if banded else 0
    grid = (triton.cdiv(t1 - t0, bm), bsz * hkv)
    _importance_kernel[grid](
        q, k_cmp, lse_cmp.contiguous(), imp, n_t, b_t,
        *q.stride(), *k_cmp.stride(), *imp.stride(),
        hq, hkv, n_tok, nc, ns, d, hq // hkv, t0, t1,
        scale, config.stride, config.block_len, config.select_block,
        TRANSFORM=tid, PREC=dot_precision(q.dtype),
        BLOCK_M=bm, BLOCK_C=bc, BLOCK_S=bs, BLOCK_D=block_d(d), HEADS_INNER=bool(heads_inner), W_PREC=w_prec,
        STEP=step,
        FAST_LOG2=fast_log2(tid, q.device),  # the compressed forward's scores, which made lse
        num_warps=warps,
    )
    return imp


def topn_blocks(importance: torch.Tensor, config: NSAConfig, t0: int = 0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-n selection from scores ``[B, Hkv, T, Nsel]`` of queries ``t0 .. t0+T-1``.

    Writes (into ``out`` when given, e.g. a row-slice of the full index tensor) and returns
    ``[B, Hkv, T, top_n]`` int32 in *selection order* (forced blocks first, then by
    decreasing score); :func:`select_blocks_triton` canonicalises to ascending order.
    """
    bsz, hkv, rows, ns = importance.shape
    if out is None:
        out = torch.empty(bsz, hkv, rows, config.top_n, device=importance.device, dtype=torch.int32)
    sblk = config.select_block
    # Row ranges by the power-of-two width their candidates need: a query at t chooses among
    # blocks 0 .. t // l' only, so rows before 2^k * l' run with BLOCK_S = 2^k (at 64K the
    # average width is ~2/3 of the full row). Boundaries are host ints: no sync.
    r0 = 0
    while r0 < rows:
        width = min(ns, (t0 + r0) // sblk + 1)  # candidates of the range's first row
        bs = max(16, next_pow2(width))
        r1 = rows if bs >= ns else min(rows, bs * sblk - t0)  # last row whose blocks fit in bs
        bm = 4 if is_interpreter() else max(1, min(64, 8192 // bs))
        grid = (triton.cdiv(r1 - r0, bm), bsz * hkv)
        _topn_kernel[grid](
            importance, out, *importance.stride(), *out.stride(),
            hkv, ns, t0, r0, r1, config.select_block,
            TOPN=config.top_n, BLOCK_M=bm, BLOCK_S=bs, num_warps=1 if is_interpreter() else 4,
        )
        r0 = r1
    return out


def select_blocks_triton(q, k_cmp, lse_cmp, config: NSAConfig, *, transform="softmax", n=None, b=None,
                         softmax_scale=None, max_buffer_elems: int = 64 * 1024 * 1024) -> torch.Tensor:
    """``block_idx [B, Hkv, N, top_n]`` (int32, ascending, ``-1`` padded) from the compressed
    branch; no gradient. Equals ``naive.select_blocks(naive.selection_importance(p_cmp))``
    up to near-ties of the fp32 scores."""
    bsz, hq, n_tok, d = q.shape
    hkv = k_cmp.shape[1]
    ns = num_select_blocks(n_tok, config)
    idx = torch.empty(bsz, hkv, n_tok, config.top_n, device=q.device, dtype=torch.int32)
    rows = _chunk_rows(bsz, hkv, ns, n_tok, max_buffer_elems, align=64)
    with torch.no_grad():
        for t0 in range(0, n_tok, rows):
            t1 = min(n_tok, t0 + rows)
            imp = importance_scores(q, k_cmp, lse_cmp, config, transform=transform, n=n, b=b,
                                    softmax_scale=softmax_scale, t0=t0, t1=t1, fill_future=False)
            topn_blocks(imp, config, t0=t0, out=idx[:, :, t0:t1])
        key = torch.where(idx < 0, torch.full_like(idx, ns + 1), idx)
        return torch.gather(idx, -1, torch.sort(key, dim=-1).indices)
