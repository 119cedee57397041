"""Tensor- and context-parallel pieces of the core attentions (megatron layouts).

Two things change when a core attention runs on more than one rank:

**Tensor parallel (TP).** Each TP rank holds ``heads / tp`` query heads (and
``groups / tp`` K/V groups). Per-layer scalars shared by every head (SSA's ``n``, a
learnable ``b``) are replicated on every TP rank, but the gradient one rank computes is a
partial sum over *its* heads. :func:`replicate_over_tp` passes such a scalar through
megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of the
gradient over the TP group in backward): every TP rank then sees the full gradient, takes
the same optimizer step and keeps a bit-identical ``n``. Megatron's DDP reduces gradients
only over the data(-and-context)-parallel group, and its ``finalize_model_grads`` adds the
TP all-reduce only for ``sequence_parallel`` parameters when SP is on — neither covers
``n``, hence this function. Sequence parallel needs nothing more here: the core attention
sits between ``linear_qkv`` (which all-gathers the sequence) and ``linear_proj`` (which
reduce-scatters it), so it always sees the full sequence and ``heads / tp`` heads.

**Context parallel (CP), causal.** Megatron's data step (``get_batch_on_this_cp_rank``)
splits every sequence into ``2·cp`` chunks of ``c = S / (2·cp)`` tokens and gives rank
``r`` chunks ``r`` and ``2·cp-1-r`` (load balance: an early chunk has few keys to look
at, a late one many). RoPE is already applied to the local q/k at their true positions
(megatron's rotary embedding slices its table the same way). The core attention then

1. all-gathers K and V over the CP group and reorders the chunks to natural order
   (:class:`_GatherSequenceChunks`; its backward is the matching reduce-scatter, so
   every rank's dK/dV contributions are summed and returned to the rank that owns the
   keys);
2. calls the op once per local query chunk ``i``: ``q[chunk i]`` against the key prefix
   ``K[: (i+1)·c]`` with bottom-right-aligned causality (query row ``t`` of the chunk
   sits at absolute position ``i·c + t`` = ``t + Sk - Sq``), which every supported op
   implements for ``Sq != Sk``; for ``no_mask`` every chunk sees all keys.

The gradient of ``n`` (and a learnable ``b``) on one CP rank covers only its query rows;
megatron's DDP all-reduces *every* gradient over the data-parallel group *with* context
parallel (``get_data_parallel_group(with_context_parallel=True)``) and scales by
``1/(dp·cp)`` with each rank's loss a mean over its own tokens, which is exactly the full
gradient — ``n`` needs nothing extra (tested: CP2 trajectories equal the 1-rank run).

Why all-gather and not a ring: with GQA the K/V of a layer are ``2·groups/heads`` = 2/3
of the query size at the recipe's shape (24 heads, 8 groups), one all-gather per layer
moves ``(cp-1)/cp`` of them, and every op call is a full, exact kernel call (no partial
results to merge). A ring (``cp`` steps of partial attention merged with the
log-sum-exp merge of ``nemo_ssa/ops/elsa``) overlaps communication with compute and keeps
K/V memory at ``S/cp``; it pays off at long sequences and large ``cp``, where the
all-gathered K/V no longer fit or the all-gather no longer hides. At the recipe's
sequence lengths (1-16K) and cp = 2-4 the gathered K/V are a few MiB per layer; CP's measured
throughput is in docs/results/2026-11-25-two-gpu/cp.md.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "group_size",
    "group_rank",
    "tp_group_of",
    "cp_group_of",
    "replicate_over_tp",
    "local_chunk_ids",
    "gather_sequence_chunks",
    "assert_identical_over_group",
]


def group_size(group) -> int:
    return 1 if group is None else int(group.size())


def group_rank(group) -> int:
    return 0 if group is None else int(group.rank())


def _mpu_group(name: str):
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if name == "tp":
        return parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_context_parallel_group()


def tp_group_of(pg_collection) -> Optional["dist.ProcessGroup"]:
    """The TP group from megatron's ``pg_collection`` (or its global state; None without one)."""
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return group if group is not None else _mpu_group("tp")


