"""Where a training step's time goes, by module and by kernel family, from one torch.profiler run.

    with module_ranges(model):                      # names the modules' forward in the trace
        with torch.profiler.profile(...) as prof:
            step()
    print(table(by_module(prof.events(), device=True)))

Forward ops are attributed to the innermost module (``module_ranges``: forward hooks open a
``nemo_ssa.module::<name>`` range around each selected module; layer indices become ``*`` so
the 12 layers add up). Backward ops run on autograd's thread, outside those ranges: each
``autograd::engine::evaluate_function`` carries the sequence number of the forward op that
recorded it, and takes that op's module, marked ``bwd``. The optimizer step is whatever runs
inside a ``nemo_ssa.optimizer`` range (``optimizer_range``). Time is each op's self time on
the device (the kernels it launched) or, without a GPU, on the CPU.

Kernel families (``family``) group kernels by what they do (GEMM, attention, copy/transpose,
norm, RoPE + layout, loss, elementwise, reduction, optimizer) from their names; the model
benchmark (benchmarks/bench_model.py) prints its tables with the same function.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = ["MODULE_RANGE", "DEFAULT_MODULES", "module_ranges", "optimizer_range", "by_module", "family",
           "by_family", "table", "UNNAMED", "top_ops", "top_ops_table", "top_kernels",
           "top_kernels_table"]

MODULE_RANGE = "nemo_ssa.module::"
OPTIMIZER_RANGE = "nemo_ssa.optimizer"
#: the last name component of the modules a GPT layer's time is read by (megatron's names)
DEFAULT_MODULES = ("embedding", "input_layernorm", "self_attention", "linear_qkv", "core_attention",
                   "linear_proj", "pre_mlp_layernorm", "mlp", "linear_fc1", "linear_fc2", "final_layernorm",
                   "output_layer")


def _label(name: str) -> str:
    # drop wrapper prefixes (DDP's and Float16Module's ``module.``) and fold layer indices
    parts = [p for p in name.split(".") if p != "module"]
    return ".".join("*" if p.isdigit() else p for p in parts)


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module, names: Iterable[str] = DEFAULT_MODULES) -> Iterator[None]:
    """Open a profiler range around the forward of every submodule whose last name component
    is in ``names``; removed on exit. The hooks leave the model's paths as they are: the
    fused output layer + loss, which skips the output layer's forward, opens the output
    layer's range itself (``profile_range`` on the hook)."""
    keep = set(names)
    handles, open_ranges = [], {}

    def pre(label):
        def hook(mod, args):
            rf = torch.autograd.profiler.record_function(MODULE_RANGE + label)
            rf.__enter__()
            open_ranges.setdefault(id(mod), []).append(rf)
        # read by the fused output layer (nemo_ssa.megatron.output_layer): a range hook is no
        # reason to leave the fused loss, and the fused loss opens this range itself because
        # it never calls the output layer's forward
        hook.profile_range = MODULE_RANGE + label
        return hook

    def post(mod, args, out):
        stack = open_ranges.get(id(mod))
        if stack:
            stack.pop().__exit__(None, None, None)

    for name, mod in model.named_modules():
        if name and name.split(".")[-1] in keep:
            handles.append(mod.register_forward_pre_hook(pre(_label(name))))
            handles.append(mod.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def optimizer_range():
    """The range ``by_module`` reads as the optimizer step."""
    return torch.autograd.profiler.record_function(OPTIMIZER_RANGE)


_EVAL = "autograd::engine::evaluate_function: "


def _owner(ev, fwd_module: Dict[Tuple[int, int], str], memo: Dict[int, str]) -> str:
    """The module (``<name> fwd`` / ``<name> bwd``), ``optimizer`` or ``other`` an op belongs to."""
    chain, e, found = [], ev, "other"
    while e is not None:
        if id(e) in memo:
            found = memo[id(e)]
            break
        chain.append(e)
        if e.name.startswith(MODULE_RANGE):
            found = e.name[len(MODULE_RANGE):] + " fwd"
            break
        if e.name == OPTIMIZER_RANGE:
            found = "optimizer"
            break
        if e.name.startswith(_EVAL):
            mod = fwd_module.get((e.fwd_thread, e.sequence_nr))
            found = (mod + " bwd") if mod else "backward, no module"
            break
        e = e.cpu_parent
    for c in chain:
        memo[id(c)] = found
    return found


def _self_time(ev, device: bool) -> float:
    if device:
        # the kernels this op launched, as the profiler attaches them to it: each kernel is on
        # exactly one op, so the module totals add up to the kernel families' (by_family).
        # ``self_device_time_total`` would count every kernel again: prof.events() also holds
        # the device-side events themselves (an H100 step of 95 ms summed to 207 ms that way).
        return float(sum(k.duration for k in (getattr(ev, "kernels", ()) or ())))
    return float(ev.self_cpu_time_total)


def _forward_modules(events) -> Dict[Tuple[int, int], str]:
    """``{(thread, sequence number): module}`` of the forward ops inside a module range: what
    a backward op's ``fwd_thread`` / ``sequence_nr`` finds its module by."""
    fwd_module: Dict[Tuple[int, int], str] = {}
    memo: Dict[int, str] = {}
    for ev in events:
        if ev.sequence_nr is not None and ev.sequence_nr >= 0 and not ev.name.startswith(_EVAL):
            owner = _owner(ev, {}, memo)
            if owner.endswith(" fwd"):
                fwd_module.setdefault((ev.thread, ev.sequence_nr), owner[: -len(" fwd")])
    return fwd_module


def by_module(events, device: bool) -> Dict[str, float]:
    """``{owner: microseconds}`` of self time over ``events`` (``prof.events()``)."""
    fwd_module, memo = _forward_modules(events), {}
    out: Dict[str, float] = defaultdict(float)
    for ev in events:
        t = _self_time(ev, device)
        if t > 0:
            out[_owner(ev, fwd_module, memo)] += t
    return dict(out)


#: the rows of ``by_module`` that name no layer: what they hold is ``top_ops``'s to say
UNNAMED = ("other", "backward, no module")


def top_ops(events, device: bool, owners: Iterable[str] = UNNAMED, n: int = 8) -> Dict[str, list]:
    """``{owner: [(op, kernel family, microseconds), ...]}``: the ``n`` ops with the most self
    time inside each of ``owners`` (by default the rows that name no module), an op's family
    being that of its longest kernel (device) or of its name (CPU)."""
    want = set(owners)
    fwd_module, memo = _forward_modules(events), {}
    acc: Dict[str, Dict[Tuple[str, str], float]] = {o: defaultdict(float) for o in want}
    for ev in events:
        t = _self_time(ev, device)
        if t <= 0:
            continue
        owner = _owner(ev, fwd_module, memo)
        if owner not in want:
            continue
        kernels = list(getattr(ev, "kernels", ()) or ()) if device else []
        fam = family(max(kernels, key=lambda k: k.duration).name) if kernels else family(ev.name)
        acc[owner][(ev.name, fam)] += t
    return {o: [(op, fam, t) for (op, fam), t in sorted(d.items(), key=lambda kv: -kv[1])[:n]]
            for o, d in acc.items() if d}


def top_ops_table(tops: Dict[str, list], steps: int = 1) -> str:
    """Markdown: per unnamed row, its largest ops."""
    rows = ["| row | op | kernel family | us per step |", "|---|---|---|---|"]
    for owner, ops in tops.items():
        for op, fam, t in ops:
            rows.append(f"| {owner} | `{op}` | {fam} | {t / steps:,.0f} |")
    return "\n".join(rows)


def top_kernels(events, n: int = 25) -> list:
    """``[(kernel, family, owner, microseconds, launches), ...]``: the ``n`` (kernel name,
    owner) pairs with the most device time, largest first -- which kernels a family's or a
    module's time is made of (a family total alone cannot say what "elementwise" ran)."""
    fwd_module, memo = _forward_modules(events), {}
    acc: Dict[Tuple[str, str], List[float]] = defaultdict(lambda: [0.0, 0])
    for ev in events:
        kernels = getattr(ev, "kernels", ()) or ()
        if not kernels:
            continue
        owner = _owner(ev, fwd_module, memo)
        for k in kernels:
            a = acc[(k.name, owner)]
            a[0] += float(k.duration)
            a[1] += 1
    ranked = sorted(acc.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, family(name), owner, t, int(c)) for (name, owner), (t, c) in ranked]


