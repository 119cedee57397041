"""The whole NSA attention from its stages, each with a Triton kernel and a torch fallback.

``nsa_attention`` runs, in order (every step but the first is a stage of ``STAGES``):

    (compress) φ(k), φ(v) over blocks, always torch (unfold + MLP: cuBLAS work)
    compressed attention over compressed blocks -> (o_cmp, lse_cmp)
    selection  scores from (q, k_cmp, lse_cmp), top-n blocks  (no gradient)
    selected   attention over the selected blocks -> o_slc
    window     sliding-window attention -> o_win
    gate       o = Σ sigmoid(gate_logits)_c · o_c  (fp32 math; Triton: one fused pass)

``impl`` picks an implementation per stage: ``"triton"`` (every kernel), ``"torch"``
(dense-mask torch versions of every stage, any device, O(N²) memory), ``"auto"``
(Triton on CUDA, torch elsewhere) or a dict ``{stage: impl}`` that overrides some
stages of ``"auto"`` -- the fallback when a kernel is missing for a case. The torch
stages share the kernels' interfaces (``lse`` in the log2 domain), so any mix works.
``nsa_attention_naive`` (``naive.py``) stays the independent anchor.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Union

import torch

from nemo_ssa.ops.nsa.naive import (
    NSAConfig,
    PhiParams,
    _validate_layer,
    compress_kv,
    compressed_visibility,
    masked_attention,
    select_blocks,
    selection_importance,
    selection_keep_mask,
    window_mask,
)
from nemo_ssa.ops.attention.naive import ssa_transform
from nemo_ssa.ops.common.target import backend

__all__ = ["nsa_attention", "STAGES", "IMPLS", "resolve_impl"]

STAGES = ("compressed", "selection", "selected", "window", "gate")
IMPLS = ("triton", "torch")
LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------- torch stages
def _compressed_torch(q, k_cmp, v_cmp, config, attn):
    o, p = masked_attention(q, k_cmp, v_cmp, compressed_visibility(q.shape[2], config, q.device), **attn)
    with torch.no_grad():  # lse (log2) of the same masked row, as the kernel emits it
        lse = _masked_lse2(q, k_cmp, compressed_visibility(q.shape[2], config, q.device), attn)
    return o, lse


def _scores_z(q, k, attn):
    """Transformed scores z [B, Hq, Sq, Sk] in fp32 (natural-log domain)."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if attn["softmax_scale"] is None else float(attn["softmax_scale"])
    s = q.float() @ kk.transpose(-1, -2) * scale
    if attn["transform"] == "ssa":
        return ssa_transform(s, attn["n"].detach().float(), attn["b"].detach().float())
    return s


def _masked_lse2(q, k, keep, attn):
    z = _scores_z(q, k, attn).masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(z, dim=-1) * LOG2E
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def _selection_torch(q, k_cmp, lse_cmp, config, attn):
    with torch.no_grad():
        keep = compressed_visibility(q.shape[2], config, q.device)
        z2 = _scores_z(q, k_cmp, attn) * LOG2E
        p = torch.where(keep, torch.exp2(z2 - lse_cmp[..., None]), torch.zeros_like(z2))
        return select_blocks(selection_importance(p, config, k_cmp.shape[1]), config)


def _selected_torch(q, k, v, block_idx, config, attn):
    n_tok = q.shape[2]
    causal = torch.ones(n_tok, n_tok, dtype=torch.bool, device=q.device).tril()
    keep = (selection_keep_mask(block_idx, n_tok, config) & causal).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return masked_attention(q, k, v, keep, **attn)[0]


def _window_torch(q, k, v, config, attn):
    return masked_attention(q, k, v, window_mask(q.shape[2], config.window, q.device), **attn)[0]


def _gate_torch(o_cmp, o_slc, o_win, gate_logits, attn):
    g = torch.sigmoid(gate_logits.float())
    o = g[..., 0:1] * o_cmp.float() + g[..., 1:2] * o_slc.float() + g[..., 2:3] * o_win.float()
    return o.to(o_cmp.dtype)


# -------------------------------------------------------------------- triton stages
def _kw(attn):
    return dict(transform=attn["transform"], n=attn["n"], b=attn["b"], softmax_scale=attn["softmax_scale"])


def _compressed_triton(q, k_cmp, v_cmp, config, attn):
    from nemo_ssa.ops.nsa.range_attn import compressed_attention

    return compressed_attention(q, k_cmp, v_cmp, config.block_len, config.stride, **_kw(attn))


def _selection_triton(q, k_cmp, lse_cmp, config, attn):
    from nemo_ssa.ops.nsa.select import select_blocks_triton

    return select_blocks_triton(q, k_cmp, lse_cmp, config, **_kw(attn))


def _selected_triton(q, k, v, block_idx, config, attn):
    from nemo_ssa.ops.nsa.selected_attn import selected_attention

    return selected_attention(q, k, v, block_idx, config.select_block, **_kw(attn))


