"""Megatron-core's optimizer step without host reads: clipping and the gradient NaN check on the device.

A host read of a device value (``.item()``, ``bool(tensor)``) drains the GPU's queue: the GPU
then idles while the host runs the Python up to its next launch. Megatron-core 0.15's step
(without apex or Transformer Engine) reads the device twice in every step, after the
backward:

- ``check_for_nan_in_grad`` (on in the recipe: it is what stops a diverging run):
  ``_ParamAndGradBucketGroup.check_grads`` tests each bucket's gradient norm with
  ``rerun_state_machine.validate_result(norm, torch.isnan)`` and ``torch.isinf``, a read each;
- gradient clipping: ``get_grad_norm_fp32`` returns ``total.item() ** 0.5`` for the Python
  clip coefficient in ``clip_grad_by_total_norm_fp32``.

:func:`install` keeps megatron's step and swaps what it calls, only where megatron's own
functions are bound and their signatures are the ones read here (megatron-core 0.15-0.19):

- ``megatron.core.optimizer.optimizer.get_grad_norm_fp32`` -> :func:`grad_norm_fp32`: the same
  2-norm (megatron's multi-tensor norm, squared, summed over ``grad_stats_parallel_group``),
  its square root taken on the device in float64 -- the double megatron's Python computes --
  and returned as a 0-dim float64 tensor. NeMo's strategy logs a CUDA tensor as it is.
- ``...optimizer.clip_grad_by_total_norm_fp32`` -> :func:`clip_grad_by_total_norm`: given a
  tensor norm, ``c = max_norm / (norm + 1e-6)`` in float64 on the device, replaced by 1 where
  megatron's ``c < 1.0`` is false (NaN included), rounded to fp32 as megatron's scalar is, and
  one ``_foreach_mul_``: ``x * 1.0 == x``, so where megatron leaves the gradients alone they
  stay bit for bit. Given a Python float it is megatron's.
- ``_ParamAndGradBucketGroup.check_grads`` -> :func:`check_grads` while a :class:`GradGuard`
  is active (below): each bucket's norm is tested on the device and recorded, not read.

The guard. A NaN check that is not read at once must still keep a bad step from landing:
:func:`activate` gives every inner torch optimizer the guard's flag as ``found_inf`` (the
fused AdamW kernel skips the whole update, moments and step count included, where it is 1 --
the mechanism ``torch.amp.GradScaler`` uses), and the flag is set on the device by any
bucket's NaN/Inf and by a non-finite total norm (after the data-parallel reduction, so every
rank skips). The codes are copied to pinned memory after the step with an event; the next
step's start reads them if the event is done (no wait), and :meth:`GradGuard.check` waits for
them -- the optimizer module calls it before a checkpoint is written and at the end of
training. A bad step then raises megatron's ``RuntimeError`` ("Rank r, node n, device d,
iteration k: Unexpected result nan (message='found NaN in local grad norm for bucket #i ...')")
a step later, the parameters as they were before it. Megatron's own check stays where the
guard cannot stand in: no fused torch optimizer, no clipping (``clip_grad == 0``: no total
norm to carry the flag to every rank), ``check_for_large_grads``, or megatron's rerun state
machine in a mode other than disabled (it re-runs the step from the value at once).

Under megatron's whole-iteration CUDA graph (``model.cuda_graphs=full``) the bucket checks are
captured with the backward: a replay rewrites the captured code tensors and the flag but runs
none of the Python that records them, so the guard keeps what it recorded under the capture
and queues those tensors after every replayed step (the optimizer step and its total-norm
check stay outside the graph and are recorded as always).

The one behaviour that differs from megatron's: a total norm that overflows to inf while every
bucket's norm is finite (a diverged run: a gradient norm above ~1e19) skips the step and raises
here; megatron clips with a coefficient of 0 and steps.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import types
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

_ORIGINAL: Dict[str, Any] = {}

# megatron's signatures this module stands in for (positional names, in order)
_SIGNATURES = {
    "get_grad_norm_fp32": ("grads_for_norm", "norm_type", "grad_stats_parallel_group"),
    "clip_grad_by_total_norm_fp32": ("parameters", "max_norm", "total_norm", "use_decoupled_grad"),
    "check_grads": ("self", "check_for_nan_or_inf", "check_for_large"),
}

_NAN, _INF = 1, 2


def _params_named(fn, names: Tuple[str, ...]) -> bool:
    try:
        return tuple(inspect.signature(fn).parameters)[:len(names)] == names
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------- the guard


class GradGuard:
    """The gradient checks of the steps in flight: a device flag the optimizer skips on, and
    the per-step codes, read when they are ready."""

    def __init__(self):
        self.active = False
        self.flag: Optional[torch.Tensor] = None  # 0-dim fp32, 1.0 = skip this step's update
        self.iteration = 0
        self._armed = False  # a bucket check ran this step (check_for_nan_in_grad is on)
        self._codes: List[torch.Tensor] = []
        self._labels: List[str] = []
        self._pending: Deque[Tuple[int, List[str], torch.Tensor, Any]] = collections.deque()
        self.grad_norm: Any = None  # the last step's total gradient norm (a device tensor) or None
        # the checks recorded while a CUDA graph captured them (model.cuda_graphs=full: the bucket
        # checks run inside megatron's whole-iteration graph): each replay rewrites these tensors
        # and runs none of the Python that records them, so every later step reads these
        self._captured_codes: List[torch.Tensor] = []
        self._captured_labels: List[str] = []
        self._captured_now = False  # this step's checks were recorded under a capture

    def reset(self) -> None:
        self.__init__()

    def _record(self, labels: Sequence[str], norms: Sequence[torch.Tensor]) -> None:
        vals = torch.stack([n.detach().reshape(()).float().to(self.flag.device) for n in norms])
        codes = torch.isnan(vals).to(torch.int8) * _NAN + torch.isinf(vals).to(torch.int8) * _INF
        torch.maximum(self.flag, (codes > 0).any().to(self.flag.dtype), out=self.flag)
        self._codes.append(codes)
        self._labels.extend(labels)
        if _capturing(codes):
            self._captured_codes.append(codes)
            self._captured_labels.extend(labels)
            self._captured_now = True

    def record_buckets(self, norms: Sequence[torch.Tensor]) -> None:
        self._armed = True
        self._record([f"found {{what}} in local grad norm for bucket #{i} in backward pass before "
                      f"data-parallel communication collective" for i in range(len(norms))], norms)

    def record_total(self, total_norm: torch.Tensor) -> None:
        if self._armed or self._captured_codes:
            self._record(["found {what} in the total gradient norm (after the data-parallel reduction)"],
                         [total_norm])

    def end_step(self) -> None:
        """After the optimizer step: queue this step's codes for reading, clear the flag. A step
        that recorded no bucket checks after a graph captured them (a replay) reads the
        captured ones, which the replay rewrote."""
        if self._captured_codes and not self._captured_now:
            # a replay: the captured bucket checks first, as megatron's step records them
            self._codes = self._captured_codes + self._codes
            self._labels = self._captured_labels + self._labels
        if self._codes:
            codes = torch.cat(self._codes)
            if codes.is_cuda:
                host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
                host.copy_(codes, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host, event = codes.clone(), None
            self._pending.append((self.iteration, list(self._labels), host, event))
            self.flag.zero_()
        self._codes, self._labels, self._armed, self._captured_now = [], [], False, False
        self.iteration += 1

    def check(self, wait: bool = True) -> None:
        """Raise megatron's error for the first bad step read; ``wait=False`` reads only what
        the device has finished (no synchronisation)."""
        while self._pending:
            it, labels, host, event = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._pending.popleft()
            bad = [(label, int(c)) for label, c in zip(labels, host.tolist()) if c]
            if bad:
                self._pending.clear()
                label, code = bad[0]
                what = "NaN" if code & _NAN else "Inf"
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
                raise RuntimeError(
                    f"Rank {rank}, node {os.uname()[1]}, device {device}, iteration {it}: Unexpected result "
                    f"{what.lower()} (message='{label.format(what=what)}'). nemo_ssa's sync-free step checks "
                    f"the gradients on the device and reads the result after the step: the update of "
                    f"iteration {it} was skipped ({len(bad)} check(s) failed), the parameters are those "
                    f"before it")


def _capturing(t: torch.Tensor) -> bool:
    """``t`` is being recorded into a CUDA graph (not computed) on the current stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