def top_kernels_table(kernels: list, steps: int = 1, width: int = 70) -> str:
    """Markdown: the largest kernels per step (names cut to ``width`` characters)."""
    rows = ["| kernel | family | owner | us per step | launches per step |", "|---|---|---|---|---|"]
    for name, fam, owner, t, c in kernels:
        short = name if len(name) <= width else name[: width - 3] + "..."
        rows.append(f"| `{short}` | {fam} | {owner} | {t / steps:,.0f} | {c / steps:,.1f} |")
    return "\n".join(rows)


_FAMILIES = (
    # our fused MLP kernels are GEMMs with relu^2 in the epilogue (nemo_ssa/ops/mlp), not the
    # elementwise kernels their "relu" would match below
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
              "relu2_fwd_kernel", "relu2_bwd_kernel")),
    ("attention", ("attn", "flash", "fmha", "cudnn", "sdpa", "scaled_dot_product")),
    # torch's LayerNorm backward reduces the weight/bias gradients in GammaBetaBackward
    ("norm", ("layer_norm", "layernorm", "rms_norm", "gammabeta")),
    ("rope + layout", ("rope",)),
    ("loss", ("cross_entropy", "nll", "log_softmax", "softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy/transpose/cast", ("copy", "transpose", "permute", "contiguous", "cat", "memcpy", "memset", "to_copy",
                             "clone")),
    ("reduction", ("reduce", "sum", "max", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "mul", "add", "relu", "gelu")),
)


