"""Config-level checks: every unsupported combination fails before anything is built.

``check_parallel`` validates a parallel layout against an attention and the model's
shape; ``check_run_config`` validates a whole launcher configuration (``attention=``,
``policy=``, ``train.*``, parallel sizes, the ``model.*`` options) and is what
``scripts/pretrain.py`` calls first.
Each failure is one ``ValueError`` / ``NotImplementedError`` line naming the supported
values. Pure Python (no torch / megatron import): cheap enough to fuzz
(nemo_ssa/config_fuzz.py, tests/test_config_fuzz.py).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from nemo_ssa.config.policy import ATTENTIONS, PINNED, resolve_attention

#: attentions that replace the whole self attention (no core attention): TP/CP refused
_NSA_FAMILY = tuple(n for n, a in ATTENTIONS.items() if a.family == "nsa")
#: attentions with context parallel (all-gathered K/V, nemo_ssa/megatron/parallel.py)
CP_ATTENTIONS = tuple(n for n in ATTENTIONS if n not in _NSA_FAMILY)
#: attentions with tensor parallel (SSA's n/b gradients all-reduced over the TP group)
TP_ATTENTIONS = CP_ATTENTIONS
PRECISIONS = ("bf16-mixed", "16-mixed", "32")
#: train.progress_bar_values (nemo_ssa.nemo.callbacks.LightningLogCallback): keep = Lightning's per-batch
#: read of the progress-bar values, drop = logged without prog_bar where no progress bar is shown
PROGRESS_BAR_VALUES = ("keep", "drop")
POLICIES = ("pinned", "free")


def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if int(value) < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _impl(attention: str) -> str:
    """``ssa`` -> the family's name for the checks (both of its kernels support the same)."""
    return "ssa_reference" if attention == "ssa" else attention


def check_parallel(
    *,
    attention: str,
    world: int,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    pipeline_parallel: int = 1,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    arch: Optional[Mapping[str, Any]] = None,
) -> int:
    """Validate a layout; returns the data-parallel size (``world / (tp * cp)``).

    Raises ValueError (sizes that do not tile) or NotImplementedError (a combination the
    attentions do not support), each naming what is supported.
    """
    name = _impl(attention)
    if name not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is unknown; known: {', '.join(sorted(ATTENTIONS) + ['ssa'])}")
    world = _int("world size (num_nodes x num_gpus_per_node)", world)
    tp = _int("tensor_parallel", tensor_parallel)
    cp = _int("context_parallel", context_parallel)
    pp = _int("pipeline_parallel", pipeline_parallel)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={sequence_parallel!r} must be true or false")
    if pp != 1:
        raise NotImplementedError(f"pipeline_model_parallel_size={pp} is not supported with the nemo_ssa layer spec "
                                  "(supported: 1; use tensor/context/data parallel)")
    if world % (tp * cp):
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel x context_parallel = {tp * cp} "
                         f"(supported: world = dp x tp x cp)")
    dp = world // (tp * cp)
    if tp > 1 and name not in TP_ATTENTIONS:
        raise NotImplementedError(f"attention={attention}: tensor_parallel={tp} is not supported (supported: 1; "
                                  f"tensor parallel runs {', '.join(TP_ATTENTIONS)})")
    if cp > 1 and name not in CP_ATTENTIONS:
        raise NotImplementedError(f"attention={attention}: context_parallel={cp} is not supported (supported: 1; "
                                  f"context parallel runs {', '.join(CP_ATTENTIONS)})")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=true needs tensor_parallel > 1 (supported: sequence_parallel=false at TP 1)")
    if arch:
        heads = _int("num_attention_heads", arch.get("num_attention_heads", 1))
        groups = _int("num_query_groups", arch.get("num_query_groups") or heads)
        if heads % tp or groups % tp:
            raise ValueError(f"tensor_parallel={tp} must divide num_attention_heads={heads} and num_query_groups="
                             f"{groups} (supported: a common divisor, e.g. {math.gcd(heads, groups)})")
    if seq_length is not None:
        seq = _int("seq_length", seq_length)
        if cp > 1 and seq % (2 * cp):
            raise ValueError(f"seq_length={seq} must be a multiple of 2 x context_parallel = {2 * cp} "
                             "(megatron's load-balanced split gives every rank two chunks)")
        if sequence_parallel and (seq // cp) % tp:
            raise ValueError(f"seq_length={seq} / context_parallel={cp} must be a multiple of tensor_parallel={tp} "
                             "with sequence_parallel=true")
    if micro_batch_size is not None and global_batch_size is not None:
        mbs = _int("micro_batch_size", micro_batch_size)
        gbs = _int("global_batch_size", global_batch_size)
        if gbs % (mbs * dp):
            raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size x data parallel = "
                             f"{mbs} x {dp} = {mbs * dp} (data parallel = world / (tp x cp))")
    return dp