def _window_triton(q, k, v, config, attn):
    from nemo_ssa.ops.nsa.range_attn import window_attention

    return window_attention(q, k, v, config.window, **_kw(attn))


def _gate_triton(o_cmp, o_slc, o_win, gate_logits, attn):
    if gate_logits.dtype != o_cmp.dtype:  # the fused kernel wants one dtype
        return _gate_torch(o_cmp, o_slc, o_win, gate_logits, attn)
    from nemo_ssa.ops.nsa.gate import gate_combine

    return gate_combine(o_cmp, o_slc, o_win, gate_logits)


_TABLE = {
    ("compressed", "torch"): _compressed_torch,
    ("compressed", "triton"): _compressed_triton,
    ("selection", "torch"): _selection_torch,
    ("selection", "triton"): _selection_triton,
    ("selected", "torch"): _selected_torch,
    ("selected", "triton"): _selected_triton,
    ("window", "torch"): _window_torch,
    ("window", "triton"): _window_triton,
    ("gate", "torch"): _gate_torch,
    ("gate", "triton"): _gate_triton,
}


def resolve_impl(impl: Union[str, Dict[str, str]], q: torch.Tensor) -> Dict[str, str]:
    """``impl`` -> ``{stage: "triton" | "torch"}`` (raises ValueError on unknown names)."""
    auto = "triton" if (backend(q.device) in ("cuda", "rocm") and q.dtype != torch.float64) else "torch"
    if isinstance(impl, str):
        if impl not in IMPLS + ("auto",):
            raise ValueError(f"unknown NSA impl {impl!r}; supported: {IMPLS + ('auto',)} or a dict {{stage: impl}}")
        return {s: auto if impl == "auto" else impl for s in STAGES}
    if not isinstance(impl, dict):
        raise ValueError(f"impl must be a str or a dict {{stage: impl}}, got {type(impl).__name__}")
    out = {s: auto for s in STAGES}
    for stage, choice in impl.items():
        if stage not in STAGES:
            raise ValueError(f"unknown NSA stage {stage!r}; supported stages: {STAGES}")
        if choice not in IMPLS:
            raise ValueError(f"unknown impl {choice!r} for stage {stage!r}; supported: {IMPLS}")
        out[stage] = choice
    return out


def nsa_attention(
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
    impl: Union[str, Dict[str, str]] = "auto",
    return_aux: bool = False,
):
    """NSA attention (same arguments and result as ``naive.nsa_attention_naive``).

    Args:
        q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (the compressed branch's, before φ).
        gate_logits: ``[B, Hq, N, 3]`` (compressed, selected, window), pre-sigmoid.
        config: :class:`NSAConfig`.
        k_slc, v_slc, k_win, v_win: per-branch keys/values; ``None`` reuses ``k``, ``v``.
        phi_k, phi_v: φ parameters (``compress="mlp"``).
        transform, n, b: ``"softmax"`` or ``"ssa"`` (+ its ``[1]`` scalars) in every branch.
        softmax_scale: default ``1/sqrt(D)``.
        block_idx: optional fixed selection ``[B, Hkv, N, top_n]`` (skips the selection stage).
        impl: ``"auto"``, ``"triton"``, ``"torch"`` or ``{stage: impl}`` (see module doc).
        return_aux: also return ``{"o_cmp", "o_slc", "o_win", "lse_cmp", "block_idx", "k_cmp", "v_cmp"}``.

    Returns:
        ``o [B, Hq, N, D]`` in q's dtype (and the aux dict).
    """
    k_slc = k if k_slc is None else k_slc
    v_slc = v if v_slc is None else v_slc
    k_win = k if k_win is None else k_win
    v_win = v if v_win is None else v_win
    _validate_layer(q, dict(k=k, v=v, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win),
                    gate_logits, config, phi_k, phi_v, transform, n, b, softmax_scale)
    choice = resolve_impl(impl, q)
    attn = dict(transform=transform, n=n, b=b, softmax_scale=softmax_scale)
    torch_attn = dict(attn, upcast=True)

    def run(stage, *args):
        fn = _TABLE[(stage, choice[stage])]
        return fn(*args, torch_attn if choice[stage] == "torch" else attn)

    k_cmp = compress_kv(k, config, phi_k)  # [B, Hkv, Nc, D], autograd through φ
    v_cmp = compress_kv(v, config, phi_v)
    o_cmp, lse_cmp = run("compressed", q, k_cmp, v_cmp, config)
    if block_idx is None:
        block_idx = run("selection", q, k_cmp.detach(), lse_cmp, config)
    o_slc = run("selected", q, k_slc, v_slc, block_idx, config)
    o_win = run("window", q, k_win, v_win, config)

    o = run("gate", o_cmp, o_slc, o_win, gate_logits)
    if not return_aux:
        return o
    return o, dict(o_cmp=o_cmp, o_slc=o_slc, o_win=o_win, lse_cmp=lse_cmp, block_idx=block_idx,
                   k_cmp=k_cmp, v_cmp=v_cmp)
