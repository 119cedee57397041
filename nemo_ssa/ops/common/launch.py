"""Host-side launching of Triton kernels: interpreter check, cached launch, tiling ints.

* ``is_interpreter``: THE check for Triton's CPU interpreter (``TRITON_INTERPRET=1``) in
  ``nemo_ssa.ops``, decided when this module is imported.
* ``launch``: ``kernel[grid](*args, **meta)`` with the compiled kernel cached per launch
  key, skipping ``JITFunction.run``'s per-call host work; it relies on Triton driver
  internals (``CompiledKernel.run``'s launcher) and falls back to the normal path
  wherever those are missing, under the interpreter, with a launch hook (profilers) or
  with ``NEMO_SSA_FAST_LAUNCH=0``.
* ``launch_kw`` / ``bind_kw`` / ``presence_flags``: the same launch with the kernel's
  arguments by name (see *Keyword launches* below).
* ``autotuned`` / ``autotune_enabled``: the ``NEMO_SSA_AUTOTUNE=1`` alternative to the
  static tile tables.
* ``for_lengths``: the kernel to launch for given sequence lengths (a length of 1 takes a
  twin that does not specialise on lengths).
* ``cdiv``, ``next_pow2``, stride and pointer helpers the attention launchers share.

Keyword launches
----------------
The attention kernels take 20 to 75 parameters. Passed by position, one misplaced stride
shifts every later argument and still compiles; by name (``launch_kw``), a call site says
what each value is, and a wrong or missing name raises a ``TypeError`` naming the kernel
and the parameter before anything is launched. The names are mapped to the kernel's
positional order once per kernel (a binder generated from its signature and cached on
``kernel.fn``, which the ``for_lengths`` twins share); each call then takes ``launch``'s
cached path with the same positional tuple a hand-written call would pass.

Two conventions keep call sites short:

* **Stride groups.** A run of stride parameters ``<prefix><axis>`` (prefix ``s_<name>`` or
  ``<NAME>_S``, axes in ``z, h, s, d`` order, e.g. ``s_qz, s_qh, s_qs, s_qd`` or
  ``RNG_SZ, RNG_SH, RNG_SS``) is passed as one tuple, ``s_q=q.stride()``: a tensor's
  strides travel together, as the tensor's layout does.
* **Presence flags** (fla's ``@triton.heuristics({'IS_VARLEN': ...})``, done on the host
  so the kernel object stays a plain ``JITFunction``): ``@presence_flags(VARLEN="CU_Q")``
  on a kernel makes the constexpr ``VARLEN`` derived from whether the ``CU_Q`` tensor is
  None. An absent tensor is replaced by ``launch_kw``'s ``absent=`` tensor, a pointer the
  constexpr-off branch never dereferences, so the compiled kernel and its arguments are
  exactly those of a call that passed the placeholder and the flag by hand.
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import triton

from nemo_ssa.ops.common import env

#: The sequence-length parameters of the attention kernels (see ``for_lengths``).
LENGTH_ARGS = ("SEQ_Q", "SEQ_K")

__all__ = [
    "LENGTH_ARGS",
    "for_lengths",
    "is_interpreter",
    "launch",
    "launch_kw",
    "bind_kw",
    "presence_flags",
    "launch_key",
    "FAST_LAUNCH",
    "default_input_precision",
    "cdiv",
    "next_pow2",
    "autotune_enabled",
    "autotuned",
    "zhsd_stride_fn",
    "stat_strides",
    "param_ptrs",
]


@triton.jit
def _probe():
    """Never launched: decorated only to see which ``JITFunction`` class Triton builds."""
    pass


# Evaluated once at import, as a plain bool: ``is_interpreter()`` runs in code that
# torch.compile traces (validation in ``flash_attention``), and dynamo must never see a
# Triton kernel object there (it fails with "TritonKernelVariable() has no type").
_INTERPRETED: bool = type(_probe).__name__ == "InterpretedFunction"


def is_interpreter() -> bool:
    """True when the kernels in this process are built for ``TRITON_INTERPRET=1``.

    Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, i.e. when
    a kernel module is first imported; this answer is taken when this module is, so the
    env var must be set before any ``nemo_ssa.ops`` kernel module is imported.
    """
    return _INTERPRETED


# ----------------------------------------------------------------------------------------
# Cached kernel launch: per-call host cost
# ----------------------------------------------------------------------------------------

# NEMO_SSA_FAST_LAUNCH=0 turns the cached launch off (every call goes through JITFunction.run)
FAST_LAUNCH: bool = env.fast_launch()
_LAUNCH_CACHE: dict = {}
_LAUNCH_CACHE_MAX = 512
_I32 = (-(2 ** 31), 2 ** 31 - 1)


def _current_stream(device_index: int):
    """The stream handle JITFunction.run would launch on."""
    return triton.runtime.driver.active.get_current_stream(device_index)


def _launch_hooks_active() -> bool:
    """Triton launch hooks (e.g. proton / the profiler) need JITFunction.run's metadata."""
    rt = triton.knobs.runtime
    hooks = (rt.launch_enter_hook, rt.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


_LENGTH_GENERIC: Dict[int, object] = {}


def for_lengths(kernel, *lengths: int):
    """``kernel``, or for any length equal to 1 its twin compiled with ``LENGTH_ARGS``
    ``do_not_specialize``.

    Triton compiles a separate kernel for an int argument equal to 1, folding it in as a
    constant. With the lengths folded to 1, the softmax backward's dQ kernel (bf16, causal,
    D32) makes ptxas segfault on sm_90 (``PTXASError ... error code -11``;
    ``python -m benchmarks.checks.tiny_shapes`` reproduces it). One-token documents and prompts
    therefore run the kernel every other length runs, with the lengths as run-time values;
    every other length keeps Triton's usual specialisation (multiples of 16 included), so
    the kernels users time are unchanged."""
    if _INTERPRETED or 1 not in lengths:
        return kernel
    twin = _LENGTH_GENERIC.get(id(kernel))
    if twin is None:
        twin = _LENGTH_GENERIC[id(kernel)] = triton.runtime.jit.JITFunction(kernel.fn, do_not_specialize=LENGTH_ARGS)
    return twin


def launch_key(kernel, device_index: int, args: tuple, meta: dict) -> tuple:
    """Cache key of one launch, at least as fine as Triton's own specialization: every
    tensor's dtype and 16-byte alignment of its pointer, every int's exact value (finer
    than Triton's int32/int64 / ==1 / %16 classes, so a hit can never pick a kernel built
    for other values), floats by type only (Triton never specializes them), ``None``, every
    constexpr and launch option (``meta``), the kernel and the device."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            parts.append(("b", a))
        elif isinstance(a, int):
            parts.append(a)
        elif isinstance(a, float):
            parts.append(float)
        elif a is None:
            parts.append(None)
        else:
            raise TypeError(f"launch_key: unsupported kernel argument type {type(a).__name__}")
    return (id(kernel), device_index, tuple(parts), tuple(sorted(meta.items())))


def _full_args(kernel, args: tuple, meta: dict):
    """Positional values of every kernel parameter (constexprs included, in signature
    order), as ``JITFunction.run`` hands them to ``CompiledKernel.run``; None if a
    parameter has neither a value nor a default."""
    names = kernel.arg_names
    out = list(args)
    for p in kernel.params[len(args):]:
        if p.name in meta:
            out.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            return None
    return out if len(out) == len(names) else None


def _check_split(args: tuple, ntensors: int) -> None:
    """The contract of ``launch(..., ntensors=k)``: tensors first, then plain Python scalars."""
    for i, a in enumerate(args):
        is_t = isinstance(a, torch.Tensor)
        if i < ntensors and not is_t:
            raise TypeError(f"launch: argument {i} must be a tensor (ntensors={ntensors}), got {type(a).__name__}")
        if i >= ntensors and (is_t or not (a is None or isinstance(a, (int, float)))):
            raise TypeError(f"launch: argument {i} after the {ntensors} tensors must be an int, float, bool or "
                            f"None, got {type(a).__name__}")


def _cache_entry(compiled, kernel, args: tuple, meta: dict):
    """``(callable, prefix, tail)`` for the hit path, or None when the compiled kernel does
    not expose what a direct launch needs. ``callable(gx, gy, gz, stream, *prefix, *args,
    *tail)`` launches: the driver's C launcher itself where the kernel needs no global or
    profile scratch (what ``CudaLauncher.__call__`` would pass then: no scratch, the
    cooperative-grid and PDL flags), else ``CompiledKernel.run``."""
    full = _full_args(kernel, args, meta)
    if full is None or getattr(compiled, "function", None) is None or not hasattr(compiled, "packed_metadata"):
        return None
    tail = tuple(full[len(args):])  # the constexpr/default tail depends only on meta (part of the key)
    run = compiled.run
    direct = getattr(run, "launch", None)
    if (callable(direct) and getattr(run, "global_scratch_size", None) == 0
            and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        pre = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
               compiled.packed_metadata, None, None, None)
        return direct, pre, tail
    return run, (compiled.function, compiled.packed_metadata, None, None, None), tail


def launch(kernel, grid: tuple, args: tuple, meta: dict, ntensors: Optional[int] = None, cached: bool = True):
    """``kernel[grid](*args, **meta)`` with the compiled kernel cached per launch key.

    A hit skips ``JITFunction.run``'s binder, option parsing and cache-key hashing and
    calls the launcher ``JITFunction.run`` itself ends with, with the same arguments. A
    miss (or the interpreter, a launch hook such as the profiler's, ``FAST_LAUNCH`` off)
    takes the normal path, which compiles if needed; its ``CompiledKernel`` is stored.

    ``ntensors=k`` (every call site in this package): ``args[:k]`` are tensors and the rest
    ints, floats, bools or None, each position keeping its Python type from call to call.
    The key is then built in C loops (``launch_key``'s per-argument Python cost was most
    of a launch's host time): each tensor's dtype and 16-byte alignment, the scalar tail
    by value (floats too: a new ``scale`` is a new entry, never a wrong one), ``meta`` in
    insertion order, kernel and device. The split
    is checked on every normal-path call (the interpreter's CPU tests cover each call
    site). ``ntensors=None``: ``launch_key`` (any argument order). ``cached=False``: the
    normal path always (arguments the cached launch does not handle, e.g. the TMA path's
    tensor descriptors, which Triton's launcher expands)."""
    if _INTERPRETED or not FAST_LAUNCH or not cached or _launch_hooks_active():
        if ntensors is not None and cached:
            _check_split(args, ntensors)
        return kernel[grid](*args, **meta)
    dev = torch.cuda.current_device()
    if ntensors is None:
        key = launch_key(kernel, dev, args, meta)
    else:
        try:
            key = (id(kernel), dev, tuple(meta.items()),
                   tuple([(t.dtype, not t.data_ptr() & 15) for t in args[:ntensors]]), args[ntensors:])
        except AttributeError:
            _check_split(args, ntensors)  # raises the TypeError that names the argument
            raise
    hit = _LAUNCH_CACHE.get(key)
    if hit is None:
        if ntensors is not None:
            _check_split(args, ntensors)
        compiled = kernel[grid](*args, **meta)
        entry = _cache_entry(compiled, kernel, args, meta)
        if entry is not None:
            if len(_LAUNCH_CACHE) >= _LAUNCH_CACHE_MAX:
                _LAUNCH_CACHE.clear()
            _LAUNCH_CACHE[key] = entry + (compiled,)
        return compiled
    fn, pre, tail, compiled = hit
    if len(grid) == 2:
        fn(grid[0], grid[1], 1, _current_stream(dev), *pre, *args, *tail)
    else:
        g = tuple(grid) + (1, 1)
        fn(g[0], g[1], g[2], _current_stream(dev), *pre, *args, *tail)
    return compiled


# ----------------------------------------------------------------------------------------
# Keyword launches (module docstring, *Keyword launches*)
# ----------------------------------------------------------------------------------------

_PRESENCE: Dict[object, Dict[str, Tuple[str, ...]]] = {}  # kernel.fn -> {flag: tensor names}
_BINDERS: Dict[object, "_Binder"] = {}  # kernel.fn -> its binder, built on first use
_STRIDE_AXES = "zhsd"


def presence_flags(**flags):
    """Decorator over ``@triton.jit``: ``FLAG="T"`` makes the constexpr ``FLAG`` of the
    kernel ``T is not None`` in ``launch_kw`` / ``bind_kw``; ``FLAG=("T1", "T2")``: tensors
    present or absent together (a call with one of them raises). The kernel is returned
    unchanged (a ``JITFunction``, so ``for_lengths``, ``autotuned`` and the cached launch
    see what they always saw)."""
    pairs = {f: (t,) if isinstance(t, str) else tuple(t) for f, t in flags.items()}

    def deco(kernel):
        _PRESENCE[kernel.fn] = pairs
        _BINDERS.pop(kernel.fn, None)
        return kernel
    return deco


def _stride_groups(names):
    """``[(keyword, members)]`` over a kernel's run-time parameters, in order: a run of two
    or more stride parameters ``<prefix><axis>`` (``_STRIDE_AXES`` order) is one keyword
    ``<prefix>``, every other parameter its own one-member entry (``members`` None)."""
    out, i = [], 0
    while i < len(names):
        pre, ax = names[i][:-1], names[i][-1:].lower()
        j = i
        if ((pre.startswith("s_") and len(pre) > 2) or (pre.endswith("_S") and len(pre) > 2)) \
                and ax in _STRIDE_AXES and pre not in names:
            last = _STRIDE_AXES.index(ax)
            j = i + 1
            while (j < len(names) and names[j][:-1] == pre and names[j][-1:].lower() in _STRIDE_AXES
                   and _STRIDE_AXES.index(names[j][-1:].lower()) > last):
                last = _STRIDE_AXES.index(names[j][-1:].lower())
                j += 1
        if j - i >= 2:
            out.append((pre, tuple(names[i:j])))
            i = j
        else:
            out.append((names[i], None))
            i += 1
    return out


class _Binder(NamedTuple):
    """What ``bind_kw`` needs of one kernel: its generated ``bind(tensors, scalars, absent,
    meta)`` and the names for error messages."""

    bind: object
    name: str
    keywords: Dict[str, Optional[Tuple[str, ...]]]  # keyword -> stride members (None: one parameter)
    ntensors: int  # the first ``ntensors`` keywords come in ``tensors``, the rest in ``scalars``
    flags: Dict[str, Tuple[str, ...]]


def _build_binder(kernel, ntensors: int) -> _Binder:
    """Generate the kernel's binder from its signature (once per kernel and tensor count:
    ``bind_kw``'s cache). The generated function is straight-line code -- one dict lookup
    per parameter into one tuple -- so the name-to-position mapping costs no loop and no
    keyword matching per launch; a wrong name surfaces as a KeyError or a count mismatch,
    which ``bind_kw`` turns into a TypeError naming it."""
    fn = kernel.fn
    kname = getattr(fn, "__name__", str(fn))
    runtime, constexprs = [], []
    for p in inspect.signature(fn).parameters.values():
        if "constexpr" in str(p.annotation):
            constexprs.append(p.name)
        elif constexprs:
            raise TypeError(f"{kname}: run-time parameter {p.name!r} after a constexpr; launch_kw needs the "
                            f"run-time parameters first (launch's positional tuple)")
        else:
            runtime.append(p.name)
    flags = _PRESENCE.get(fn, {})
    for flag, tensors in flags.items():
        if flag not in constexprs:
            raise TypeError(f"{kname}: presence flag {flag!r} is not a constexpr parameter of the kernel")
        for t in tensors:
            if t not in runtime:
                raise TypeError(f"{kname}: presence flag {flag!r} names {t!r}, not a run-time parameter")
    groups = _stride_groups(runtime)
    keywords = dict(groups)
    tnames = set(k for k, _ in groups[:ntensors])
    src = {k: ("_t" if k in tnames else "_s") + f"[{k!r}]" for k in keywords}
    flagged = {t for ts in flags.values() for t in ts}
    body = [f"if len(_t) != {ntensors} or len(_s) != {len(groups) - ntensors}"
            + (" or _meta.keys() & _FLAGS" if flags else "") + ": raise _Mismatch"]
    items = []
    for t in sorted(flagged):
        body.append(f"{t} = {src[t]}")
    for flag, tensors in flags.items():
        body.append(f"{flag} = {tensors[0]} is not None")
        for t in tensors[1:]:
            body.append(f"if ({t} is not None) is not {flag}: raise _together({flag!r})")
        body.append(f"if not {flag}:")
        body.append(f"    if _absent is None: raise _no_absent({flag!r})")
        body.append("    " + " = ".join(tensors) + " = _absent")
    for g, (kw, members) in enumerate(groups):
        if members is not None:
            locs = [f"_g{g}_{m}" for m in range(len(members))]
            body.append(", ".join(locs) + f", = {src[kw]}")
            items.extend(locs)
        else:
            items.append(kw if kw in flagged else src[kw])
    meta = ("{**_meta, " + ", ".join(f"{f!r}: {f}" for f in flags) + "}") if flags else "_meta"
    body.append(f"return ({', '.join(items)},), {meta}")
    code = "def bind(_t, _s, _absent, _meta):\n" + "".join(f"    {line}\n" for line in body)

    def together(flag):
        return TypeError(f"{kname}: {list(flags[flag])} must all be given or all be None ({flag})")

    def no_absent(flag):
        return TypeError(f"{kname}: {list(flags[flag])} None ({flag}=False) needs absent=, the tensor "
                         f"passed in their place")
    scope = {"_FLAGS": frozenset(flags), "_Mismatch": _Mismatch, "_together": together, "_no_absent": no_absent}
    exec(compile(code, f"<launch_kw binder of {kname}>", "exec"), scope)
    return _Binder(scope["bind"], kname, keywords, ntensors, dict(flags))


class _Mismatch(Exception):
    """Raised by a generated binder for ``bind_kw`` to explain (names, counts, flags in meta)."""


def _binder(kernel, ntensors: int) -> _Binder:
    key = (kernel.fn, ntensors)
    b = _BINDERS.get(key)
    if b is None:
        b = _BINDERS[key] = _build_binder(kernel, ntensors)
    return b


def _bad_call(b: _Binder, tensors: dict, scalars: dict, meta: dict) -> Optional[TypeError]:
    """The TypeError naming what is wrong with a call's names, stride tuples or meta, if anything."""
    kws = list(b.keywords)
    for given, want, what in ((tensors, kws[:b.ntensors], "tensors"), (scalars, kws[b.ntensors:], "scalars")):
        unknown = sorted(set(given) - set(want))
        missing = [k for k in want if k not in given]
        if unknown or missing:
            return TypeError(f"{b.name}: " + "; ".join(
                ([f"unknown parameter(s) {unknown} in {what}"] if unknown else [])
                + ([f"missing parameter(s) {missing} in {what}"] if missing else []))
                + f" ({what}: {want}; the tensors are the kernel's first parameters, the strides of one "
                  f"tensor go as one tuple, e.g. s_q=(...))")
    for kw, members in b.keywords.items():
        if members is not None:
            v = scalars.get(kw, tensors.get(kw))
            if not hasattr(v, "__len__") or len(v) != len(members):
                return TypeError(f"{b.name}: {kw} must be a tuple of {len(members)} ({', '.join(members)}), "
                                 f"got {v!r}")
    derived = sorted(set(meta) & set(b.flags))
    if derived:
        return TypeError(f"{b.name}: {derived} derived from the presence of "
                         f"{[list(b.flags[f]) for f in derived]}; do not pass them in meta")
    return None


def bind_kw(kernel, tensors: dict, scalars: dict, meta: dict, absent: Optional[torch.Tensor] = None
            ) -> Tuple[tuple, dict]:
    """``(args, meta)`` for ``kernel[grid](*args, **meta)`` from arguments by name: the
    run-time parameters in signature order (stride tuples spread, absent tensors replaced
    by ``absent``), and ``meta`` with the kernel's presence flags added (``presence_flags``).
    ``tensors`` holds the kernel's leading tensor parameters, ``scalars`` the rest (ints,
    floats, stride tuples). Raises TypeError naming the kernel and the parameter for an
    unknown, missing or misplaced name, a stride tuple of the wrong length, or a presence
    flag in ``meta``."""
    b = _binder(kernel, len(tensors))
    try:
        return b.bind(tensors, scalars, absent, meta)
    except (_Mismatch, KeyError, ValueError, TypeError):
        err = _bad_call(b, tensors, scalars, meta)
        if err is not None:
            raise err from None
        raise


def launch_kw(kernel, grid: tuple, tensors: dict, scalars: dict, meta: dict, *,
              absent: Optional[torch.Tensor] = None, cached: bool = True):
    """``launch`` by name: ``tensors`` (the kernel's leading tensor parameters, any order),
    ``scalars`` (the run-time scalars and stride tuples, any order), ``meta`` (constexprs
    and launch options, without the presence flags: those are derived). ``absent``: the
    tensor passed for tensors given as None (never dereferenced: their flag is off).
    Takes ``launch``'s cached path with ``ntensors=len(tensors)``."""
    nt = len(tensors)
    # the binder straight from its cache (bind_kw builds it, and names what is wrong with a
    # call): two Python calls fewer per launch, four to five launches per attention fwd+bwd
    b = _BINDERS.get((kernel.fn, nt))
    if b is None:
        args, meta = bind_kw(kernel, tensors, scalars, meta, absent)
    else:
        try:
            args, meta = b.bind(tensors, scalars, absent, meta)
        except (_Mismatch, KeyError, ValueError, TypeError):
            args, meta = bind_kw(kernel, tensors, scalars, meta, absent)  # raises the TypeError naming it
    return launch(kernel, grid, args, meta, nt, cached)


def default_input_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs (exactness gates); irrelevant for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton wraps it (and ``next_power_of_2``) as a
    ``ConstexprFunction``, slow on the launch path; these are plain ints."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``)."""
    return 1 << max(0, int(x) - 1).bit_length()



_BLOCK_D: Dict[int, int] = {}  # block_d by head dim: asked on every launch of a host-bound call


def block_d(d: int) -> int:
    """The head-dim tile of the attention kernels: a power of two, at least 16 (``tl.dot``'s
    minimum); a head dim below it is masked inside the kernels."""
    b = _BLOCK_D.get(d)
    if b is None:
        b = _BLOCK_D[d] = max(16, next_pow2(int(d)))
    return b

def autotune_enabled() -> bool:
    """``NEMO_SSA_AUTOTUNE=1`` switches the GPU kernels to ``triton.autotune`` over the
    candidate lists (the static tables are then ignored); never under the interpreter."""
    return not _INTERPRETED and env.autotune()


_AUTOTUNED: Dict[str, object] = {}


def autotuned(name: str, kernel, cands, block_names, key):
    """Build (once) an autotuned wrapper of ``kernel`` over ``cands`` = (bm, bn, w, s)."""
    if name not in _AUTOTUNED:
        cfgs = [triton.Config({block_names[0]: bm, block_names[1]: bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s in cands]
        _AUTOTUNED[name] = triton.autotune(configs=cfgs, key=key)(kernel)
    return _AUTOTUNED[name]


def _packed_strides(t: torch.Tensor) -> Tuple[int, int, int, int]:
    s = t.stride()
    return 0, s[1], s[0], s[2]


def zhsd_stride_fn(varlen: bool) -> Callable[[torch.Tensor], Tuple[int, int, int, int]]:
    """``t -> (batch, head, seq, dim) strides`` of ``[B, H, S, D]`` or packed ``[T, H, D]``
    tensors. Dense: ``Tensor.stride`` itself -- a launcher takes the strides of four to
    seven tensors per launch, and a C call in place of a Python one each is a measurable
    share of a host-bound attention call."""
    return _packed_strides if varlen else torch.Tensor.stride


def stat_strides(M: torch.Tensor, varlen: bool) -> Tuple[int, int, int]:
    """(batch, head, row) strides of ``M`` ``[B, Hq, Sq]`` or packed ``[Hq, T_q]``."""
    s = M.stride()
    if varlen:
        return 0, s[0], s[1]
    return s


def param_ptrs(n: Optional[torch.Tensor], b: Optional[torch.Tensor], dummy: torch.Tensor):
    """Kernel pointers for ``n``, ``b`` (read in-kernel as fp32, no host op); ``dummy``
    (never dereferenced) for softmax."""
    if n is None or b is None:
        return dummy, dummy
    return n, b  # the launcher only reads data_ptr(): no detach (a host op per call)
