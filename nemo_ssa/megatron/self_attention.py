"""``FusedRopeSelfAttention``: megatron's SelfAttention with RoPE handed to the core attention.

Megatron-core 0.15.3's ``Attention.forward`` applies RoPE to q and k with its unfused
``apply_rotary_pos_emb`` (cos/sin/cat/rotate_half: several elementwise launches per
tensor) and then our core attention copies q, k, v into contiguous [b, h, s, d]
(``force_contiguous_qkv``, seed 000). For the fused core attentions (``softmax_triton``,
``ssa_triton``) this subclass instead stashes the rotary tensor on the core attention and
calls megatron's forward with ``rotary_pos_emb=None``; the core attention then runs one
Triton pass per tensor that applies RoPE and writes the contiguous layout
(``nemo_ssa.ops.rope.rope_layout_triton``). Everything else (QKV projection, output
projection, inference/KV cache code) is megatron's own.

Megatron's path is used, with one log line per reason, for what the fused pass does not
cover: packed (THD) sequences, inference / KV caches, context parallel > 1, recomputed
core attention (``recompute_granularity=selective`` replays the core attention without
the stash), interleaved / multi-latent / fused (TE) / mRoPE RoPE, cos/sin inputs, and
rotary tensors not shaped [s, 1, 1, rot_dim].
"""

from __future__ import annotations

import logging
from typing import Optional

from megatron.core.transformer.attention import SelfAttention

from nemo_ssa.megatron.compat import yarn_concentration_factor

logger = logging.getLogger("nemo_ssa.megatron.self_attention")
_LOGGED: set = set()


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("fused RoPE + layout not used (%s): megatron's RoPE and layout copies run instead", reason)


class FusedRopeSelfAttention(SelfAttention):
    """SelfAttention whose core attention applies RoPE fused with the q/k/v layout pass."""

    def _fallback_reason(self, rotary_pos_emb, inference_context, packed_seq_params, rotary_pos_cos,
                         rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset) -> Optional[str]:
        core, cfg = self.core_attention, self.config
        if not getattr(core, "fused_rope_layout", False):
            return "the core attention does not take it (fused_rope_layout off)"
        if inference_context is not None or sequence_len_offset is not None:
            return "inference"
        if packed_seq_params is not None:
            return "packed (THD) sequences"
        if getattr(core, "cp_size", 1) > 1:
            return "context parallel > 1"
        if self.checkpoint_core_attention and self.training:
            return "recomputed core attention"
        if any(t is not None for t in (rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin)):
            return "rotary cos/sin inputs"
        if cfg.apply_rope_fusion or getattr(cfg, "fused_single_qkv_rope", False):
            return "apply_rope_fusion / fused_single_qkv_rope (Transformer Engine RoPE)"
        if cfg.rotary_interleaved or cfg.multi_latent_attention or getattr(cfg, "mrope_section", None):
            return "interleaved / multi-latent / mRoPE rotary embedding"
        if rotary_pos_emb is not None:
            for f in (rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,)):
                if f is not None and (f.dim() != 4 or f.shape[1] != 1 or f.shape[2] != 1 or f.requires_grad):
                    return f"rotary tensor of shape {tuple(f.shape)} (supported: [s, 1, 1, rot_dim])"
        return None

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None):
        kwargs = dict(key_value_states=key_value_states, inference_context=inference_context,
                      rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                      rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                      packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                      inference_params=inference_params)
        reason = self._fallback_reason(rotary_pos_emb, inference_context or inference_params, packed_seq_params,
                                       rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset)
        if reason is not None:
            _log_once(reason)
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)
        no_rope = self.config.no_rope_freq[self.layer_number - 1] if self.config.no_rope_freq else False
        if no_rope or rotary_pos_emb is None:
            freqs_q = freqs_k = None  # layout only (still one pass, no separate copies)
        elif isinstance(rotary_pos_emb, tuple):
            freqs_q, freqs_k = rotary_pos_emb
        else:
            freqs_q = freqs_k = rotary_pos_emb
        if (freqs_q is None) != (freqs_k is None):
            _log_once("RoPE on only one of q / k")
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)
        core = self.core_attention
        core._pending_rope = (freqs_q, freqs_k, yarn_concentration_factor(self.config))
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
        finally:
            core._pending_rope = None
