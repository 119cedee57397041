"""Native Sparse Attention as megatron-core's *self-attention* submodule.

NSA changes more than the core attention: every branch may have its own K/V
projection (the paper's choice), the gates come from the layer's input hidden states, and
the compressed branch has learnable compression MLPs. So this module takes the place of
``SelfAttention`` in a ``TransformerLayer`` spec (``submodules.self_attention``), with
the same constructor keywords and forward signature, and calls ``nemo_ssa.ops.nsa``
through the ops registry (the attention table's ``op_key`` for nsa / nsa_ssa).

    hidden [s, b, h] --linear_qkv--> q [s,b,Hq,D], (k, v) per branch [s,b,Hkv,D]
                     --linear_gate--> gate logits [s,b,Hq,3]
    RoPE on q and every k (keys are compressed *after* RoPE: a compressed key then
    carries its block's positions, and the mean-pooling residual of φ keeps that
    meaningful at initialisation)
    nsa_attention(q, k_cmp, v_cmp, gates, k_slc=..., ..., phi_k, phi_v) [b,Hq,s,D]
    --linear_proj--> [s, b, h]  (+ bias returned separately, like SelfAttention)

``transform="ssa"`` (``attention=nsa_ssa``) applies the SSA score transform inside
every branch (compressed, selection scores, selected, window) through the same kernels;
its per-layer ``n`` / ``b`` are the SSA core attentions' (``core_attention.SSAScalars``:
learnable ``n`` following the model dtype, fixed ``b`` an exact fp32 buffer, the same
names, checkpointing, logging and weight-decay exemption), stored on this module
(``...self_attention.n``) since there is no separate core attention.

Supported: causal self attention, GQA, tensor/context parallel 1, the [s, b, h] layout,
training and full-sequence evaluation. Unsupported (NotImplementedError naming the
option, at construction where the config tells, else at the first forward): TP/CP > 1,
attention dropout > 0, packed THD sequences, KV-cache inference, attention bias,
mask types other than causal, ``force_contiguous_qkv=False`` (q/k/v are always
materialised as [b, h, s, d]).

``nsa_self_attention_spec(...)`` builds the ModuleSpec and
``nsa_layer_spec_submodules(...)`` a whole ``TransformerLayerSubmodules``;
``spec.layer_spec`` uses the former for ``attention=nsa`` / ``nsa_ssa``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_ssa.config.attentions import attention_for_module
from nemo_ssa.megatron.compat import accepted_kwargs, yarn_concentration_factor
from nemo_ssa.megatron.core_attention import SSAScalars
from nemo_ssa.ops.nsa import NSAConfig, PhiParams
from nemo_ssa.ops.registry import get_attention_fn

__all__ = [
    "NSASelfAttention",
    "NSASelfAttentionSubmodules",
    "NSACompression",
    "nsa_self_attention_spec",
    "nsa_layer_spec_submodules",
]


@dataclass
class NSASelfAttentionSubmodules:
    """Linear layers of :class:`NSASelfAttention` (megatron's local ones by default)."""

    linear_qkv: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_gate: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear


class NSACompression(torch.nn.Module):
    """One compression MLP φ (see ``nemo_ssa.ops.nsa.naive.PhiParams``), shared by kv heads.

    ``w2``/``b2`` start at zero, so φ starts as mean pooling plus nothing and learns the
    rest; ``pe`` and ``w1`` get small random values so their gradients are non-zero as
    soon as ``w2`` moves.
    """

    def __init__(self, block_len: int, head_dim: int, hidden: int, init_method, dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.pe = torch.nn.Parameter(torch.empty(block_len, head_dim, **kw))
        self.w1 = torch.nn.Parameter(torch.empty(block_len * head_dim, hidden, **kw))
        self.b1 = torch.nn.Parameter(torch.zeros(hidden, **kw))
        self.w2 = torch.nn.Parameter(torch.zeros(hidden, head_dim, **kw))
        self.b2 = torch.nn.Parameter(torch.zeros(head_dim, **kw))
        with torch.no_grad():
            init_method(self.pe)
            self.w1.normal_(0.0, 1.0 / math.sqrt(block_len * head_dim))

    def params(self) -> PhiParams:
        return PhiParams(self.pe, self.w1, self.b1, self.w2, self.b2)


def _nsa_config(nsa: Union[None, NSAConfig, Dict[str, Any]]) -> NSAConfig:
    if nsa is None:
        return NSAConfig()
    if isinstance(nsa, NSAConfig):
        return nsa
    if isinstance(nsa, dict):
        unknown = set(nsa) - set(NSAConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown NSA options {sorted(unknown)}; supported: {sorted(NSAConfig.__dataclass_fields__)}")
        return NSAConfig(**nsa)
    raise ValueError(f"nsa must be an NSAConfig, a dict of its fields or None, got {type(nsa).__name__}")


def _child(name: Optional[str], child: str) -> Optional[str]:
    return None if name is None else f"{name}.{child}"


def _table_row(transform: str):
    """The attention table's row this module implements with ``transform`` (nsa / nsa_ssa)."""
    return attention_for_module(f"{__name__}:NSASelfAttention", transform)


class NSASelfAttention(SSAScalars, MegatronModule):
    """NSA self attention; drop-in for megatron's ``SelfAttention`` in a layer spec.

    Args (beyond megatron's ``config, submodules, layer_number, attn_mask_type,
    cp_comm_type, pg_collection``; ``pp_layer_offset`` (megatron-core 0.17+) only places a
    layer's KV cache in inference, which NSA refuses, and ``name`` (0.18+) names the
    module and its linear layers, as in megatron's ``SelfAttention``):
        nsa: :class:`NSAConfig` or a dict of its fields (block sizes, top-n, window,
            compress ``mlp|mean``, separate_kv).
        impl: ``nemo_ssa.ops.nsa.nsa_attention``'s ``impl`` (``auto``: Triton on CUDA).
        transform: ``softmax`` (``attention=nsa``) or ``ssa`` (``attention=nsa_ssa``: the
            SSA score transform in every branch).
        n_init, b_init, learnable_n, learnable_b, n_min: the SSA scalars, exactly as the SSA
            core attentions take them (:class:`~nemo_ssa.megatron.core_attention.SSAScalars`;
            the policy pins n=1.5 learnable, b=0.8 fixed). ``transform="ssa"`` only:
            ``transform="softmax"`` has no ``n`` / ``b`` (both ``None``).
        force_contiguous_qkv: accepted for the SSA options' sake; must be true (q/k/v
            are always made contiguous here).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[NSASelfAttentionSubmodules] = None,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        pp_layer_offset: Optional[int] = None,
        name: Optional[str] = None,
        nsa: Union[None, NSAConfig, Dict[str, Any]] = None,
        impl: Union[str, Dict[str, str]] = "auto",
        transform: str = "softmax",
        n_init: float = 1.5,
        b_init: float = 0.8,
        learnable_n: bool = True,
        learnable_b: bool = False,
        force_contiguous_qkv: bool = True,
        n_min: Optional[float] = None,
    ):
        super().__init__(config=config)
        submodules = submodules or NSASelfAttentionSubmodules()
        self.nsa = _nsa_config(nsa)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self._pp_layer_offset = pp_layer_offset
        self.name = name
        self.impl = impl
        if transform not in ("softmax", "ssa"):
            raise ValueError(f"attention=nsa: transform must be one of ('softmax', 'ssa'), got {transform!r}")
        self.transform = transform
        # name and op from the attention table's row for this module and transform
        info = _table_row(transform)
        name = self.attention_name = info.name
        self._attend = get_attention_fn(*info.op_key)
        if not force_contiguous_qkv:
            raise NotImplementedError(
                f"attention={name}: force_contiguous_qkv=False is not supported (supported: true; "
                "q/k/v are always materialised as [b, h, s, d] for the NSA kernels)."
            )
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                f"attention={name}: attn_mask_type={attn_mask_type} is not supported (supported: causal)."
            )
        if config.context_parallel_size != 1:
            raise NotImplementedError(
                f"attention={name}: context_parallel_size={config.context_parallel_size} is not supported (supported: 1)."
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size() if getattr(pg_collection, "tp", None) is not None else 1
        if tp != 1:
            raise NotImplementedError(
                f"attention={name}: tensor_model_parallel_size={tp} is not supported yet (supported: 1)."
                + (" Each rank holds different heads, so the gradient of the per-layer SSA "
                   "parameters would silently diverge across ranks." if transform == "ssa" else "")
            )
        if float(config.attention_dropout or 0.0) > 0.0:
            raise NotImplementedError(
                f"attention={name}: attention_dropout={config.attention_dropout} is not supported "
                "(the NSA kernels have no dropout); set attention_dropout=0.0."
            )
        if config.num_attention_heads % config.num_query_groups:
            raise ValueError(
                f"attention={name}: num_attention_heads={config.num_attention_heads} must be a multiple of "
                f"num_query_groups={config.num_query_groups}."
            )
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if config.softmax_scale is None else float(config.softmax_scale)
        self.num_kv_sets = 3 if self.nsa.separate_kv else 1
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_groups * self.head_dim
        self.split_sizes = [q_size] + [kv_size] * (2 * self.num_kv_sets)

        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, sum(self.split_sizes),
            config=config, init_method=config.init_method, gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="qkv", tp_group=pg_collection.tp,
            **accepted_kwargs(submodules.linear_qkv, name=_child(name, "linear_qkv")),
        )
        # gate MLP: one linear layer + sigmoid (in the op), per head and branch; its own
        # bias so the gates can learn a per-branch preference whatever add_bias_linear says
        self.linear_gate = build_module(
            submodules.linear_gate, config.hidden_size, self.num_heads * 3,
            config=config, init_method=config.init_method, gather_output=False, bias=True,
            skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=pg_collection.tp,
            **accepted_kwargs(submodules.linear_gate, name=_child(name, "linear_gate")),
        )
        self.linear_proj = build_module(
            submodules.linear_proj, q_size, config.hidden_size,
            config=config, init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name="proj", tp_group=pg_collection.tp,
            **accepted_kwargs(submodules.linear_proj, name=_child(name, "linear_proj")),
        )
        if self.nsa.compress == "mlp":
            dev = torch.device("cpu") if config.use_cpu_initialization else None
            if dev is None and torch.cuda.is_available():
                dev = torch.device("cuda", torch.cuda.current_device())
            hidden = self.nsa.hidden(self.head_dim)
            self.phi_k = NSACompression(self.nsa.block_len, self.head_dim, hidden, config.init_method,
                                        config.params_dtype, dev)
            self.phi_v = NSACompression(self.nsa.block_len, self.head_dim, hidden, config.init_method,
                                        config.params_dtype, dev)
        else:
            self.phi_k = self.phi_v = None
        if transform == "ssa":
            # the SSA core attentions' n / b: shapes, names, dtype rules (SSAScalars)
            self._init_ssa_scalars(name, n_init, b_init, learnable_n, learnable_b, n_min)
        else:
            self.n = None
            self.b = None

    # ------------------------------------------------------------------------ forward
    def _rope(self, t: Tensor, freqs) -> Tensor:
        if freqs is None:
            return t
        return apply_rotary_pos_emb(t, freqs, config=self.config, cu_seqlens=None,
                                    mscale=yarn_concentration_factor(self.config),
                                    cp_group=self.pg_collection.cp)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        key_value_states: Optional[Tensor] = None,
        inference_context=None,
        rotary_pos_emb: Optional[Union[Tensor, Tuple[Tensor, Tensor]]] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """``hidden_states [s, b, h]`` -> ``(output [s, b, h], bias or None)``.

        ``attention_mask`` is not read: NSA is causal by construction (like the causal
        core attentions in ``core_attention.py``).
        """
        if key_value_states is not None:
            raise NotImplementedError(f"attention={self.attention_name}: cross attention (key_value_states) is not supported.")
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(f"attention={self.attention_name}: KV-cache inference is not supported yet (full-sequence only).")
        if packed_seq_params is not None:
            raise NotImplementedError(f"attention={self.attention_name}: packed (THD) sequences are not supported (supported: [s, b, h]).")
        if attention_bias is not None:
            raise NotImplementedError(f"attention={self.attention_name}: attention_bias is not supported.")
        if rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin is not None:
            raise NotImplementedError(f"attention={self.attention_name}: precomputed RoPE cos/sin (flash decode) is not supported.")
        no_rope = self.config.no_rope_freq[self.layer_number - 1] if self.config.no_rope_freq else False
        if no_rope:
            rotary_pos_emb = None
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        q_freqs, k_freqs = rotary_pos_emb if rotary_pos_emb is not None else (None, None)

        sq, bsz = hidden_states.shape[:2]
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, q + 2*sets*kv]
        parts = torch.split(mixed, self.split_sizes, dim=-1)
        q = parts[0].reshape(sq, bsz, self.num_heads, self.head_dim)
        kvs = [p.reshape(sq, bsz, self.num_groups, self.head_dim) for p in parts[1:]]
        q = self._rope(q, q_freqs)
        kvs = [self._rope(t, k_freqs) if i % 2 == 0 else t for i, t in enumerate(kvs)]  # keys only
        # [s, b, h, d] -> [b, h, s, d]
        q = q.permute(1, 2, 0, 3).contiguous()
        kvs = [t.permute(1, 2, 0, 3).contiguous() for t in kvs]
        gates, _ = self.linear_gate(hidden_states)  # [s, b, Hq*3]
        gates = gates.reshape(sq, bsz, self.num_heads, 3).permute(1, 2, 0, 3)

        branch = {}
        if self.num_kv_sets == 3:
            branch = dict(k_slc=kvs[2], v_slc=kvs[3], k_win=kvs[4], v_win=kvs[5])
        phi = {}
        if self.phi_k is not None:
            phi = dict(phi_k=self.phi_k.params(), phi_v=self.phi_v.params())
        ssa = {}
        if self.transform == "ssa":
            self._project_n()
            ssa = dict(n=self.n, b=self.b)
        out = self._attend(q, kvs[0], kvs[1], gates, self.nsa, **branch, **phi, transform=self.transform,
                            **ssa, softmax_scale=self.softmax_scale, impl=self.impl)
        out = out.permute(2, 0, 1, 3).reshape(sq, bsz, self.num_heads * self.head_dim)
        return self.linear_proj(out)


# ------------------------------------------------------------------------------ specs
#: SSA options (the policy's ``SSA_OPTION_KEYS``) -> NSASelfAttention keywords
_SSA_KWARGS = {"n": "n_init", "b": "b_init", "learnable_n": "learnable_n", "n_min": "n_min", "learnable_b": "learnable_b",
               "force_contiguous_qkv": "force_contiguous_qkv"}


def nsa_self_attention_spec(
    nsa: Union[None, NSAConfig, Dict[str, Any]] = None,
    impl: Union[str, Dict[str, str]] = "auto",
    transform: str = "softmax",
    submodules: Optional[NSASelfAttentionSubmodules] = None,
    ssa: Optional[Dict[str, Any]] = None,
) -> ModuleSpec:
    """ModuleSpec for ``TransformerLayerSubmodules.self_attention``.

    Args:
        nsa: NSA sizes (:class:`NSAConfig` or a dict of its fields; default paper sizes).
            Validated here, so a bad option fails when the spec is built.
        impl: op implementation (``auto``/``triton``/``torch`` or per stage).
        transform: ``softmax`` (``attention=nsa``) or ``ssa`` (``nsa_ssa``).
        submodules: linear layer classes (default megatron's local column/row parallel).
        ssa: SSA options as the policy resolves them (``n``, ``b``, ``learnable_n``,
            ``learnable_b``, ``force_contiguous_qkv``; missing keys take
            :class:`NSASelfAttention`'s defaults, the pinned values). ``transform="ssa"``
            only.

    Raises:
        ValueError: unknown NSA/SSA options, bad sizes, an unknown transform, SSA options
            with ``transform="softmax"``, or ``b <= 0``.
    """
    cfg = _nsa_config(nsa)
    if transform not in ("softmax", "ssa"):
        raise ValueError(f"attention=nsa: transform must be one of ('softmax', 'ssa'), got {transform!r}")
    name = _table_row(transform).name
    params: Dict[str, Any] = {"attn_mask_type": AttnMaskType.causal, "nsa": cfg, "impl": impl, "transform": transform}
    ssa = {k: v for k, v in dict(ssa or {}).items() if v is not None}
    if ssa and transform != "ssa":
        raise ValueError(f"attention={name}: SSA options {sorted(ssa)} need transform='ssa' (attention=nsa_ssa)")
    unknown = sorted(set(ssa) - set(_SSA_KWARGS))
    if unknown:
        raise ValueError(f"attention={name}: unknown SSA options {unknown}; supported: {sorted(_SSA_KWARGS)}")
    if "b" in ssa and not ssa["b"] > 0:
        raise ValueError(f"attention={name}: b must be > 0, got {ssa['b']}")
    params.update({_SSA_KWARGS[k]: v for k, v in ssa.items()})
    return ModuleSpec(module=NSASelfAttention, params=params,
                      submodules=submodules or NSASelfAttentionSubmodules())


def nsa_layer_spec_submodules(
    nsa: Union[None, NSAConfig, Dict[str, Any]] = None,
    impl: Union[str, Dict[str, str]] = "auto",
    transform: str = "softmax",
    layer_norm: Optional[Union[ModuleSpec, type]] = None,
):
    """``TransformerLayerSubmodules`` of megatron's local GPT layer with NSA as self attention.

    Usage in ``spec.py`` (the lead's side)::

        layer = ModuleSpec(module=TransformerLayer,
                           submodules=nsa_layer_spec_submodules(options, layer_norm=LayerNorm1P))

    or, keeping an existing layer spec: ``layer.submodules.self_attention =
    nsa_self_attention_spec(options)``.

    Args:
        nsa, impl, transform: as :func:`nsa_self_attention_spec`.
        layer_norm: input / pre-MLP norm (default: megatron local spec's LayerNorm).
    """
    import copy

    from nemo_ssa.megatron.compat import local_layer_spec

    base = copy.deepcopy(local_layer_spec(normalization="LayerNorm"))
    sub = base.submodules
    sub.self_attention = nsa_self_attention_spec(nsa, impl=impl, transform=transform)
    if layer_norm is not None:
        sub.input_layernorm = layer_norm
        sub.pre_mlp_layernorm = layer_norm
    return sub