GUARD = GradGuard()


# ------------------------------------------------------------------------- the stand-ins


def _local(t: torch.Tensor, to_local_if_dtensor) -> torch.Tensor:
    """megatron's ``to_local_if_dtensor`` where ``t`` may be a DTensor; a plain tensor as it is
    (megatron's enters a no_grad context per call: ~2 x 100 per step of host work)."""
    return t if type(t) is torch.Tensor else to_local_if_dtensor(t)


def grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """Megatron's ``get_grad_norm_fp32`` for the 2-norm, returned as a 0-dim float64 device tensor."""
    if float(norm_type) != 2.0:
        return _ORIGINAL["get_grad_norm_fp32"](grads_for_norm, norm_type, grad_stats_parallel_group)
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    data_parallel_group = None
    for grad in grads_for_norm:
        # megatron's helper answers None for a plain tensor (the last gradient decides, as there)
        data_parallel_group = None if type(grad) is torch.Tensor else \
            get_data_parallel_group_if_dtensor(grad, data_parallel_group)
    grads_for_norm = [_local(grad, to_local_if_dtensor) for grad in grads_for_norm]
    if grads_for_norm:
        device = grads_for_norm[0].device
        overflow = torch.zeros(1, dtype=torch.int, device=device)
        grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads_for_norm], False)
        total = grad_norm.float() ** 2
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        total = torch.zeros(1, dtype=torch.float, device=device)
    if torch.distributed.is_initialized():
        if data_parallel_group:
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=data_parallel_group)
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return total.reshape(()).double().sqrt()


def clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """Megatron's ``clip_grad_by_total_norm_fp32``; with a tensor norm, the coefficient stays on the device."""
    if not isinstance(total_norm, torch.Tensor):
        return _ORIGINAL["clip_grad_by_total_norm_fp32"](parameters, max_norm, total_norm, use_decoupled_grad)
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        if grad.dtype != torch.float32 and not (use_decoupled_grad and grad.dtype == torch.bfloat16):
            raise TypeError(f"gradient clipping takes fp32 main gradients (megatron's rule); got {grad.dtype}")
        grad = _local(grad, to_local_if_dtensor)
        # a main gradient is no autograd node: detach only what is (a dispatch per tensor otherwise)
        grads.append(grad.detach() if grad.requires_grad else grad)
    GUARD.record_total(total_norm)
    if not grads:
        return
    coeff = float(max_norm) / (total_norm.double() + 1.0e-6)
    coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff)).float().to(grads[0].device)
    torch._foreach_mul_(grads, coeff)


def check_grads(self, check_for_nan_or_inf, check_for_large):
    """``_ParamAndGradBucketGroup.check_grads``: recorded on the device while the guard is active."""
    if not (GUARD.active and check_for_nan_or_inf) or check_for_large or not _rerun_disabled():
        return _ORIGINAL["check_grads"](self, check_for_nan_or_inf, check_for_large)
    GUARD.record_buckets([bucket.grad_data.norm(p=2) for bucket in self.buckets])


def _rerun_disabled() -> bool:
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    return get_rerun_state_machine().mode == RerunMode.DISABLED