FUSED_MLP_VALUES = ("auto", "true", "false")


def check_fused_mlp(value: Any, tensor_parallel: Any = 1, sequence_parallel: bool = False) -> None:
    """``model.fused_mlp``: auto / true / false (bools and None = auto accepted); ``true``
    needs tensor parallel 1 (the fused MLP's GEMMs take whole weights). One-line ValueError."""
    ok = value is None or isinstance(value, bool) or (
        isinstance(value, str) and value.strip().lower() in FUSED_MLP_VALUES)
    if not ok:
        raise ValueError(f"model.fused_mlp={value!r} is not supported (supported: auto, true, false)")
    on = value is True or (isinstance(value, str) and value.strip().lower() == "true")
    tp = 1 if tensor_parallel is None else tensor_parallel
    if on and (tp != 1 or sequence_parallel):
        raise ValueError(f"model.fused_mlp=true needs tensor_parallel=1 without sequence parallel (got "
                         f"tensor_parallel={tp}, sequence_parallel={sequence_parallel}); supported: fused_mlp=auto "
                         "(megatron's MLP at tensor_parallel > 1) or false")


def check_fused_layernorm(value: Any) -> None:
    """``model.fused_layernorm``: auto / true / false (bools and None = auto accepted). Whether
    ``true`` fits the model (its hidden size and dtype) is decided when the model is built
    (nemo_ssa/megatron/layernorm.py). One-line ValueError."""
    ok = value is None or isinstance(value, bool) or (
        isinstance(value, str) and value.strip().lower() in FUSED_MLP_VALUES)
    if not ok:
        raise ValueError(f"model.fused_layernorm={value!r} is not supported (supported: auto, true, false)")


CUDA_GRAPHS_VALUES = ("auto", "none", "local", "full")
#: attentions whose layers megatron-core's local CUDA graphs captured and replayed on a GPU
#: (the attention table's ``cuda_graphs`` rows)
CUDA_GRAPH_ATTENTIONS = tuple(n for n, a in ATTENTIONS.items() if a.cuda_graphs)
#: megatron-core releases (major.minor) on which NeMo's trainer ran with graphs and passed the
#: checks before the default (loss parity over 1,000 steps, killed and resumed:
#: scripts/device/graphs_default.py, docs/results/2026-11-29-cuda-graphs-nemo); ``auto`` picks
#: ``local`` only on these, ``local`` itself runs on any supported release
CUDA_GRAPHS_MEGATRON = ("0.15",)