#: torch.compile's generated kernels: ``triton_<poi|per|red|tem>_fused_<ops>_<n>`` (CUDA),
#: ``cpp_fused_<ops>_<n>`` (CPU); the name lists the aten ops fused into the kernel
_INDUCTOR = re.compile(r"^(?:triton_(?:poi|per|red|tem)_|cpp_)fused_(.*?)_\d+$")
_LAYOUT_OPS = re.compile(r"to_copy|copy|transpose|permute|clone|cat|view|unsqueeze|squeeze|expand|slice|select|"
                         r"contiguous|reshape")
COMPILED = "compiled fusion (torch.compile)"


def family(kernel_name: str) -> str:
    """The family of a kernel (or, on CPU, an aten op) from its name: first rule that matches.
    A torch.compile kernel is a copy only when every op its name lists moves data (a fused
    ``_to_copy`` + ``max`` + ``exp`` is megatron's compiled cross entropy, not a layout copy,
    and reading it as one made the loss's fp32 logits look like layout copies); else it is
    ``COMPILED``."""
    name = kernel_name.lower()
    m = _INDUCTOR.match(name)
    if m is not None:
        return "copy/transpose/cast" if not _LAYOUT_OPS.sub("", m.group(1)).strip("_") else COMPILED
    for fam, keys in _FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def by_family(events, device: bool, name_of: Optional[Callable] = None) -> Dict[str, float]:
    """``{family: microseconds}`` of self time, by the kernels' names (device) or the ops'."""
    out: Dict[str, float] = defaultdict(float)
    for ev in events:
        if device:
            for k in getattr(ev, "kernels", ()) or ():
                out[family(k.name)] += float(k.duration)
        else:
            t = float(ev.self_cpu_time_total)
            if t > 0 and not ev.name.startswith((MODULE_RANGE, OPTIMIZER_RANGE, _EVAL)):
                out[family((name_of or (lambda e: e.name))(ev))] += t
    return dict(out)


def table(times: Dict[str, float], title: str, steps: int = 1) -> str:
    """Markdown table of ``times`` per step, largest first, with shares of the total."""
    total = sum(times.values()) or 1.0
    rows = [f"| {title} | us per step | share |", "|---|---|---|"]
    for k, t in sorted(times.items(), key=lambda kv: -kv[1]):
        rows.append(f"| {k} | {t / steps:,.0f} | {100 * t / total:.1f} % |")
    rows.append(f"| total | {total / steps:,.0f} | |")
    return "\n".join(rows)


def split_label(owner: str) -> Tuple[str, str]:
    """``("layers.*.mlp", "bwd")`` from ``"layers.*.mlp bwd"``."""
    m = re.match(r"^(.*) (fwd|bwd)$", owner)
    return (m.group(1), m.group(2)) if m else (owner, "")
