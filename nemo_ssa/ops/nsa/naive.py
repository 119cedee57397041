"""Readable torch reference for Native Sparse Attention (the correctness anchor).

NSA (Yuan et al. 2025, arXiv 2502.11089) gives every query three attention branches and
mixes them with learned per-head gates::

    o_t = g_cmp · Attn(q_t, K̃, Ṽ)                    compressed blocks (coarse, global)
        + g_slc · Attn(q_t, K_slc[sel(t)], V_slc[sel(t)])  top-n selected blocks (fine)
        + g_win · Attn(q_t, K_win[t-w+1 : t], V_win[...])  sliding window (local)
    g = sigmoid(gate_logits)                          per query head and branch

Every branch is the same thing: a row softmax over *transformed* scores (softmax or SSA,
as in ``nemo_ssa.ops.attention.naive``) restricted to the keys a boolean mask keeps. This file
therefore writes each branch as "build the mask, run masked attention": the masks are
the readable definition, the attention is dense (O(N²) memory, fine for tests and for
N up to a few thousand on a GPU). ``README.md`` next to this file has the conventions
and the derivation of the selection scores.

Layouts: ``q [B, Hq, N, D]``; every branch's ``k, v [B, Hkv, N, D]`` (GQA: query head
``h`` reads kv head ``h // (Hq // Hkv)``); ``gate_logits [B, Hq, N, 3]`` in branch order
(compressed, selected, window). Causal, self-attention only (``Sq == Sk == N``).

Precision: ``upcast=True`` (anchor) computes everything in fp32 (fp64 for fp64 inputs);
``upcast=False`` is the "eager same-dtype" path of the tolerance rule (matmuls in the
input dtype, softmax statistics in fp32).

What is differentiable: q, every branch's k and v, the gate logits, the compression MLP
parameters (and SSA's n, b). The block *selection* is an index choice made without
gradient (the importance scores are detached); gradient reaches the selected keys through
the selected-branch attention, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_ssa.ops.common.validate import Capabilities, validate_attention_args
from nemo_ssa.ops.attention.naive import ssa_transform

__all__ = [
    "NSAConfig",
    "PhiParams",
    "BRANCHES",
    "COMPRESS_MODES",
    "init_phi_params",
    "compress_kv",
    "num_compressed_blocks",
    "num_select_blocks",
    "compressed_visibility",
    "window_mask",
    "overlap_matrix",
    "selection_importance",
    "select_blocks",
    "selection_keep_mask",
    "masked_attention",
    "nsa_attention_naive",
]

BRANCHES = ("compressed", "selected", "window")
COMPRESS_MODES = ("mlp", "mean")
TRANSFORMS = ("softmax", "ssa")


# ----------------------------------------------------------------------------- config
def _check_pos_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"NSAConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class NSAConfig:
    """Sizes of the three NSA branches (paper defaults).

    Attributes:
        block_len: ``l``, tokens per compressed block.
        stride: ``d``, distance between the starts of consecutive compressed blocks
            (``d <= l``; blocks overlap when ``d < l``).
        select_block: ``l'``, tokens per selection block.
        top_n: ``n``, selection blocks per query, *including* the always-selected first
            block and the two local blocks (the query's own block and the one before).
        window: ``w``, sliding-window length; query ``t`` sees keys ``t-w+1 .. t``.
        compress: ``"mlp"`` (learnable φ with intra-block position encoding, residual
            around the block mean) or ``"mean"`` (mean pooling, no parameters).
        separate_kv: separate K/V projections per branch (the paper's choice). The ops
            take per-branch tensors either way; this flag is read by the layer module.
        compress_hidden: hidden width of φ's MLP; ``None`` means ``4 * head_dim``.
    """

    block_len: int = 32
    stride: int = 16
    select_block: int = 64
    top_n: int = 16
    window: int = 512
    compress: str = "mlp"
    separate_kv: bool = True
    compress_hidden: Optional[int] = None

    def __post_init__(self):
        for name in ("block_len", "stride", "select_block", "top_n", "window"):
            _check_pos_int(name, getattr(self, name))
        if self.stride > self.block_len:
            raise ValueError(
                f"NSAConfig.stride ({self.stride}) must be <= block_len ({self.block_len}): "
                "compressed blocks may overlap but must not leave gaps"
            )
        if self.top_n < 3:
            raise ValueError(
                f"NSAConfig.top_n must be >= 3 (it includes the first block and the 2 local "
                f"blocks), got {self.top_n}"
            )
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"NSAConfig.compress must be one of {COMPRESS_MODES}, got {self.compress!r}")
        if not isinstance(self.separate_kv, bool):
            raise ValueError(f"NSAConfig.separate_kv must be a bool, got {self.separate_kv!r}")
        if self.compress_hidden is not None:
            _check_pos_int("compress_hidden", self.compress_hidden)

    def hidden(self, head_dim: int) -> int:
        """Hidden width of the compression MLP for ``head_dim``."""
        return self.compress_hidden if self.compress_hidden is not None else 4 * head_dim


def num_compressed_blocks(n_tokens: int, config: NSAConfig) -> int:
    """Compressed blocks that fit entirely inside ``n_tokens``: block ``i`` covers
    tokens ``[i*d, i*d + l)``; a partial trailing block is never formed."""
    if n_tokens < config.block_len:
        return 0
    return (n_tokens - config.block_len) // config.stride + 1


def num_select_blocks(n_tokens: int, config: NSAConfig) -> int:
    """Selection blocks ``[j*l', (j+1)*l')``; the last one may be partial."""
    return -(-n_tokens // config.select_block)


# ------------------------------------------------------------------------ compression φ
class PhiParams(NamedTuple):
    """Parameters of one compression MLP φ (one for keys, one for values).

    ``φ(x_blk) = mean_l(x_blk) + W2 · gelu(W1 · flatten(x_blk + pe) + b1) + b2``

    Shapes: ``pe [l, D]``, ``w1 [l*D, H]``, ``b1 [H]``, ``w2 [H, D]``, ``b2 [D]``. Shared
    by all kv heads. The residual mean makes ``mlp`` start as ``mean`` when ``w2 = b2 = 0``.
    """

    pe: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor


def init_phi_params(config: NSAConfig, head_dim: int, *, dtype=torch.float32, device="cpu",
                    generator: Optional[torch.Generator] = None, std: float = 0.02,
                    zero_out: bool = False, requires_grad: bool = False) -> PhiParams:
    """Random φ parameters (tests use ``zero_out=False`` so every gradient is exercised)."""
    l, d, h = config.block_len, head_dim, config.hidden(head_dim)

    def rnd(*shape, scale=std):
        t = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
        return t

    w2 = torch.zeros(h, d) if zero_out else rnd(h, d, scale=1.0 / math.sqrt(h))
    b2 = torch.zeros(d) if zero_out else rnd(d)
    params = PhiParams(pe=rnd(l, d), w1=rnd(l * d, h, scale=1.0 / math.sqrt(l * d)), b1=rnd(h),
                       w2=w2, b2=b2)
    return PhiParams(*(p.to(device=device, dtype=dtype).requires_grad_(requires_grad) for p in params))


def compress_kv(x: torch.Tensor, config: NSAConfig, phi: Optional[PhiParams] = None) -> torch.Tensor:
    """Compress ``x [B, H, N, D]`` into ``[B, H, Nc, D]`` (one vector per compressed block).

    ``mean``: block mean. ``mlp``: block mean + MLP over the flattened block with a learned
    intra-block position encoding (see :class:`PhiParams`). Runs in ``x``'s dtype
    (callers upcast first for the fp32 anchor). Differentiable in ``x`` and ``phi``.
    """
    bsz, heads, n_tok, d = x.shape
    l, stride = config.block_len, config.stride
    nc = num_compressed_blocks(n_tok, config)
    if nc == 0:
        return x.new_zeros(bsz, heads, 0, d)
    blocks = x.unfold(2, l, stride).transpose(-1, -2)  # [B, H, Nc, l, D] (a view)
    pooled = blocks.mean(dim=-2)  # [B, H, Nc, D]
    if config.compress == "mean":
        return pooled
    if phi is None:
        raise ValueError("compress='mlp' needs the φ parameters (phi_k / phi_v)")
    pe, w1, b1, w2, b2 = (p.to(x.dtype) for p in phi)
    flat = (blocks + pe).reshape(bsz, heads, nc, l * d)  # [B, H, Nc, l*D]
    hidden = F.gelu(flat @ w1 + b1)  # [B, H, Nc, hidden]
    return pooled + hidden @ w2 + b2


# ------------------------------------------------------------------------------ masks
def compressed_visibility(n_tokens: int, config: NSAConfig, device=None) -> torch.Tensor:
    """``[N, Nc]`` bool: query ``t`` sees compressed block ``i`` iff the block has ended,
    i.e. its last token ``i*d + l - 1 <= t``."""
    nc = num_compressed_blocks(n_tokens, config)
    t = torch.arange(n_tokens, device=device)[:, None]
    last = torch.arange(nc, device=device)[None, :] * config.stride + config.block_len - 1
    return last <= t


def window_mask(n_tokens: int, window: int, device=None) -> torch.Tensor:
    """``[N, N]`` bool: query ``t`` sees key ``s`` iff ``t - window < s <= t``."""
    t = torch.arange(n_tokens, device=device)[:, None]
    s = torch.arange(n_tokens, device=device)[None, :]
    return (s <= t) & (t - s < window)


def overlap_matrix(n_tokens: int, config: NSAConfig, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[Nc, Nsel]``: the fraction of compressed block ``i`` that lies in selection block ``j``.

    ``M[i, j] = |[i*d, i*d + l) ∩ [j*l', (j+1)*l')| / l``. Each row sums to 1, so the
    selection scores redistribute the compressed attention mass onto selection blocks.
    With the paper's sizes (l=32, d=16, l'=64) a selection block collects the compressed
    blocks ``4j-1 .. 4j+3`` with weights ``(1, 2, 2, 2, 1) / 2`` -- the pattern of eq. (9).
    """
    nc = num_compressed_blocks(n_tokens, config)
    ns = num_select_blocks(n_tokens, config)
    c_lo = torch.arange(nc, device=device)[:, None] * config.stride
    s_lo = torch.arange(ns, device=device)[None, :] * config.select_block
    lo = torch.maximum(c_lo, s_lo)
    hi = torch.minimum(c_lo + config.block_len, s_lo + config.select_block)
    return (hi - lo).clamp(min=0).to(dtype) / config.block_len


def selection_importance(p_cmp: torch.Tensor, config: NSAConfig, num_kv_heads: int) -> torch.Tensor:
    """Selection-block scores ``[B, Hkv, N, Nsel]`` from compressed probabilities.

    ``p_cmp [B, Hq, N, Nc]`` (the compressed branch's attention probabilities) is summed
    over the query heads of each GQA group (the group shares one selection) and mapped
    onto selection blocks with :func:`overlap_matrix`. Not differentiable (detached).
    """
    bsz, hq, n_tok, nc = p_cmp.shape
    group = hq // num_kv_heads
    p = p_cmp.detach().float().reshape(bsz, num_kv_heads, group, n_tok, nc).sum(dim=2)
    return p @ overlap_matrix(n_tok, config, device=p.device)


def select_blocks(importance: torch.Tensor, config: NSAConfig) -> torch.Tensor:
    """Top-n selection blocks per query: ``[B, Hkv, N, top_n]`` int64, ascending, -1 padded.

    Block ``j`` is eligible for query ``t`` iff it has started (``j*l' <= t``). The first
    block and the local blocks ``cur`` and ``cur - 1`` (``cur = t // l'``) are always
    taken; the remaining slots go to the eligible blocks with the highest importance.
    Ties go to the lower block index (a stable sort), so every implementation picks the
    same set. Fewer eligible blocks than slots leaves ``-1`` entries.
    """
    bsz, hkv, n_tok, ns = importance.shape
    dev = importance.device
    t = torch.arange(n_tok, device=dev)[:, None]
    j = torch.arange(ns, device=dev)[None, :]
    cur = t // config.select_block
    eligible = j <= cur
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    score = torch.where(eligible, importance.float(), torch.full_like(importance, -math.inf, dtype=torch.float32))
    score = torch.where(forced & eligible, torch.full_like(score, math.inf), score)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., : config.top_n]
    picked = torch.gather(score, -1, order)
    idx = torch.where(picked > -math.inf, order, torch.full_like(order, -1))
    if idx.shape[-1] < config.top_n:  # fewer blocks in the sequence than slots
        pad = idx.new_full((bsz, hkv, n_tok, config.top_n - idx.shape[-1]), -1)
        idx = torch.cat([idx, pad], dim=-1)
    # canonical form: valid indices ascending, then the -1 padding
    key = torch.where(idx < 0, torch.full_like(idx, ns + 1), idx)
    return torch.gather(idx, -1, torch.sort(key, dim=-1).indices)


def selection_keep_mask(block_idx: torch.Tensor, n_tokens: int, config: NSAConfig) -> torch.Tensor:
    """``[B, Hkv, N, N]`` bool: query ``t`` may see key ``s`` iff ``s``'s selection block is
    in ``block_idx[..., t, :]`` (causality is applied separately)."""
    bsz, hkv, n_tok, _ = block_idx.shape
    ns = num_select_blocks(n_tokens, config)
    safe = torch.where(block_idx < 0, torch.full_like(block_idx, ns), block_idx).long()
    chosen = torch.zeros(bsz, hkv, n_tok, ns + 1, dtype=torch.bool, device=block_idx.device)
    chosen.scatter_(-1, safe, True)
    key_block = torch.arange(n_tokens, device=block_idx.device) // config.select_block
    return chosen[..., :ns][..., key_block]


# -------------------------------------------------------------------- masked attention
def masked_attention(q, k, v, keep, *, transform="softmax", n=None, b=None, softmax_scale=None,
                     upcast=True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax over transformed scores restricted to ``keep``; returns ``(o, p)``.

    ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` (GQA by head index), ``keep`` bool
    broadcastable to ``[B, Hq, Sq, Sk]``. Rows that keep nothing give ``o = 0``, ``p = 0``.
    ``p`` is returned in the softmax dtype (fp32, fp64 for fp64 inputs). This is
    ``attention_naive`` with a ``keep_mask`` and no causal flag (tests check that), plus
    the probabilities the selection needs.
    """
    out_dtype = q.dtype
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if upcast:
        q, k, v = q.to(stat), k.to(stat), v.to(stat)
    group = q.shape[1] // k.shape[1]
    if group != 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2) * scale).to(stat)  # [B, Hq, Sq, Sk]
    z = ssa_transform(s, n.to(stat), b.to(stat)) if transform == "ssa" else s
    z = z.masked_fill(~keep, -math.inf)  # mask z, never s (see ssa/README.md)
    empty = ~keep.any(dim=-1, keepdim=True)
    z = z.masked_fill(empty, 0.0)  # finite logits for rows that see nothing ...
    p = torch.softmax(z, dim=-1).masked_fill(empty, 0.0)  # ... and zero weights
    o = (p if upcast else p.to(out_dtype)) @ v
    return o.to(out_dtype), p


# ------------------------------------------------------------------------- whole layer
# the layer as a whole (the Triton stage launchers check their own dtype/head-dim limits);
# always causal, no user mask, no dropout
NSA_CAPS = Capabilities(name="nsa_attention", dropout=False, keep_mask=False)


def _validate_layer(q, branch_kv, gate_logits, config, phi_k, phi_v, transform, n, b, softmax_scale=None) -> None:
    if not isinstance(config, NSAConfig):
        raise ValueError(f"config must be an NSAConfig, got {type(config).__name__}")
    validate_attention_args(NSA_CAPS, q, branch_kv["k"], branch_kv["v"], n, b, transform=transform, causal=True,
                            softmax_scale=softmax_scale, dropout_p=0.0)
    bsz, hq, n_tok, d = q.shape
    for name, t in branch_kv.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, Hkv, N, D] tensor")
        if t.shape[0] != bsz or t.shape[2] != n_tok or t.shape[3] != d:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [B={bsz}, Hkv, N={n_tok}, D={d}]")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype/device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
    hkv = branch_kv["k"].shape[1]
    if any(t.shape[1] != hkv for t in branch_kv.values()):
        raise ValueError("all branches' k/v must have the same number of kv heads")
    if not isinstance(gate_logits, torch.Tensor) or tuple(gate_logits.shape) != (bsz, hq, n_tok, 3):
        raise ValueError(
            f"gate_logits must be [B, Hq, N, 3] = {[bsz, hq, n_tok, 3]} (branches {BRANCHES}), "
            f"got {tuple(getattr(gate_logits, 'shape', ()))}"
        )
    if gate_logits.device != q.device or not gate_logits.is_floating_point():
        raise ValueError(f"gate_logits must be a floating tensor on q's device {q.device}, got "
                         f"{gate_logits.dtype} on {gate_logits.device}")
    if config.compress == "mlp":
        l, h = config.block_len, config.hidden(d)
        want = PhiParams(pe=(l, d), w1=(l * d, h), b1=(h,), w2=(h, d), b2=(d,))
        for which, phi in (("phi_k", phi_k), ("phi_v", phi_v)):
            if phi is None:
                raise ValueError(f"compress='mlp' needs {which} (a PhiParams); use compress='mean' for none")
            for field, shape in zip(PhiParams._fields, want):
                got = tuple(getattr(phi, field).shape)
                if got != shape:
                    raise ValueError(f"{which}.{field} has shape {got}, expected {shape}")


def nsa_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    config: NSAConfig,
    *,
    k_slc: Optional[torch.Tensor] = None,
    v_slc: Optional[torch.Tensor] = None,
    k_win: Optional[torch.Tensor] = None,
    v_win: Optional[torch.Tensor] = None,
    phi_k: Optional[PhiParams] = None,
    phi_v: Optional[PhiParams] = None,
    transform: str = "softmax",
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    block_idx: Optional[torch.Tensor] = None,
    upcast: bool = True,
    return_aux: bool = False,
):
    """The whole NSA attention (after the projections and RoPE, before the output projection).

    Args:
        q: ``[B, Hq, N, D]``.
        k, v: ``[B, Hkv, N, D]``, the compressed branch's keys/values (before φ).
        gate_logits: ``[B, Hq, N, 3]``, pre-sigmoid gates for (compressed, selected, window).
        config: :class:`NSAConfig`.
        k_slc, v_slc, k_win, v_win: the selected / window branches' keys and values
            (``separate_kv``); ``None`` reuses ``k``, ``v``.
        phi_k, phi_v: :class:`PhiParams` of the key / value compression (``compress="mlp"``).
        transform, n, b: score transform (``"softmax"`` or ``"ssa"`` with its scalars),
            applied inside all three branches.
        softmax_scale: default ``1/sqrt(D)``; the same for all branches.
        block_idx: optional ``[B, Hkv, N, top_n]`` selection to use instead of computing
            one (tests feed the same selection to implementations whose probabilities
            differ by rounding, so a near-tie cannot flip a block).
        upcast: True (anchor) or False (eager same-dtype, for the tolerance rule).
        return_aux: also return a dict with the branch outputs, ``p_cmp``, the importance
            scores and ``block_idx``.

    Returns:
        ``o [B, Hq, N, D]`` in q's dtype (and the aux dict when asked).
    """
    k_slc = k if k_slc is None else k_slc
    v_slc = v if v_slc is None else v_slc
    k_win = k if k_win is None else k_win
    v_win = v if v_win is None else v_win
    kv = dict(k=k, v=v, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win)
    _validate_layer(q, kv, gate_logits, config, phi_k, phi_v, transform, n, b, softmax_scale)
    bsz, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    if upcast:
        kv = {name: t.to(stat) for name, t in kv.items()}
        phi_k = None if phi_k is None else PhiParams(*(p.to(stat) for p in phi_k))
        phi_v = None if phi_v is None else PhiParams(*(p.to(stat) for p in phi_v))
    attn = dict(transform=transform, n=n, b=b, softmax_scale=softmax_scale, upcast=upcast)
    qc = q.to(stat) if upcast else q

    # 1. compressed branch: attend to block summaries that have ended
    k_cmp = compress_kv(kv["k"], config, phi_k)  # [B, Hkv, Nc, D]
    v_cmp = compress_kv(kv["v"], config, phi_v)
    vis = compressed_visibility(n_tok, config, q.device)  # [N, Nc]
    o_cmp, p_cmp = masked_attention(qc, k_cmp, v_cmp, vis, **attn)

    # 2. selection from the compressed probabilities (no gradient), then fine attention
    importance = selection_importance(p_cmp, config, hkv)  # [B, Hkv, N, Nsel]
    if block_idx is None:
        block_idx = select_blocks(importance, config)
    causal = torch.ones(n_tok, n_tok, dtype=torch.bool, device=q.device).tril()
    keep_slc = selection_keep_mask(block_idx, n_tok, config) & causal  # [B, Hkv, N, N]
    keep_slc = keep_slc.repeat_interleave(group, dim=1)  # the group shares the selection
    o_slc, _ = masked_attention(qc, kv["k_slc"], kv["v_slc"], keep_slc, **attn)

    # 3. sliding window
    o_win, _ = masked_attention(qc, kv["k_win"], kv["v_win"], window_mask(n_tok, config.window, q.device), **attn)

    # 4. gated sum
    g = torch.sigmoid(gate_logits.to(stat) if upcast else gate_logits)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
    o = o.to(q.dtype)
    if not return_aux:
        return o
    aux: Dict[str, torch.Tensor] = dict(o_cmp=o_cmp, o_slc=o_slc, o_win=o_win, p_cmp=p_cmp,
                                        importance=importance, block_idx=block_idx,
                                        k_cmp=k_cmp, v_cmp=v_cmp)
    return o, aux