def check_cuda_graphs(value: Any, *, cuda: Optional[bool] = None, attention: Optional[str] = None,
                      tensor_parallel: Any = 1, context_parallel: Any = 1, sequence_parallel: bool = False,
                      env: Optional[Mapping[str, str]] = None,
                      name: str = "model.cuda_graphs") -> str:
    """``model.cuda_graphs``: ``auto`` (the launcher's default: :func:`resolve_cuda_graphs`
    picks), ``none`` (None = unset = none), ``local``, megatron-core's layerwise CUDA graphs
    (``cuda_graph_impl='local'``, nemo_ssa/megatron/cuda_graphs.py), or ``full``, megatron's
    whole-iteration graph (forward, backward and the gradient finalisation of a step in one
    graph: ``FullCudaGraphWrapper``, which NeMo's step puts around megatron's schedule). Returns
    the value, lower-case; ``auto`` is always accepted (it falls back to none where local is not).

    ``local`` and ``full`` need a CUDA device (``cuda=None``: not known where the check runs, e.g. a recipe
    built on a login node); an attention in :data:`CUDA_GRAPH_ATTENTIONS` (``ssa`` is the pinned
    kernel: graphs run on CUDA); tensor and context parallel 1 (the graphs would capture the
    collectives inside each layer, which no run has checked; data parallel reduces outside
    them); and no ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF``
    (megatron-core 0.15 refuses it; ``env=None`` reads this process's environment).
    One-line ValueError (a value or device that cannot work) or NotImplementedError (a
    combination not supported yet).
    """
    if value is None:
        return "none"
    if not isinstance(value, str) or value.strip().lower() not in CUDA_GRAPHS_VALUES:
        raise ValueError(f"{name}={value!r} is not supported (supported: {', '.join(CUDA_GRAPHS_VALUES)})")
    value = value.strip().lower()
    if value in ("none", "auto"):
        return value
    if cuda is False:
        raise ValueError(f"{name}={value} needs a CUDA device (CUDA graphs replay GPU work); supported without "
                         "one: none")
    impl = PINNED.pinned_kernel if attention == "ssa" else attention
    if impl is not None and impl not in CUDA_GRAPH_ATTENTIONS:
        raise NotImplementedError(f"{name}={value} with attention={attention} is not supported (supported: "
                                  f"{', '.join(CUDA_GRAPH_ATTENTIONS)} and ssa, the attentions whose layers ran "
                                  "under the graphs; as the story's baseline: compare_to=[softmax_triton])")
    tp = 1 if tensor_parallel is None else tensor_parallel
    cp = 1 if context_parallel is None else context_parallel
    if tp != 1 or cp != 1 or sequence_parallel:
        raise NotImplementedError(f"{name}={value} with tensor_parallel={tp}, context_parallel={cp}, "
                                  f"sequence_parallel={sequence_parallel} is not supported (supported: tensor and "
                                  "context parallel 1: the graphs would capture the collectives inside each layer, "
                                  "which no run has checked)")
    alloc = (os.environ if env is None else env).get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc:
        raise ValueError(f"{name}={value} with PYTORCH_CUDA_ALLOC_CONF={alloc!r}: megatron-core refuses "
                         "expandable_segments:True with CUDA graphs (supported: PYTORCH_CUDA_ALLOC_CONF without it)")
    return value


#: megatron-core releases whose whole-iteration graph NeMo 2.7's step reaches
#: (``cuda_graph_scope == "full_iteration"``, a string: 0.16 made the scope a list)
FULL_GRAPH_MEGATRON = ("0.15",)


def installed_megatron_version() -> Optional[str]:
    """megatron-core's version in this environment; None where it is not importable."""
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # not installed as a distribution (a source tree on PYTHONPATH)
        try:
            from megatron.core.package_info import __version__

            return str(__version__)
        except Exception:
            return None


def check_full_graph(*, world: int, megatron_version: Optional[str], name: str = "model.cuda_graphs") -> None:
    """``full`` beyond :func:`check_cuda_graphs`: one process (the graph would capture the
    data-parallel reduction and the sync-free step's checks of it, which no run has checked) and
    a megatron-core in :data:`FULL_GRAPH_MEGATRON` (``None``: not known where the check runs)."""
    if int(world) != 1:
        raise NotImplementedError(f"{name}=full with {world} processes is not supported (supported: full on one "
                                  "GPU; local with data parallel)")
    release = ".".join(str(megatron_version).split(".")[:2]) if megatron_version else None
    if release is not None and release not in FULL_GRAPH_MEGATRON:
        raise NotImplementedError(f"{name}=full with megatron-core {megatron_version} is not supported (supported: "
                                  f"megatron-core {', '.join(r + '.x' for r in FULL_GRAPH_MEGATRON)}, where NeMo's "
                                  "step wraps the schedule in megatron's FullCudaGraphWrapper; local elsewhere)")


def cuda_graph_attention(attention: Optional[str]) -> bool:
    """The attention's layers have run under megatron's local graphs (``ssa``: its pinned kernel)."""
    return (PINNED.pinned_kernel if attention == "ssa" else attention) in CUDA_GRAPH_ATTENTIONS


