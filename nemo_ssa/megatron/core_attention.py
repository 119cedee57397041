"""Core attentions for megatron-core's transformer layer spec.

This is the only place that knows Megatron's attention layout. Each class follows the
megatron-core 0.15 core-attention contract exactly (the one ``DotProductAttention``
implements):

    __init__(config, layer_number, attn_mask_type, attention_type,
             attention_dropout=None, softmax_scale=None, cp_comm_type=None,
             pg_collection=None, **options)
    forward(query [sq, b, np, hn], key/value [sk, b, ng, hn] (NOT expanded for GQA),
            attention_mask, attn_mask_type=None, attention_bias=None,
            packed_seq_params=None) -> [sq, b, np * hn]

RoPE is applied to q/k by ``SelfAttention`` -- except under ``FusedRopeSelfAttention``
(nemo_ssa/megatron/self_attention.py, the spec's default for softmax_triton/ssa_triton),
which applies it fused with the [s, b, h, d] -> contiguous [b, h, s, d] layout in one Triton
pass (nemo_ssa/ops/rope): usually itself, reading the QKV buffer (q, k, v then arrive here as
views of contiguous [b, h, s, d], and the permute below gives that back without a copy), or,
where megatron's split must run, here, from the rotary tensor it hands over. Otherwise
tensors are viewed as [b, h, s, d] (no copy; ``force_contiguous_qkv`` copies) and handed
to ``nemo_ssa.ops`` — the op layer never sees Megatron layouts. An op that takes ``out=``
writes megatron's [sq, b, h*d] output in place (no copy back).

Supported: self attention, mask types ``causal`` and ``no_mask`` (plus ``padding`` /
``arbitrary`` / ``padding_causal`` with an explicit mask), GQA, attention dropout under
Megatron's RNG tracker, tensor parallel (with or without sequence parallel) for every
attention — SSA's ``n``/``b`` gradients summed over the TP group so they stay identical
on every TP rank — and context parallel (megatron's load-balanced 2·CP-chunk split,
``causal``/``no_mask``), both in ``nemo_ssa/megatron/parallel.py``. Unsupported inputs
raise ``NotImplementedError`` naming the option — at construction where the config
already tells (context parallel with a mask type other than causal/no_mask, cross
attention, unknown mask types), at the first forward otherwise (packed THD sequences,
attention bias), since those only arrive with a batch.

For causal mask types the ``attention_mask`` tensor is not read: causality is applied
inside the op (bottom-right aligned), exactly like megatron's fused upper-triangular
softmax. Document-level masks therefore need ``padding_causal``/``arbitrary``.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from nemo_ssa.config.attentions import ATTENTIONS
from nemo_ssa.megatron.parallel import (
    cp_group_of,
    gather_sequence_chunks,
    group_rank,
    group_size,
    local_chunk_ids,
    replicate_over_tp,
    tp_group_of,
)
from nemo_ssa.ops.registry import get_attention_fn
from nemo_ssa.ops.rope import rope_layout_triton

_CAUSAL_TYPES = (AttnMaskType.causal,)
_MASKED_TYPES = (AttnMaskType.padding, AttnMaskType.arbitrary, AttnMaskType.padding_causal)
_SUPPORTED_MASK_TYPES = _CAUSAL_TYPES + (AttnMaskType.no_mask,) + _MASKED_TYPES
#: mask types under context parallel > 1 (a mask tensor would have to be sliced like the
#: load-balanced chunks; causal/no_mask need none)
_CP_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)


def _accepts_out(fn) -> bool:
    """Whether an attention op takes ``out=`` (a preallocated [B, H, Sq, D] tensor, any strides)."""
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _tp_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1


class _Row:
    """A class attribute read from the class's row of the attention table: the row whose
    ``module`` names the class (``ATTENTIONS[...].module``), else ``default``."""

    def __init__(self, get, default):
        self.get, self.default = get, default

    def __get__(self, obj, cls):
        row = _ROWS.get(f"{cls.__module__}:{cls.__qualname__}")
        return self.default if row is None else self.get(row)


_ROWS = {info.module: info for info in ATTENTIONS.values() if info.family != "nsa"}


class _TransformedSoftmaxAttention(MegatronModule):
    """Shared contract handling; subclasses choose the op (transform x implementation)."""

    # what the attention table declares (nemo_ssa/config/attentions.py) is read from the
    # class's row when asked (``_Row``), not copied onto the classes: the table stays the one
    # declaration. The base class and classes without a row read the defaults.
    #: name used in configs (``attention=<name>``)
    attention_name: str = _Row(lambda r: r.name, "")
    #: (variant, impl) key into nemo_ssa.ops.registry
    op_key: tuple = _Row(lambda r: tuple(r.op_key), ())
    #: registry key of a packed (THD, cu_seqlens) variant, if the implementation has one
    varlen_op_key: tuple = _Row(lambda r: tuple(r.varlen_op_key), ())
    #: mask types the op can apply (None = every type in _SUPPORTED_MASK_TYPES)
    supported_mask_types: Optional[tuple] = None
    supports_tensor_parallel: bool = True
    #: context parallel > 1 (parallel.py): every op here implements bottom-right-aligned
    #: causality for Sq != Sk, which is all the all-gathered-K/V schedule needs
    supports_context_parallel: bool = True
    supports_dropout: bool = True
    #: (min, max) head dim the op supports; None = any
    supported_head_dims: Optional[tuple] = _Row(lambda r: r.head_dims, None)
    #: RoPE + layout fused into one Triton pass (nemo_ssa/ops/rope), driven by
    #: ``FusedRopeSelfAttention`` (nemo_ssa/megatron/self_attention.py); the fused GPU kernels
    supports_fused_rope_layout: bool = _Row(lambda r: "fused_rope_layout" in r.kernel_options, False)
    #: takes ``deterministic=`` (its table row offers the option); unset, from megatron's
    #: ``deterministic_mode``
    supports_deterministic: bool = _Row(lambda r: "deterministic" in r.kernel_options, False)
    #: ``fused_rope_layout=None`` turns it on only where a CUDA device exists (softmax: on CPU
    #: the CPU loop keeps megatron's RoPE, so its golden curves stay bit-for-bit)
    fused_rope_layout_needs_cuda: bool = False

    @classmethod
    def default_fused_rope_layout(cls) -> bool:
        """What ``fused_rope_layout=None`` means for this attention."""
        return cls.supports_fused_rope_layout and (not cls.fused_rope_layout_needs_cuda
                                                    or torch.cuda.is_available())

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        force_contiguous_qkv: bool = True,
        kernel_options: Optional[dict] = None,
        fused_rope_layout: Optional[bool] = None,
    ):
        super().__init__(config=config)
        name = self.attention_name
        self.kernel_options = dict(kernel_options or {})
        if self.supports_deterministic and self.kernel_options.get("deterministic") is None:
            # the attention option unset: megatron's deterministic mode decides (what
            # TransformerConfig.deterministic_mode asks of every kernel)
            self.kernel_options["deterministic"] = bool(getattr(config, "deterministic_mode", False))
        if attention_type != "self":
            raise NotImplementedError(
                f"attention={name}: attention_type={attention_type!r} is not supported "
                "(supported: 'self')."
            )
        if attn_mask_type not in _SUPPORTED_MASK_TYPES:
            raise NotImplementedError(
                f"attention={name}: attn_mask_type={attn_mask_type} is not supported "
                f"(supported: {', '.join(t.name for t in _SUPPORTED_MASK_TYPES)})."
            )
        if self.supported_mask_types is not None and attn_mask_type not in self.supported_mask_types:
            raise NotImplementedError(
                f"attention={name}: attn_mask_type={attn_mask_type} is not supported by this kernel "
                f"(supported: {', '.join(t.name for t in self.supported_mask_types)}); arbitrary/padding "
                "masks need attention=ssa_reference (or softmax)."
            )
        self._init_parallel(config, attn_mask_type, pg_collection)
        tp = _tp_size(pg_collection)
        if tp != 1 and not self.supports_tensor_parallel:
            raise NotImplementedError(
                f"attention={name}: tensor_model_parallel_size={tp} is not supported yet "
                "(supported: 1). Each rank holds different heads, so the gradient of the "
                "per-layer SSA parameters would silently diverge across ranks."
            )
        if config.num_attention_heads % config.num_query_groups:
            raise ValueError(
                f"attention={name}: num_attention_heads={config.num_attention_heads} must be "
                f"a multiple of num_query_groups={config.num_query_groups}."
            )

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.force_contiguous_qkv = bool(force_contiguous_qkv)
        self.num_heads_per_partition = config.num_attention_heads // tp
        self.num_groups_per_partition = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        if self.supported_head_dims is not None:
            lo, hi = self.supported_head_dims
            if not lo <= self.head_dim <= hi:
                raise NotImplementedError(
                    f"attention={name}: head dim {self.head_dim} (kv_channels) is not supported by this "
                    f"kernel (supported: {lo} <= head dim <= {hi}); use attention=ssa_reference / softmax."
                )

        # Megatron's scaling rules (DotProductAttention): default 1/sqrt(hn), or the given
        # softmax_scale. apply_query_key_layer_scaling divides the QK^T scale by the layer
        # number and multiplies the softmax input back by it (FusedScaleMaskSoftmax's
        # ``scale``): the math is unchanged, only fp16 overflow in the matmul is avoided.
        # Our scores are formed in fp32, so the net scale is used directly.
        self.softmax_scale = (
            1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        )
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        if self.dropout_p > 0.0 and not self.supports_dropout:
            raise NotImplementedError(
                f"attention={name}: attention_dropout={self.dropout_p} is not supported by this kernel "
                "(supported: 0.0). Set attention_dropout=0.0, or use softmax / ssa_reference / ssa_triton."
            )
        self._attend = get_attention_fn(*self.op_key)
        self._attend_varlen = get_attention_fn(*self.varlen_op_key) if self.varlen_op_key else None
        #: the op writes its [B, H, Sq, D] output into a given (strided) tensor: then the
        #: [sq, b, h*d] output is written in place, without the copy back
        self._op_takes_out = _accepts_out(self._attend)
        if fused_rope_layout and not self.supports_fused_rope_layout:
            raise NotImplementedError(
                f"attention={name}: fused_rope_layout=True is not supported (supported by: softmax, "
                "softmax_triton, ssa_triton)."
            )
        self.fused_rope_layout = (self.default_fused_rope_layout() if fused_rope_layout is None
                                  else bool(fused_rope_layout))
        #: (freqs_q, freqs_k, mscale) set by FusedRopeSelfAttention for the duration of one
        #: forward: RoPE is then applied here, fused with the layout pass
        self._pending_rope = None

    # -- op call ------------------------------------------------------------------------
    def _call_op(self, q, k, v, *, causal, keep_mask, dropout_p, **out):  # pragma: no cover
        raise NotImplementedError

    def _op_args(self) -> tuple:
        """Leading tensor arguments of the op after q, k, v (SSA: n, b)."""
        return ()

    def _forward_packed(self, query, key, value, attn_mask_type, attention_bias, packed_seq_params):
        """THD: ``[t, (1,) h, d]`` with cu_seqlens -> ``[t, (1,) h*d]`` through the varlen op."""
        name = self.attention_name
        if attention_bias is not None:
            raise NotImplementedError(f"attention={name}: attention_bias is not supported.")
        if self.cp_size > 1:
            raise NotImplementedError(f"attention={name}: packed (THD) sequences are not supported with "
                                      f"context_parallel_size={self.cp_size} (supported: the [s, b, h, d] layout).")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        squeeze = query.dim() == 4
        if squeeze:
            if query.shape[1] != 1:
                raise ValueError(f"attention={name}: packed sequences need batch dim 1, got {tuple(query.shape)}")
            query, key, value = query[:, 0], key[:, 0], value[:, 0]
        p = packed_seq_params
        cu_q = p.cu_seqlens_q_padded if getattr(p, "cu_seqlens_q_padded", None) is not None else p.cu_seqlens_q
        cu_k = p.cu_seqlens_kv_padded if getattr(p, "cu_seqlens_kv_padded", None) is not None else p.cu_seqlens_kv
        if self.force_contiguous_qkv:
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        dropout_p = self.dropout_p if self.training else 0.0

        def run():
            return self._attend_varlen(query, key, value, *self._op_args(), cu_q, cu_k, int(p.max_seqlen_q),
                                       int(p.max_seqlen_kv), causal=causal, softmax_scale=self.softmax_scale,
                                       dropout_p=dropout_p)

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = run()
        else:
            out = run()
        out = out.reshape(out.shape[0], -1)
        return out.unsqueeze(1) if squeeze else out

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        name = self.attention_name
        rope, self._pending_rope = self._pending_rope, None
        if rope is not None and (packed_seq_params is not None or self.cp_size > 1):
            # FusedRopeSelfAttention falls back to megatron's RoPE before this can happen
            raise RuntimeError(f"attention={name}: fused RoPE + layout was handed a packed / context-parallel "
                               "batch (supported: [s, b, h, d] on one CP rank); megatron's RoPE path must be used.")
        if packed_seq_params is not None and self.varlen_op_key:
            return self._forward_packed(query, key, value, attn_mask_type, attention_bias, packed_seq_params)
        if packed_seq_params is not None:
            raise NotImplementedError(
                f"attention={name}: packed (THD) sequences are not supported yet "
                "(supported: the [s, b, h, d] layout). Disable sequence packing."
            )
        if attention_bias is not None:
            raise NotImplementedError(f"attention={name}: attention_bias is not supported.")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if self.cp_size > 1:
            return self._forward_context_parallel(query, key, value, mask_type)
        keep_mask = None
        if mask_type in _MASKED_TYPES:
            if attention_mask is None:
                raise ValueError(f"attention={name}: attn_mask_type={mask_type.name} needs an attention_mask")
            keep_mask = ~attention_mask.bool()  # megatron: True = masked out

        sq, b = query.shape[0], query.shape[1]
        if rope is not None:
            # FusedRopeSelfAttention handed us megatron's RoPE (its split had to run): one Triton
            # pass reads the [s, b, h, d] views (any strides), rotates q/k and writes contiguous
            # [b, h, s, d] -- seed 000's contiguous-q/k/v rule met without separate copies.
            q, k, v = rope_layout_triton(query, key, value, *rope)
        else:
            # [s, b, h, d] -> [b, h, s, d]: views, no copy (and contiguous already where
            # FusedRopeSelfAttention read them from the QKV buffer: .contiguous() is then free)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if self.force_contiguous_qkv:
                # Seed 000: materialising q/k/v removed the strided-layout instabilities of
                # the fused kernels; the reference does the same so both see identical inputs.
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

        extra = {}
        if self._op_takes_out and not torch.compiler.is_compiling():
            # the op writes straight into megatron's [sq, b, h*d] output (a [B, H, Sq, D] view);
            # traced, the custom op returns a fresh tensor and out= would only add a copy
            buf = torch.empty((sq, b, q.shape[1] * q.shape[3]), dtype=q.dtype, device=q.device)
            extra["out"] = buf.view(sq, b, q.shape[1], q.shape[3]).permute(1, 2, 0, 3)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._call_op(q, k, v, causal=causal, keep_mask=keep_mask, dropout_p=dropout_p, **extra)
        else:
            out = self._call_op(q, k, v, causal=causal, keep_mask=keep_mask, dropout_p=dropout_p, **extra)
        # [b, h, sq, d] -> [sq, b, h*d]: free (a view) when the op wrote into ``out``
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    # -- tensor / context parallel (nemo_ssa/megatron/parallel.py) -------------------------
    def _init_parallel(self, config, attn_mask_type, pg_collection) -> None:
        """TP/CP groups; refuse what context parallel cannot do (one line naming the supported)."""
        name = self.attention_name
        self.tp_group = tp_group_of(pg_collection)
        self.cp_group = cp_group_of(pg_collection)
        self.cp_size = int(config.context_parallel_size)
        if self.cp_size == 1:
            return
        if not self.supports_context_parallel:
            raise NotImplementedError(
                f"attention={name}: context_parallel_size={self.cp_size} is not supported by this attention "
                "(supported: 1; context parallel runs softmax, softmax_triton, ssa_reference, ssa_triton, "
                "ssa_flex, elsa, elsa_ssa)."
            )
        if attn_mask_type not in _CP_MASK_TYPES:
            raise NotImplementedError(
                f"attention={name}: attn_mask_type={attn_mask_type.name} is not supported with "
                f"context_parallel_size={self.cp_size} (supported: causal, no_mask)."
            )
        if group_size(self.cp_group) != self.cp_size:
            raise ValueError(
                f"attention={name}: context_parallel_size={self.cp_size} but the context-parallel process "
                f"group has {group_size(self.cp_group)} rank(s); initialise megatron's parallel state "
                "(or pass pg_collection) with the same size."
            )

    def _forward_context_parallel(self, query, key, value, mask_type) -> Tensor:
        """Local q chunks vs the all-gathered K/V (parallel.py): two op calls per layer.

        ``query`` [2c, b, hq, d] holds chunks (r, 2cp-1-r) of the sequence; K/V are
        gathered to [S, b, hkv, d] in sequence order, and query chunk i attends the key
        prefix [0, (i+1)c) bottom-right-causally (or every key for no_mask).
        """
        name = self.attention_name
        if mask_type not in _CP_MASK_TYPES:
            raise NotImplementedError(f"attention={name}: attn_mask_type={mask_type.name} is not supported with "
                                      f"context parallel (supported: causal, no_mask).")
        causal = mask_type == AttnMaskType.causal
        two_c, b = query.shape[0], query.shape[1]
        c = two_c // 2
        key_all = gather_sequence_chunks(key, self.cp_group)
        value_all = gather_sequence_chunks(value, self.cp_group)
        dropout_p = self.dropout_p if self.training else 0.0
        outs = []
        for half, chunk in enumerate(local_chunk_ids(group_rank(self.cp_group), self.cp_size)):
            end = (chunk + 1) * c if causal else key_all.shape[0]
            # [s, b, h, d] -> [b, h, s, d]; contiguous like the single-rank path (seed 000)
            q, k, v = (t.permute(1, 2, 0, 3).contiguous()
                       for t in (query[half * c:(half + 1) * c], key_all[:end], value_all[:end]))
            if dropout_p > 0.0 and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    o = self._call_op(q, k, v, causal=causal, keep_mask=None, dropout_p=dropout_p)
            else:
                o = self._call_op(q, k, v, causal=causal, keep_mask=None, dropout_p=dropout_p)
            outs.append(o.permute(2, 0, 1, 3).reshape(c, b, -1))
        return torch.cat(outs, dim=0)


class SoftmaxCoreAttention(_TransformedSoftmaxAttention):
    """``attention=softmax``: the baseline, torch SDPA (flash / cuDNN on GPU)."""

    # RoPE + layout in one Triton pass, then SDPA on the contiguous [b, h, s, d] it writes
    # (megatron's RoPE is several elementwise launches per tensor plus the layout copies)
    fused_rope_layout_needs_cuda = True

    def _call_op(self, q, k, v, *, causal, keep_mask, dropout_p, **out):
        return self._attend(
            q, k, v, causal=causal, softmax_scale=self.softmax_scale,
            keep_mask=keep_mask, dropout_p=dropout_p, **self.kernel_options, **out,
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


class SSAScalars:
    """The per-layer SSA scalars ``n`` and ``b`` and their dtype rules (a mixin).

    Shared by every module that applies the SSA transform -- the SSA core attentions
    below and ``NSASelfAttention(transform="ssa")`` (``attention=nsa_ssa``) -- so all of
    them store, cast, checkpoint, log and exempt from weight decay the same two tensors.
    Mix in before the ``torch.nn.Module`` base and call :meth:`_init_ssa_scalars` from
    ``__init__``.

    ``n`` is a per-layer learnable parameter of shape [1] (a 0-d parameter would fall into
    Megatron's weight-decay rule, which exempts only 1-d tensors, and breaks
    FlexAttention's compiler); ``b`` is a persistent buffer, or a [1] parameter with
    ``learnable_b``. Both are named ``n`` / ``b`` in every SSA implementation so a
    checkpoint written by one resumes under another.

    Precision: n and b are stored in fp32 whatever the model's dtype, and stay exact when
    Megatron casts the model to bf16/fp16 (``_apply`` below): bf16 would turn b=0.8 into
    0.80078125 and move a learnable n only in steps of 2^-7 near 1.5 (1.5078125,
    1.4921875, ... -- what the first bf16 GPU runs logged). A learnable n (and b with
    ``learnable_b``) is then an fp32 parameter inside a half-precision model: megatron
    keeps it in its own fp32 DDP buffer and optimizer group (no master copy needed), and
    ``nemo_ssa/megatron/optimizer_fixes.py`` fixes megatron-core 0.15.3's
    ``Float16OptimizerWithFloat16Params.sharded_state_dict``, which could not checkpoint
    such a parameter ("Optimizer shape (1,) does not match model shape (768,)", H200,
    docs/results/2026-11-22-gpu-proof.md). The transform is always evaluated in fp32.
    Tensor parallel: every TP rank holds n whole; its gradient is summed over the TP
    group (``_op_args``), so n stays identical on every rank.
    """

    _ssa_fp32_names = ("n", "b")

    def _init_ssa_scalars(self, attention_name: str, n_init: float, b_init: float,
                          learnable_n: bool, learnable_b: bool, n_min: Optional[float] = None) -> None:
        if not b_init > 0:
            raise ValueError(f"attention={attention_name}: b must be > 0, got {b_init}")
        if n_min is not None and not (math.isfinite(float(n_min)) and float(n_init) >= float(n_min)):
            raise ValueError(f"attention={attention_name}: n_min must be finite and at most the initial n; "
                             f"got n_min={n_min}, n={n_init}")
        # a learnable n is projected onto [n_min, inf) before each use (_project_n); a fixed
        # n only has to start there
        self._n_min = float(n_min) if n_min is not None and learnable_n else None
        n = torch.full((1,), float(n_init), dtype=torch.float32)
        b = torch.full((1,), float(b_init), dtype=torch.float32)
        if learnable_n:
            self.n = torch.nn.Parameter(n)
        else:
            self.register_buffer("n", n, persistent=True)
        if learnable_b:
            self.b = torch.nn.Parameter(b)
        else:
            self.register_buffer("b", b, persistent=True)
        # Megatron's TP metadata: replicated, not sharded.
        for p in (self.n, self.b):
            if isinstance(p, torch.nn.Parameter):
                setattr(p, "sequence_parallel", False)
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)

    def _project_n(self) -> None:
        """Projected gradient descent for ``n >= n_min``: n moves only in the optimizer step,
        so clamping it before the step's first use is the projection after the previous
        step. On ``.data``: autograd neither records it nor counts it as an in-place change
        of a tensor an earlier micro-batch saved (the value only moves at the first forward
        after a step, before any micro-batch of that step saved it). Identical on every
        rank (n is replicated), one tiny kernel per layer, and only with ``n_min``."""
        if getattr(self, "_n_min", None) is not None:
            self.n.data.clamp_(min=self._n_min)

    def _apply(self, fn, recurse=True):
        # Keep n and b fp32 and exact through Megatron's bf16/fp16 cast (Float16Module
        # calls module.bfloat16()); device moves still apply. The Parameter objects stay
        # the same (only .data changes), so optimizers and DDP hooks keep working.
        saved = {}
        for name in self._ssa_fp32_names:
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                saved[name] = t.data.clone()
        super()._apply(fn, recurse)
        for name, value in saved.items():
            t = getattr(self, name)
            if t.dtype != torch.float32 or not torch.equal(t.data.float().cpu(), value.float().cpu()):
                t.data = value.to(device=t.device, dtype=torch.float32)
        return self


class SSACoreAttention(SSAScalars, _TransformedSoftmaxAttention):
    """SSA (scaled signed averaging) attention, base class of every SSA implementation.

    z = n·sgn(s)·log1p(b·|s|) replaces the scores s before the row softmax. ``n`` and
    ``b`` (shapes, names, dtypes, checkpointing) follow :class:`SSAScalars`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        force_contiguous_qkv: bool = True,
        n_init: float = 1.5,
        b_init: float = 0.8,
        learnable_n: bool = True,
        learnable_b: bool = False,
        kernel_options: Optional[dict] = None,
        fused_rope_layout: Optional[bool] = None,
        n_min: Optional[float] = None,
    ):
        super().__init__(
            config, layer_number, attn_mask_type, attention_type, attention_dropout,
            softmax_scale, cp_comm_type, pg_collection, force_contiguous_qkv, kernel_options,
            fused_rope_layout,
        )
        self._init_ssa_scalars(self.attention_name, n_init, b_init, learnable_n, learnable_b, n_min)

    def _call_op(self, q, k, v, *, causal, keep_mask, dropout_p, **out):
        n, b = self._op_args()
        return self._attend(
            q, k, v, n, b, causal=causal, softmax_scale=self.softmax_scale,
            keep_mask=keep_mask, dropout_p=dropout_p, **self.kernel_options, **out,
        )

    def _op_args(self) -> tuple:
        # TP: each rank sees its own heads, so d(loss)/dn here is a partial sum; the
        # identity-forward / all-reduce-backward copy makes it the full sum on every TP
        # rank (n stays identical). No-op with one TP rank.
        self._project_n()
        return replicate_over_tp(self.n, self.tp_group), replicate_over_tp(self.b, self.tp_group)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {}, sharded_offsets)