# ------------------------------------------------------------------------- install / activate


def install() -> List[str]:
    """Bind the stand-ins where megatron's own functions are bound; idempotent. Returns what
    is bound (empty when megatron's names or signatures are not the ones read here)."""
    import megatron.core.optimizer.optimizer as mo
    from megatron.core.distributed import param_and_grad_buffer as pgb

    cls = getattr(pgb, "_ParamAndGradBucketGroup", None)
    slots = [(mo, "get_grad_norm_fp32", grad_norm_fp32), (mo, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm),
             (cls, "check_grads", check_grads)]
    for owner, name, ours in slots:
        cur = getattr(owner, name, None) if owner is not None else None
        if cur is ours:
            continue
        if cur is None or not _params_named(cur, _SIGNATURES[name]):
            log.info("nemo_ssa sync-free step: megatron's %s is not the one it stands in for; left as it is", name)
            return []
    done = []
    for owner, name, ours in slots:
        if getattr(owner, name) is not ours:
            _ORIGINAL[name] = getattr(owner, name)
            setattr(owner, name, ours)
        done.append(f"{getattr(owner, '__module__', '')}.{getattr(owner, '__name__', '')}.{name}"
                    if isinstance(owner, type) else f"{owner.__name__}.{name}")
    return done


def uninstall() -> None:
    """Put megatron's functions back (tests)."""
    import megatron.core.optimizer.optimizer as mo
    from megatron.core.distributed import param_and_grad_buffer as pgb

    for owner, name in ((mo, "get_grad_norm_fp32"), (mo, "clip_grad_by_total_norm_fp32"),
                        (pgb._ParamAndGradBucketGroup, "check_grads")):
        if name in _ORIGINAL:
            setattr(owner, name, _ORIGINAL.pop(name))
    GUARD.reset()


def activate(opt) -> Optional[str]:
    """Hand the guard's flag to every torch optimizer inside ``opt`` and read the previous
    steps' checks at the start of each step. Returns why the guard stays off (megatron's own
    NaN check then runs, with its reads), or None when it is on."""
    import megatron.core.optimizer.optimizer as mo

    from nemo_ssa.megatron.optimizer_fixes import inner_optimizers

    if mo.get_grad_norm_fp32 is not grad_norm_fp32:
        return "the stand-ins are not installed (install())"
    top = getattr(opt, "mcore_optimizer", opt)
    leaves = [leaf for leaf in inner_optimizers(opt) if not getattr(leaf, "is_stub_optimizer", False)]
    torch_opts = [getattr(leaf, "optimizer", None) for leaf in leaves]
    if not leaves or any(o is None or not getattr(o, "_step_supports_amp_scaling", False) for o in torch_opts):
        return "an inner optimizer is not torch's fused one (it cannot skip an update on a device flag)"
    if any(float(getattr(leaf.config, "clip_grad", 0.0)) <= 0.0 for leaf in leaves):
        return "clip_grad is 0 (no total norm to carry a rank's NaN to every rank)"
    params = [p for o in torch_opts for g in o.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    if GUARD.flag is None or GUARD.flag.device != device:
        GUARD.flag = torch.zeros((), dtype=torch.float32, device=device)
    for o in torch_opts:
        o.found_inf = GUARD.flag
    if not getattr(top, "_nemo_ssa_sync_free", False):
        step = top.step

        def guarded_step(self, *args, **kwargs):
            GUARD.check(wait=False)
            try:
                out = step(*args, **kwargs)
                # megatron's (update_successful, grad_norm, num_zeros_in_grad): the norm (before
                # clipping) stays a device tensor here, for a logger to read with its other values
                GUARD.grad_norm = out[1] if isinstance(out, tuple) and len(out) == 3 else None
                return out
            finally:
                GUARD.end_step()

        top.step = types.MethodType(guarded_step, top)
        top._nemo_ssa_sync_free = True
    GUARD.active = True
    return None
