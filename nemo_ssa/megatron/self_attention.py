"""``FusedRopeSelfAttention``: megatron's SelfAttention with RoPE and the q/k/v layout in one pass.

Megatron-core's ``Attention.forward`` splits the QKV projection's output into q, k, v
(``get_query_key_value_tensors``: a split of ``mixed_qkv [s, b, ng, (np/ng + 2) * hn]`` and a
reshape of q into [s, b, np, hn], a copy, since one group's query heads are hn apart and groups
(np/ng + 2) * hn apart), applies RoPE with its unfused ``apply_rotary_pos_emb`` (cos/sin/cat/
rotate_half: several elementwise launches per tensor), and our core attention then copies q,
k, v into contiguous [b, h, s, d] (``force_contiguous_qkv``, seed 000). Backward, autograd's
split node concatenates the three gradients into d(mixed_qkv): one more full copy.

For the fused core attentions (``softmax_triton``, ``ssa_triton``; ``softmax`` on CUDA) this
subclass calls megatron's forward with ``rotary_pos_emb=None`` and applies RoPE itself:

* **from the QKV buffer** (the usual case): ``get_query_key_value_tensors`` is overridden for
  the duration of that forward to run megatron's projection (``split_qkv=False``: the
  ``mixed_qkv`` view and nothing else) and ``nemo_ssa.ops.rope.rope_layout_qkv_triton``, one
  Triton pass that reads q, k, v from ``mixed_qkv``, rotates q and k and writes contiguous
  [b, h, s, d]; they go on as [s, b, h, d] views of that, which the core attention permutes
  back without a copy. Backward the same kernel writes dq, dk and dv into one buffer laid
  out as ``mixed_qkv``: no split, reshape copy or concatenation runs, forward or backward.
* **in the core attention**, where something sits between the split and RoPE or megatron's
  split does more than a split (q/k layer norm, megatron's test mode, an attention output
  gate, tensor parallel wider than the query groups, QKV activation offloading): megatron
  splits as usual, the rotary tensor is stashed on the core attention, which runs
  ``rope_layout_triton`` on the [s, b, h, d] views (RoPE + layout still one pass). Logged
  once per reason.

Everything else (QKV projection, output projection, inference/KV cache code) is megatron's own.

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
from megatron.core.transformer.identity_op import IdentityOp

from nemo_ssa.megatron.compat import yarn_concentration_factor
from nemo_ssa.ops.rope import rope_layout_qkv_triton

logger = logging.getLogger("nemo_ssa.megatron.self_attention")
_LOGGED: set = set()


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning("fused RoPE + layout not used (%s): megatron's RoPE and layout copies run instead", reason)


def _log_split_once(reason: str) -> None:
    key = ("split", reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning("q, k, v not read from the QKV buffer (%s): megatron's split and its copies run, RoPE + "
                       "layout is fused in the core attention", reason)


def _is_identity(norm) -> bool:
    return norm is None or isinstance(norm, IdentityOp)


class FusedRopeSelfAttention(SelfAttention):
    """SelfAttention that applies RoPE fused with the q/k/v layout pass, reading q, k, v
    straight from the QKV projection's output where it can."""

    #: (freqs_q, freqs_k, mscale) while a forward reads q, k, v from the QKV buffer (set
    #: around megatron's forward, read by get_query_key_value_tensors)
    _qkv_rope = None

    #: False: always megatron's split (the core attention's fused pass on its views); the
    #: control of benchmarks/bench_qkv_buffer.py, which sets it per instance between steps
    read_qkv_buffer = True

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

    def _qkv_buffer_fallback_reason(self, key_value_states) -> Optional[str]:
        """Why q, k, v cannot come straight from ``mixed_qkv`` (None: they can): megatron's
        split with ``split_qkv=False`` returns the buffer before these are applied."""
        cfg = self.config
        if not self.read_qkv_buffer:
            return "read_qkv_buffer=False"
        if key_value_states is not None:
            return "key_value_states given"
        if not (_is_identity(self.q_layernorm) and _is_identity(self.k_layernorm)):
            return "q/k layer norm between the split and RoPE"
        if getattr(cfg, "test_mode", False):
            return "megatron test_mode (its checks run in the split)"
        if getattr(cfg, "attention_output_gate", False):
            return "attention output gate"
        if cfg.num_query_groups < getattr(self, "world_size", 1):
            return "tensor parallel wider than the query groups (megatron gathers and slices the QKV output)"
        if getattr(self, "offload_qkv_linear", False):
            return "QKV activation offloading"
        return None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *, split_qkv=True,
                                    output_gate=False):
        """Megatron's, except inside a forward that reads q, k, v from the QKV buffer: then q, k,
        v are [s, b, h, d] views of the contiguous [b, h, s, d] tensors ``rope_layout_qkv_triton``
        writes (RoPE applied) -- one autograd node of ``mixed_qkv``, no split.

        The keywords are megatron's: 0.15 passes ``split_qkv``, 0.16+ also ``output_gate``
        (tests/megatron/test_contracts.py reads the calls from each version's source)."""
        rope = self._qkv_rope
        if rope is None:
            extra = {"output_gate": output_gate} if output_gate else {}  # 0.15 has no output_gate
            return super().get_query_key_value_tensors(hidden_states, key_value_states, split_qkv=split_qkv,
                                                       **extra)
        if key_value_states is not None or not split_qkv or output_gate:
            raise RuntimeError("FusedRopeSelfAttention: the QKV-buffer path was asked for key_value_states, "
                               "split_qkv=False or an output gate; _qkv_buffer_fallback_reason must refuse those")
        # every version: the projection's output viewed [s, b, ng, (np/ng + 2) * hn], returned
        # before the split (test_contracts pins this per version)
        mixed_qkv, _ = super().get_query_key_value_tensors(hidden_states, None, split_qkv=False)
        per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        q, k, v = rope_layout_qkv_triton(mixed_qkv, per_group, *rope)
        return tuple(t.permute(2, 0, 1, 3) for t in (q, k, v))

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
        rope = (freqs_q, freqs_k, yarn_concentration_factor(self.config))
        split_reason = self._qkv_buffer_fallback_reason(key_value_states)
        if split_reason is None:
            self._qkv_rope = rope
            try:
                return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
            finally:
                self._qkv_rope = None
        _log_split_once(split_reason)
        core = self.core_attention
        core._pending_rope = rope
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
        finally:
            core._pending_rope = None