class SSAReferenceCoreAttention(SSACoreAttention):
    """``attention=ssa_reference``: unfused torch SSA, fp32 scores/softmax — the anchor."""


_TRITON_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)


class SSATritonCoreAttention(SSACoreAttention):
    """``attention=ssa_triton``: the fused Triton SSA kernel (nemo_ssa/ops/attention/flash.py).

    Same parameters and checkpoint names as ``ssa_reference`` (a checkpoint of one resumes
    under the other). Causal / no-mask only (the kernel applies causality itself; there is
    no arbitrary mask input); packed THD batches go through the varlen kernel.
    """

    supported_mask_types = _TRITON_MASK_TYPES


class SoftmaxTritonCoreAttention(SoftmaxCoreAttention):
    """``attention=softmax_triton``: the same fused kernel with the identity transform."""

    supported_mask_types = _TRITON_MASK_TYPES
    fused_rope_layout_needs_cuda = False


class SSAFlexCoreAttention(SSACoreAttention):
    """``attention=ssa_flex``: SSA through FlexAttention (nemo_ssa/ops/attention/flex.py).

    Every mask type (masks become a mask_mod); n and b stay tensors; dn/db come from a
    separate deterministic pass. No dropout (FlexAttention has none).
    """

    supports_dropout = False


class ElsaCoreAttention(SoftmaxCoreAttention):
    """``attention=elsa`` (experimental): exact softmax attention as a two-pass scan."""

    supported_mask_types = _TRITON_MASK_TYPES
    supports_dropout = False


class ElsaSSACoreAttention(SSACoreAttention):
    """``attention=elsa_ssa`` (experimental): the ELSA scan with the SSA transform."""

    supported_mask_types = _TRITON_MASK_TYPES
    supports_dropout = False


