"""The pinned SSA training policy (seed 000), in one place.

Every SSA variant (every attention with the SSA transform, ``nsa_ssa`` included) trains
with n = 1.5 learnable, b = 0.8 fixed and contiguous q/k/v;
``attention=ssa`` resolves to the policy's pinned kernel; kernels marked experimental
are refused. Any override of those parameters is warned about and reset.
``ssa_reference`` is always allowed (it is the baseline every comparison needs).
``policy=free`` opts out: the requested options are used as given.

``force_contiguous_qkv`` (seed 000: the authors' kernel was unstable on strided inputs)
means: the attention kernel reads dense [B, H, S, D] q, k, v. It does not mean separate
copies: for softmax_triton / ssa_triton our layer spec meets it in the same Triton pass
that applies RoPE (``fused_rope_layout``, nemo_ssa/ops/rope, replacing megatron's unfused
RoPE); other attentions and the fallbacks (packed THD, inference, context parallel,
recompute) copy with ``.contiguous()`` after megatron's RoPE. See the
``force_contiguous_qkv`` section of nemo_ssa/ops/attention/README.md.

The attentions themselves (names, families, statuses, options) are the table in
``nemo_ssa.config.attentions``; this module applies the policy to them. Pure Python (no
torch/megatron import) so launchers and tests can use it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_ssa.config.attentions import (  # noqa: F401  (NSA_OPTION_KEYS, AttentionInfo: re-exported)
    ALIASES,
    ATTENTIONS,
    KERNEL_OPTION_KEYS,
    NSA_OPTION_KEYS,
    SSA_OPTION_KEYS,
    AttentionInfo,
)

# the logger keeps the module's historical name: log filters and the config fuzz's
# silencing select it by that name
logger = logging.getLogger("nemo_ssa.policy")


@dataclass(frozen=True)
class SSAPolicy:
    n: float = 1.5
    learnable_n: bool = True
    #: a floor a learnable n is projected onto after every optimizer step (the paper's
    #: "n >= 1" reading; the authors' code leaves n unconstrained): None = no floor
    n_min: Optional[float] = None
    b: float = 0.8
    learnable_b: bool = False
    #: the kernel reads dense [B, H, S, D] q/k/v (met by the fused RoPE + layout pass where
    #: it runs, else by .contiguous() copies; module docstring)
    force_contiguous_qkv: bool = True
    #: the kernel ``attention=ssa`` means (the fused stable kernel)
    pinned_kernel: str = "ssa_triton"
    #: what ``attention=ssa`` means without CUDA: Triton kernels then run only in the
    #: interpreter (for tests, ~1000x slower), and the reference computes the same op
    cpu_kernel: str = "ssa_reference"


PINNED = SSAPolicy()


@dataclass
class ResolvedAttention:
    requested: str
    name: str
    family: str
    policy: str
    options: Dict[str, Any]
    warnings: List[str] = field(default_factory=list)
    #: the ops' debugging variables set when the record was written (``write``)
    env_overrides: Dict[str, str] = field(default_factory=dict)
    #: which kernel each distinct fused-attention call took and why
    #: (``nemo_ssa.ops.common.dispatch.chosen``), as of the write: empty before training
    kernels: List[Dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, run_dir: str, filename: str = "attention_policy.json") -> str:
        """The resolved attention and its options, plus ``env_overrides``: every kernel
        debugging variable (``nemo_ssa.ops.common.env.ENV_VARS``) set in this process, so a
        run whose kernels an override changed says so in its record; and ``kernels``, the
        paths the fused kernels took so far (written again when training ends)."""
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, filename)
        with open(path, "w") as f:
            self.env_overrides = active_env_overrides()
            self.kernels = kernels_chosen()
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
        return path


def active_env_overrides() -> Dict[str, str]:
    """``{name: value}`` of the ops' debugging variables set in this process."""
    from nemo_ssa.ops.common.env import ENV_VARS

    return {name: os.environ[name] for name, _, _ in ENV_VARS if name in os.environ}


def kernels_chosen() -> List[Dict[str, str]]:
    """The fused-attention kernel decisions of this process (none when no op was imported)."""
    dispatch = sys.modules.get("nemo_ssa.ops.common.dispatch")
    return dispatch.chosen() if dispatch is not None else []