def cp_group_of(pg_collection) -> Optional["dist.ProcessGroup"]:
    """The CP group from megatron's ``pg_collection`` (or its global state; None without one)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return group if group is not None else _mpu_group("cp")


def replicate_over_tp(t: Tensor, tp_group) -> Tensor:
    """``t`` unchanged in forward; its gradient all-reduced (summed) over ``tp_group``.

    For parameters every TP rank holds whole while each rank uses them on its own slice of
    the heads (SSA's n, b). Identity (no autograd node) when the group has one rank.
    """
    if group_size(tp_group) == 1 or not t.requires_grad:
        return t
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(t, group=tp_group)


def local_chunk_ids(cp_rank: int, cp_size: int) -> Tuple[int, int]:
    """The two sequence chunks (of ``2·cp``) that megatron's load-balanced split gives a rank."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _natural_order(cp_size: int) -> Sequence[int]:
    """Index into the gathered ``[rank0: (0, 2cp-1), rank1: (1, 2cp-2), ...]`` chunk list
    that yields chunks ``0 .. 2cp-1`` in sequence order."""
    order = []
    for chunk in range(2 * cp_size):
        owner = chunk if chunk < cp_size else 2 * cp_size - 1 - chunk
        order.append(2 * owner + (0 if chunk < cp_size else 1))
    return order


class _GatherSequenceChunks(torch.autograd.Function):
    """All-gather ``[2c, ...]`` local chunks over the CP group -> ``[S, ...]`` in sequence order.

    Backward: the inverse reorder, then a reduce-scatter (sum over the ranks that used
    the keys), so each rank receives the total gradient of the chunks it owns.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        cp = group.size()
        x = x.contiguous()
        gathered = torch.empty((cp * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x, group=group)
        c = x.shape[0] // 2
        order = torch.tensor(_natural_order(cp), device=x.device)
        ctx.group, ctx.order, ctx.c = group, order, c
        chunks = gathered.view((2 * cp, c) + tuple(x.shape[1:]))
        return chunks.index_select(0, order).reshape(gathered.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group, order, c = ctx.group, ctx.order, ctx.c
        cp = group.size()
        grad = grad.contiguous()
        chunks = grad.view((2 * cp, c) + tuple(grad.shape[1:]))
        # rank-major layout again: position p of the gathered list holds natural chunk order[p]
        rank_major = torch.empty_like(chunks)
        rank_major.index_copy_(0, order, chunks)
        rank_major = rank_major.reshape(grad.shape)
        out = torch.empty((2 * c,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, rank_major, group=group)
        return out, None


def gather_sequence_chunks(x: Tensor, cp_group) -> Tensor:
    """``x`` [2c, ...] (this rank's two load-balanced chunks, sequence first) ->
    ``[2c·cp, ...]`` the whole sequence in order, differentiable (see the class)."""
    if group_size(cp_group) == 1:
        return x
    if x.shape[0] % 2:
        raise ValueError(f"context parallel: the local sequence length {x.shape[0]} must be even "
                         "(two chunks per rank; seq_length must be a multiple of 2*context_parallel_size)")
    return _GatherSequenceChunks.apply(x, cp_group)


def assert_identical_over_group(values: Tensor, group, what: str) -> None:
    """Raise if ``values`` differ (bitwise) between the ranks of ``group``."""
    if group_size(group) == 1:
        return
    flat = values.detach().float().reshape(-1).cpu() if values.device.type == "cpu" else values.detach().float().reshape(-1)
    gathered = [torch.empty_like(flat) for _ in range(group.size())]
    dist.all_gather(gathered, flat, group=group)
    for r, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            raise RuntimeError(f"{what} differs between ranks of the group: rank 0 {gathered[0].tolist()} "
                               f"vs rank {r} {other.tolist()}")
