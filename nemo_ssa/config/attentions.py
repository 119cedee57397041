"""The attention table: every ``attention=<name>`` declared once, everything else derived.

One row per name says what the attention is (family, score transform, status), which
options it takes (the SSA options when its transform is SSA, plus its own kernel options
with their defaults) and how it is implemented (the ``nemo_ssa.ops.registry`` key of its
op and the megatron module that calls it). From this table come the policy's list of
attentions and kernel option keys (``nemo_ssa.config.policy``), the layer spec's
core-attention mapping (``nemo_ssa.megatron.spec.CORE_ATTENTIONS``), each core attention's
``attention_name`` / ``op_key`` (``nemo_ssa.megatron.core_attention``), the head dims and
the CUDA-graph attentions the config check accepts, and what
nemo_ssa/configs/attention/<name>.yaml must offer (tests/config).

Pure Python (no torch / megatron import): modules are named by ``"module:Class"`` strings
so launchers and config checks stay cheap; megatron code imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = [
    "ALIASES",
    "ATTENTIONS",
    "FAMILIES",
    "KERNEL_OPTION_KEYS",
    "NSA_OPTION_KEYS",
    "SSA_OPTION_KEYS",
    "STATUSES",
    "TRANSFORMS",
    "AttentionInfo",
    "attention_for_module",
    "option_keys",
]

FAMILIES = ("softmax", "ssa", "nsa", "elsa")
#: ``planned`` names are refused by the policy until they exist; ``experimental`` ones
#: only run with ``policy=free``
STATUSES = ("stable", "experimental", "planned")
TRANSFORMS = ("softmax", "ssa")

#: options of every attention with the SSA transform (the pinned policy's parameters)
SSA_OPTION_KEYS = ("n", "learnable_n", "n_min", "b", "learnable_b", "force_contiguous_qkv")
#: NSA's sizes and structure (``nemo_ssa.ops.nsa.NSAConfig`` fields but φ's hidden width;
#: None = the paper's)
NSA_OPTION_KEYS = ("block_len", "stride", "select_block", "top_n", "window", "compress", "separate_kv")

_CORE = "nemo_ssa.megatron.core_attention"
_NSA_MODULE = "nemo_ssa.megatron.nsa_attention:NSASelfAttention"
#: the head dims the fused Triton kernels compile for
_TRITON_HEAD_DIMS = (16, 256)
# RoPE + q/k/v layout in one Triton pass (nemo_ssa/ops/rope); None = on (softmax: with CUDA)
_FUSED_ROPE = {"fused_rope_layout": None}
# None = length-adaptive routing; >= 2 forces the two-pass path
_ELSA = {"num_partitions": None}
# a kernel choice that changes determinism, so a run-config field (recorded in
# attention_policy.json): True = every gradient bit-identical run to run (the two-kernel
# backward); None = megatron's deterministic_mode decides (the core attention passes it)
_DETERMINISTIC = {"deterministic": None}
_NSA = {k: None for k in NSA_OPTION_KEYS}


@dataclass(frozen=True)
class AttentionInfo:
    """One attention: what it is, what it accepts, what implements it.

    ``kernel_options`` are passed through under every policy: implementation knobs that
    do not change the math, and NSA's sizes (experimental, so only reachable with
    ``policy=free``); their values are the defaults a config file offers (None = the
    kernel's own choice). ``op_key`` / ``varlen_op_key`` are ``(variant, impl)`` keys
    into ``nemo_ssa.ops.registry``; ``module`` is ``"module:Class"`` of the megatron
    module that calls the op: a core attention, or for the nsa family the whole self
    attention (it reads the layer input for its gates).
    """

    name: str
    family: str  # one of FAMILIES
    status: str  # one of STATUSES
    description: str
    #: score transform, "softmax" | "ssa"; "" = the family's ("ssa" for the ssa family).
    #: Attentions with the SSA transform get the SSA options and the pinned policy's
    #: values, whatever their family (``nsa_ssa`` is an NSA schedule with SSA scores).
    transform: str = ""
    kernel_options: Mapping[str, Any] = field(default_factory=dict)
    op_key: Tuple[str, ...] = ()
    varlen_op_key: Tuple[str, ...] = ()
    module: str = ""
    #: (lowest, highest) head dim the kernel compiles for; None = any
    head_dims: Optional[Tuple[int, int]] = None
    #: its layers ran under megatron-core's local CUDA graphs on a GPU (captured and replayed:
    #: benchmarks/bench_model.py --cuda-graph local); ``model.cuda_graphs=local`` takes only these
    cuda_graphs: bool = False

    def __post_init__(self):
        if not self.transform:
            object.__setattr__(self, "transform", "ssa" if self.family == "ssa" else "softmax")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"attention {self.name!r}: transform must be 'softmax' or 'ssa', got {self.transform!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"attention {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        if self.status not in STATUSES:
            raise ValueError(f"attention {self.name!r}: status must be one of {STATUSES}, got {self.status!r}")

    @property
    def kernel_option_keys(self) -> Tuple[str, ...]:
        return tuple(self.kernel_options)

    @property
    def module_path(self) -> Tuple[str, str]:
        """``(module, class name)`` of :attr:`module`."""
        module, _, cls = self.module.partition(":")
        return module, cls


#: Every attention name users can pass as ``attention=<name>``. Names say the
#: implementation; ``ssa`` is an alias resolved by the policy.
ATTENTIONS: Dict[str, AttentionInfo] = {
    a.name: a
    for a in [
        AttentionInfo("softmax", "softmax", "stable", "torch SDPA (flash/cuDNN on GPU): the baseline",
                      kernel_options=_FUSED_ROPE, op_key=("softmax", "sdpa"),
                      module=f"{_CORE}:SoftmaxCoreAttention"),
        AttentionInfo("ssa_reference", "ssa", "stable", "unfused torch SSA, fp32 scores: the anchor",
                      op_key=("ssa", "reference"), module=f"{_CORE}:SSAReferenceCoreAttention"),
        AttentionInfo("softmax_triton", "softmax", "stable",
                      "fused Triton softmax: the SSA kernel with the identity transform",
                      kernel_options={**_FUSED_ROPE, **_DETERMINISTIC}, op_key=("softmax", "triton"),
                      varlen_op_key=("softmax", "triton_varlen"), module=f"{_CORE}:SoftmaxTritonCoreAttention",
                      head_dims=_TRITON_HEAD_DIMS, cuda_graphs=True),
        AttentionInfo("ssa_triton", "ssa", "stable",
                      "fused Triton SSA, stable design (tutorial-06 structure, split backward)",
                      kernel_options={**_FUSED_ROPE, **_DETERMINISTIC}, op_key=("ssa", "triton"),
                      varlen_op_key=("ssa", "triton_varlen"),
                      module=f"{_CORE}:SSATritonCoreAttention", head_dims=_TRITON_HEAD_DIMS, cuda_graphs=True),
        AttentionInfo("ssa_flex", "ssa", "stable",
                      "SSA through FlexAttention (any mask; dn in a separate deterministic pass)",
                      kernel_options={"dn_mode": None, "backend": None, "compile": None}, op_key=("ssa", "flex"),
                      module=f"{_CORE}:SSAFlexCoreAttention"),
        AttentionInfo("nsa", "nsa", "experimental",
                      "native sparse attention: compressed + selected + window branches, gated",
                      kernel_options=_NSA, op_key=("nsa", "staged"), module=_NSA_MODULE),
        AttentionInfo("nsa_ssa", "nsa", "experimental",
                      "native sparse attention with the SSA transform in every branch", transform="ssa",
                      kernel_options=_NSA, op_key=("nsa", "staged"), module=_NSA_MODULE),
        AttentionInfo("elsa", "elsa", "experimental",
                      "exact attention as a two-pass scan over key partitions, softmax",
                      kernel_options={**_ELSA, **_DETERMINISTIC}, op_key=("softmax", "elsa"), module=f"{_CORE}:ElsaCoreAttention",
                      head_dims=_TRITON_HEAD_DIMS),
        AttentionInfo("elsa_ssa", "ssa", "experimental", "the same two-pass scan with the SSA transform",
                      kernel_options={**_ELSA, **_DETERMINISTIC}, op_key=("ssa", "elsa"), module=f"{_CORE}:ElsaSSACoreAttention",
                      head_dims=_TRITON_HEAD_DIMS),
    ]
}
ALIASES = {"ssa": None}  # resolved by the policy's pinned kernel

#: attention name -> the kernel options it passes through under every policy (names
#: without kernel options are absent)
KERNEL_OPTION_KEYS: Dict[str, Tuple[str, ...]] = {
    name: a.kernel_option_keys for name, a in ATTENTIONS.items() if a.kernel_options
}


def option_keys(name: str) -> Tuple[str, ...]:
    """Every option ``attention=<name>`` accepts: the SSA options when its transform is SSA
    (the alias ``ssa`` included), then its kernel options.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name in ALIASES:
        return SSA_OPTION_KEYS
    if name not in ATTENTIONS:
        raise ValueError(f"attention={name!r} is unknown; known: {', '.join(sorted(list(ATTENTIONS) + list(ALIASES)))}")
    info = ATTENTIONS[name]
    return (SSA_OPTION_KEYS if info.transform == "ssa" else ()) + info.kernel_option_keys


def attention_for_module(module: str, transform: Optional[str] = None) -> AttentionInfo:
    """The table row implemented by ``module`` (``"module:Class"``); ``transform`` picks
    between rows that share a module (``nsa`` / ``nsa_ssa``).

    Raises:
        ValueError: no row, or several rows and no ``transform`` to tell them apart.
    """
    rows = [a for a in ATTENTIONS.values() if a.module == module and transform in (None, a.transform)]
    if len(rows) != 1:
        raise ValueError(f"{len(rows)} attention table rows have module={module!r}, transform={transform!r} "
                         f"(expected one; modules in the table: {sorted({a.module for a in ATTENTIONS.values()})})")
    return rows[0]
