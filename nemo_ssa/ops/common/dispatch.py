"""Which kernel a fused attention call runs: decided here, said once per distinct call, kept
for the run's record.

The flash forward has four paths (the Hopper Gluon kernel, the autotuner, Triton with TMA
tensor descriptors, Triton with pointer tiles) and the shared backward two schedules (the
single pass, whose dK/dV kernel also adds ``dq`` with fp32 atomics, or the two-kernel,
bit-identical backward), the single pass in Gluon or in Triton. Every caller -- the flash
and varlen functions, their custom op, ELSA's backward, a direct ``attention_bwd`` call --
asks ``backward_plan`` for the schedule with the call's facts taken from ``q``, ``k``, ``v``
(what the forward knows: the forward must decide, because the single pass needs the row
statistic ``C`` written by the forward), so one shape takes one backward whoever calls.

Each decision is a :class:`Choice` (``path`` and a one-line ``reason``); :func:`note` logs it
the first time its key (op, transform, head dim, dtype, varlen, causal, dropout, ...) is seen
in the process and keeps it; :func:`chosen` returns them for ``attention_policy.json``
(``kernels``), so a run's record says which kernels ran, not only which options were set.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from nemo_ssa.ops.common import env
from nemo_ssa.ops.common.bwd_config import d_bucket, single_pass_pays
from nemo_ssa.ops.common.hopper_bwd import GLUON_BWD, gluon_bwd_capable
from nemo_ssa.ops.common.tma import use_tma

__all__ = ["Choice", "backward_plan", "backward_schedule", "chosen", "note", "note_call", "reset"]

logger = logging.getLogger("nemo_ssa.kernels")

SINGLE, TWO_KERNEL = "single-pass", "two-kernel"


@dataclass(frozen=True)
class Choice:
    op: str
    path: str
    reason: str


_SEEN: Dict[Tuple, Choice] = {}
#: backward_plan's answers by every fact its schedule depends on (reset() empties it with
#: _SEEN, so a decision forgotten there is noted again on its next call)
_PLANS: Dict[Tuple, Choice] = {}


def note(key: Tuple, op: str, path: str, reason: Union[str, Callable[[], str]]) -> Choice:
    """Keep the choice ``(op, path, reason)`` and log it the first time this call key takes
    this path (a switch flipped mid-process, e.g. deterministic mode, is a new entry, not a
    silent change). ``reason`` may be a function: it is called only then, so a call whose
    key was seen pays a tuple and a dict lookup (the recipe's attention is host-bound)."""
    full = key + (path,)
    choice = _SEEN.get(full)
    if choice is None:
        choice = _SEEN[full] = Choice(op, path, reason() if callable(reason) else reason)
        logger.info("%s %s: %s (%s)", op, _describe(key), path, choice.reason)
    return choice


#: note_call's choices by the call's raw facts and path (reset() empties it with _SEEN)
_CALLS: Dict[Tuple, Choice] = {}


def note_call(op: str, path: str, reason: Union[str, Callable[[], str]], transform: str, head_dim: int,
              dtype: torch.dtype, varlen: bool, causal: bool, dropout: bool) -> Choice:
    """:func:`note` for one attention call's facts under the record's key ``(op, transform,
    "D<head dim>", dtype, dense | varlen, causal | full, dropout | "")``, which is built (an
    f-string and four choices of words) only the first time the facts take ``path``: the
    flash forward and the backward's kernels note on every call of a host-bound attention."""
    facts = (op, path, transform, head_dim, dtype, varlen, causal, dropout)
    choice = _CALLS.get(facts)
    if choice is None:
        key = (op, transform, f"D{head_dim}", dtype, "varlen" if varlen else "dense", "causal" if causal else "full",
               "dropout" if dropout else "")
        choice = _CALLS[facts] = note(key, op, path, reason)
    return choice


def _describe(key: Tuple) -> str:
    return " ".join(str(x).replace("torch.", "") for x in key[1:] if x != "")


def chosen() -> List[Dict[str, str]]:
    """Every distinct decision of this process: ``[{op, call, path, reason}]``."""
    return [dict(asdict(c), call=_describe(k[:-1])) for k, c in _SEEN.items()]


def reset() -> None:
    """Forget the decisions (tests; a new run in the same process)."""
    _SEEN.clear()
    _PLANS.clear()
    _CALLS.clear()


def backward_schedule(transform: str, head_dim: int, *, tma: bool = False, gluon: bool = False,
                      deterministic: Optional[bool] = None) -> Choice:
    """The backward schedule from the call's facts: ``deterministic=True`` (the caller's
    request, e.g. ``flash_attention(deterministic=True)``) and ``NEMO_SSA_BWD`` first, then
    torch's deterministic-algorithms switch (Megatron's ``deterministic_mode``), then where
    the single pass is measured faster (``bwd_config.single_pass_pays``: ``tma`` and
    ``gluon`` say whether the call can take those kernels)."""
    if deterministic:
        return Choice("attention.bwd", TWO_KERNEL, "deterministic requested by the caller")
    mode = env.bwd_mode()
    if mode == "deterministic":
        return Choice("attention.bwd", TWO_KERNEL, "NEMO_SSA_BWD=deterministic")
    if mode == "atomic":
        return Choice("attention.bwd", SINGLE, "NEMO_SSA_BWD=atomic")
    if torch.are_deterministic_algorithms_enabled():
        return Choice("attention.bwd", TWO_KERNEL, "torch deterministic algorithms are on")
    where = f"{transform} D{d_bucket(int(head_dim))}" + (" with TMA" if tma else "") + \
        (" in Gluon" if gluon else "")
    if single_pass_pays(transform, head_dim, tma, gluon):
        return Choice("attention.bwd", SINGLE, f"measured faster for {where}")
    return Choice("attention.bwd", TWO_KERNEL, f"measured faster for {where}")


def backward_plan(transform: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool,
                  dropout: bool, fast_log2: int, scores: int, causal: bool,
                  deterministic: Optional[bool] = None) -> Choice:
    """The backward schedule of one call, from ``q``, ``k``, ``v`` and the call's flags
    (``scores`` = ``B * Hq * Sq * Sk``); noted once per distinct call."""
    d = int(q.shape[-1])
    # the TMA path changes the choice only for SSA at D64 (bwd_config.single_pass_pays), and
    # costs a stride check: asked only there; the Gluon table is looked up before its checks
    tma = transform == "ssa" and d_bucket(d) == 64 and bool(use_tma(1, varlen, q, k, v, scores=scores))
    gluon = (d, transform) in GLUON_BWD and gluon_bwd_capable(transform, q, k, v, varlen=varlen, dropout=dropout,
                                                              fast_log2=fast_log2)
    # the key holds every input of backward_schedule (the switches it reads are read here
    # per call, in its order, so a flipped one takes its own entry) and of the noted key: a
    # call seen before skips rebuilding the same Choice, its reason and its record
    switches = () if deterministic else (env.bwd_mode(), torch.are_deterministic_algorithms_enabled())
    plan_key = (transform, d, q.dtype, varlen, causal, dropout, bool(deterministic), tma, gluon) + switches
    plan = _PLANS.get(plan_key)
    if plan is None:
        choice = backward_schedule(transform, d, tma=tma, gluon=gluon, deterministic=deterministic)
        key = ("attention.bwd", transform, f"D{d}", q.dtype, "varlen" if varlen else "dense",
               "causal" if causal else "full", "dropout" if dropout else "", "det" if deterministic else "")
        plan = _PLANS[plan_key] = note(key, choice.op, choice.path, choice.reason)
    return plan