def resolve_cuda_graphs(value: Any, *, cuda: Optional[bool], attention: Optional[str], world: int = 1,
                        tensor_parallel: Any = 1, context_parallel: Any = 1, sequence_parallel: bool = False,
                        megatron_version: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                        name: str = "model.cuda_graphs") -> Tuple[str, Optional[str]]:
    """What ``model.cuda_graphs`` runs with, and why: ``(none | local | full, reason)``. The one
    place that decides ``auto``; ``none`` / ``local`` / ``full`` are checked
    (:func:`check_cuda_graphs`, and :func:`check_full_graph` for ``full``) and returned with
    reason None. ``auto`` never picks ``full`` (not yet run against local on a GPU).

    ``auto`` is ``local`` only where everything the checks before the default covered holds: a
    CUDA device, one process (data parallel with graphs has not run), an attention whose layers
    ran under graphs (for a story: every one of its attentions, so its speeds compare like with
    like -- the caller passes each), tensor / context parallel 1, no expandable segments, and a
    megatron-core release in :data:`CUDA_GRAPHS_MEGATRON`. Otherwise ``none``, with the first
    condition that failed.
    """
    value = check_cuda_graphs(value, cuda=cuda, attention=attention, tensor_parallel=tensor_parallel,
                              context_parallel=context_parallel, sequence_parallel=sequence_parallel, env=env,
                              name=name)
    if value == "full":
        check_full_graph(world=world, megatron_version=megatron_version, name=name)
    if value != "auto":
        return value, None
    tp = 1 if tensor_parallel is None else tensor_parallel
    cp = 1 if context_parallel is None else context_parallel
    alloc = (os.environ if env is None else env).get("PYTORCH_CUDA_ALLOC_CONF", "")
    release = ".".join(str(megatron_version or "").split(".")[:2])
    if not cuda:
        why = "no CUDA device" if cuda is False else "the device is not known where the recipe is built"
    elif not cuda_graph_attention(attention):
        why = (f"attention={attention} has not run under graphs (they have: {', '.join(CUDA_GRAPH_ATTENTIONS)} "
               "and ssa)")
    elif int(world) != 1:
        why = f"{world} processes: data parallel with graphs has not run; model.cuda_graphs=local to try it"
    elif tp != 1 or cp != 1 or sequence_parallel:
        why = "tensor / context / sequence parallel"
    elif "expandable_segments:True" in alloc:
        why = "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which megatron-core refuses with graphs"
    elif release not in CUDA_GRAPHS_MEGATRON:
        why = (f"megatron-core {megatron_version or '(unknown)'}: graphs have run through NeMo on "
               f"{', '.join(r + '.x' for r in CUDA_GRAPHS_MEGATRON)} only; model.cuda_graphs=local to try it")
    else:
        return "local", (f"one GPU, attention={attention}, megatron-core {megatron_version}: megatron's layerwise "
                         "graphs (model.cuda_graphs=none turns them off)")
    return "none", why


def held_out_every(max_steps: int, val_check_interval: Optional[int]) -> Tuple[int, Optional[str]]:
    """Steps between held-out evaluations, and a line to print when the configured value was
    changed: ``None`` is one evaluation at the end; a value above ``max_steps`` is clamped to
    it (Lightning stops such a launch inside ``fit`` with a traceback about "training batches",
    and a user who shortens ``max_steps`` under a train preset's interval meets exactly that)."""
    steps = int(max_steps)
    if val_check_interval is None:
        return steps, None
    every = _int("train.val_check_interval", val_check_interval)
    if every > steps:
        return steps, (f"train.val_check_interval={every} is beyond train.max_steps={steps}: the held-out "
                       f"loss is taken once, at step {steps}")
    return every, None


_TRAIN_INTS = ("seq_length", "micro_batch_size", "global_batch_size", "max_steps", "log_every_n_steps")