def known_names() -> List[str]:
    return sorted(list(ATTENTIONS) + list(ALIASES))


def resolve_attention(
    attention: str,
    options: Optional[Dict[str, Any]] = None,
    policy: str = "pinned",
    pinned: SSAPolicy = PINNED,
    device: str = "cuda",
) -> ResolvedAttention:
    """Resolve ``attention=<name>`` plus user options under a policy.

    Args:
        attention: a name from :data:`ATTENTIONS` or the alias ``ssa``.
        options: SSA options the user asked for (keys in ``SSA_OPTION_KEYS``; ignored with
            a warning for attentions without the SSA transform), plus the attention's
            ``KERNEL_OPTION_KEYS`` (passed through under every policy).
        policy: ``"pinned"`` (default: seed 000's policy enforced) or ``"free"``.
        pinned: the policy values (tests may pass another).
        device: ``"cuda"`` or ``"cpu"``: where the run trains; ``ssa`` means
            ``pinned.cpu_kernel`` on CPU (said in the warnings).

    Returns:
        ResolvedAttention with the implementation name, the effective options and the
        warnings that were logged.

    Raises:
        ValueError: unknown name, unknown option or unknown policy.
        NotImplementedError: a planned attention that does not exist yet, or an
            experimental kernel under the pinned policy.
    """
    if policy not in ("pinned", "free"):
        raise ValueError(f"policy={policy!r} is not supported (supported: 'pinned', 'free').")
    options = {k: v for k, v in dict(options or {}).items() if v is not None}
    kernel_keys = KERNEL_OPTION_KEYS.get(attention, ())
    unknown = sorted(set(options) - set(SSA_OPTION_KEYS) - set(kernel_keys))
    if unknown:
        raise ValueError(f"unknown attention option(s) {unknown} for attention={attention}; supported: "
                         f"{list(SSA_OPTION_KEYS) + list(kernel_keys)}")
    kernel = {k: options.pop(k) for k in kernel_keys if k in options}
    warnings: List[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        logger.warning(msg)

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} is not supported (supported: 'cuda', 'cpu')")
    name = attention
    if attention == "ssa":
        name = pinned.pinned_kernel
        if device == "cpu" and name != pinned.cpu_kernel:
            warn(f"attention=ssa -> {pinned.cpu_kernel} on CPU ({name} needs a GPU; without one "
                 f"Triton runs only in its interpreter). Same math; the GPU runs use {name}.")
            name = pinned.cpu_kernel
    if name not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is unknown; known: {', '.join(known_names())}")
    info = ATTENTIONS[name]
    if info.status == "planned":
        raise NotImplementedError(
            f"attention={name!r} is not implemented yet ({info.description}); "
            f"available now: {', '.join(n for n, a in ATTENTIONS.items() if a.status != 'planned')}"
        )
    if info.status == "experimental" and policy == "pinned" and name != "ssa_reference":
        raise NotImplementedError(
            f"attention={name!r} is marked experimental and the pinned SSA policy refuses it; "
            f"use attention=ssa ({pinned.pinned_kernel}) or opt out with policy=free."
        )

    if info.transform != "ssa":
        if options:
            warn(f"attention={name}: SSA options {sorted(options)} do not apply and are ignored")
        return ResolvedAttention(attention, name, info.family, policy, kernel, warnings)

    effective = {
        "n": pinned.n,
        "learnable_n": pinned.learnable_n,
        "n_min": pinned.n_min,
        "b": pinned.b,
        "learnable_b": pinned.learnable_b,
        "force_contiguous_qkv": pinned.force_contiguous_qkv,
    }
    if policy == "free":
        effective.update(options)
    else:
        for key, value in options.items():
            if value is None or value == effective[key]:
                continue
            if key == "learnable_b":
                warn(f"Ignoring learnable_b={value}: b is fixed at {pinned.b} by the pinned SSA policy "
                     "(policy=free to experiment).")
            else:
                warn(f"Overriding {key}={value} to the pinned SSA policy's {effective[key]} "
                     "(policy=free to experiment).")
    effective.update(kernel)
    return ResolvedAttention(attention, name, info.family, policy, effective, warnings)