def check_run_config(cfg: Mapping[str, Any], *, cuda: bool, world: Optional[int] = None) -> Dict[str, Any]:
    """Validate a resolved launcher config (``scripts/pretrain.py``'s) before training.

    Args:
        cfg: the resolved config as a plain dict (``attention``, ``policy``, ``seed``,
            ``train`` resolved from ``train=auto``, ``model``, ``resume``, ``stop_after``).
        cuda: whether the run takes the GPU path.
        world: the world size (``None``: ``train.num_nodes x train.num_gpus_per_node``).

    Returns:
        ``{"attention": implementation name, "dp": data-parallel size}``.
    """
    policy = cfg.get("policy", "pinned")
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not supported (supported: {', '.join(POLICIES)})")
    att = cfg.get("attention") or {}
    if not isinstance(att, Mapping) or not att.get("name"):
        raise ValueError("attention=<name> is required (supported: " + ", ".join(sorted(ATTENTIONS) + ["ssa"]) + ")")
    options = {k: v for k, v in dict(att.get("options") or {}).items() if v is not None}
    resolved = resolve_attention(str(att["name"]), options, policy=policy, device="cuda" if cuda else "cpu")
    train = dict(cfg.get("train") or {})
    for key in _TRAIN_INTS:
        if train.get(key) is not None:
            _int(f"train.{key}", train[key])
    if train.get("warmup_steps") is not None:
        _int("train.warmup_steps", train["warmup_steps"], minimum=0)
        if train.get("max_steps") is not None and int(train["warmup_steps"]) > int(train["max_steps"]):
            raise ValueError(f"train.warmup_steps={train['warmup_steps']} must be <= train.max_steps={train['max_steps']}")
    for key in ("lr", "min_lr"):
        v = train.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v != v):
            raise ValueError(f"train.{key}={v!r} must be a number >= 0")
    if train.get("lr") is not None and train.get("min_lr") is not None and train["min_lr"] > train["lr"]:
        raise ValueError(f"train.min_lr={train['min_lr']} must be <= train.lr={train['lr']}")
    for key in ("weight_decay", "clip_grad"):
        v = train.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            raise ValueError(f"train.{key}={v!r} must be a number >= 0")
    if train.get("val_check_interval") is not None:
        _int("train.val_check_interval", train["val_check_interval"])
    if train.get("ckpt_every_n_steps") is not None:
        _int("train.ckpt_every_n_steps", train["ckpt_every_n_steps"])
    pbv = train.get("progress_bar_values")
    if pbv is not None and str(pbv).lower() not in PROGRESS_BAR_VALUES:
        raise ValueError(f"train.progress_bar_values={pbv!r} is not supported "
                         f"(supported: {', '.join(PROGRESS_BAR_VALUES)})")
    precision = train.get("precision")
    if precision is not None and str(precision) not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not supported (supported: {', '.join(PRECISIONS)})")
    if not cuda and precision is not None and str(precision) != "32":
        raise ValueError(f"train.precision={precision!r} on the CPU path (supported there: '32'; the GPU path "
                         f"takes {', '.join(PRECISIONS)})")
    if cfg.get("stop_after") is not None:
        stop = _int("stop_after", cfg["stop_after"])
        if train.get("max_steps") is not None and stop > int(train["max_steps"]):
            raise ValueError(f"stop_after={stop} must be <= train.max_steps={train['max_steps']}")
    _int("seed", cfg.get("seed", 0), minimum=0)
    nodes = _int("train.num_nodes", train.get("num_nodes") or 1)
    gpus = _int("train.num_gpus_per_node", train.get("num_gpus_per_node") or 1)
    if world is None:
        world = nodes * gpus
    model = dict(cfg.get("model") or {})
    arch = dict(model.get("cpu_arch") or {}) if not cuda else {
        "num_attention_heads": 24, "num_query_groups": 8, "hidden_size": 768}
    dopt = train.get("distributed_optimizer")
    if dopt is not None and dopt != "auto" and not isinstance(dopt, bool):
        raise ValueError(f"train.distributed_optimizer={dopt!r} is not supported (supported: true, false, auto/null)")
    dp = check_parallel(
        attention=resolved.name, world=world,
        # None = unset (1); an explicit 0 is refused by check_parallel, not read as 1
        tensor_parallel=1 if train.get("tensor_parallel") is None else train["tensor_parallel"],
        context_parallel=1 if train.get("context_parallel") is None else train["context_parallel"],
        sequence_parallel=bool(train.get("sequence_parallel") or False), pipeline_parallel=1,
        seq_length=train.get("seq_length"), micro_batch_size=train.get("micro_batch_size"),
        global_batch_size=train.get("global_batch_size"), arch=arch,
    )
    check_fused_mlp(model.get("fused_mlp", "auto"), tensor_parallel=train.get("tensor_parallel"),
                    sequence_parallel=bool(train.get("sequence_parallel") or False))
    check_fused_layernorm(model.get("fused_layernorm", "auto"))
    graphs = check_cuda_graphs(model.get("cuda_graphs"), cuda=cuda, attention=resolved.name,
                               tensor_parallel=train.get("tensor_parallel"),
                               context_parallel=train.get("context_parallel"),
                               sequence_parallel=bool(train.get("sequence_parallel") or False))
    if graphs == "full":
        check_full_graph(world=world, megatron_version=installed_megatron_version() if cuda else None)
    if arch.get("hidden_size") and arch.get("num_attention_heads"):
        head_dim = int(arch["hidden_size"]) // int(arch["num_attention_heads"])
        lo_hi = ATTENTIONS[resolved.name].head_dims
        if lo_hi and not lo_hi[0] <= head_dim <= lo_hi[1]:
            raise NotImplementedError(f"attention={resolved.name}: head dim {head_dim} (hidden_size / "
                                      f"num_attention_heads) is not supported (supported: {lo_hi[0]}..{lo_hi[1]}; "
                                      "use ssa_reference / softmax)")
    return {"attention": resolved.name, "dp": dp}
