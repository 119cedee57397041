"""Pretrain the 114M Nemotron with a selectable core attention (hydra launcher).

``python -m nemo_ssa pretrain ...`` (an installed package) and ``python scripts/pretrain.py ...``
(a checkout) run this module with the same overrides; its configuration is the hydra tree
``nemo_ssa/configs`` (``configs/`` at the repository root links to it).

    python scripts/pretrain.py                       # the story: softmax, then ssa, then the comparison
    python scripts/pretrain.py compare_to=[]         # attention=ssa only
    python scripts/pretrain.py attention=softmax compare_to=[]   # one flag differs
    python scripts/pretrain.py attention=ssa_triton compare_to=[ssa_reference]
    python scripts/pretrain.py train=gpu_9min train.max_steps=200 run_dir=runs/x compare_to=[]

On a GPU it builds ``recipes.nemotron_114m.pretrain_recipe`` and runs it through NeMo
(nemo-run's direct executor). Without CUDA, NeMo's trainer cannot run; the same recipe
(same NeMo config, our spec, same data module) then trains through a minimal
megatron-core CPU loop at a tiny size (``model.cpu_arch``). Either way the run directory
gets ``metrics.csv``, TensorBoard events, the effective attention policy and
checkpoints, and the last line printed says where.

Several GPUs / nodes / CPU ranks (README "Several GPUs"): ``train.num_gpus_per_node``,
``train.num_nodes``, ``train.tensor_parallel``, ``train.context_parallel``,
``train.sequence_parallel``, ``train.distributed_optimizer`` (auto: on with data parallel
> 1, or as the checkpoint being resumed was written). ``python scripts/pretrain.py
train.num_gpus_per_node=2 ...`` lets Lightning start the second process; ``torchrun
--nproc-per-node=2 scripts/pretrain.py ...`` (or nemo-run's torchrun / Slurm executors)
starts every rank itself -- the way to run the CPU loop on several processes. Every
configuration is validated before anything is built (``nemo_ssa.config.check``); only
global rank 0 writes the run directory's own files.

With ``compare_to=[a, b]`` (default ``[softmax]``) the launcher trains each of those
attentions and then ``attention``, each in its own process with the same overrides and
seed (so they differ only in the attention), and ends with the compare tool's plot and
summary under ``${runs_root}/compare-<names>-s<seed>``. A baseline run already finished
with the identical configuration is reused (``reuse_baselines=false`` retrains it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import subprocess
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_ssa.cli import CONFIG_DIR, child_env, compared_cuda_graphs, config_file, pretrain_command
from nemo_ssa.config.check import held_out_every
from nemo_ssa.data.passes import RECORD as PASSES_RECORD, passes_note, passes_record

log = logging.getLogger("nemo_ssa.pretrain")


def _train_cfg(cfg: DictConfig, cuda: bool) -> DictConfig:
    """``train=auto`` resolves to gpu_9min / cpu_smoke; explicit keys still override."""
    train = cfg.train
    if train.get("device", "auto") == "auto":
        name = "gpu_9min" if cuda else "cpu_smoke"
        base = OmegaConf.load(config_file("train", f"{name}.yaml"))
        overrides = {k: v for k, v in OmegaConf.to_container(train).items()
                     if k != "device" and v is not None}
        train = OmegaConf.merge(base, overrides)
    if train.device == "gpu" and not cuda:
        raise SystemExit("train config asks for a GPU (device=gpu) but CUDA is not available; "
                         "use train=cpu_smoke (or train=auto)")
    if train.get("global_batch_size") is None:
        train = OmegaConf.merge(train, {"global_batch_size": _default_global_batch(train, cuda)})
    cap = cfg.attention.get("max_micro_batch_size") if "attention" in cfg else None
    if cap and train.device == "gpu" and int(train.micro_batch_size) > int(cap) \
            and int(train.global_batch_size) % int(cap) == 0:
        # an unfused attention whose fp32 scores do not fit at the recipe's micro batch:
        # the same global batch by gradient accumulation (same curve in expectation)
        train = OmegaConf.merge(train, {"micro_batch_size": int(cap)})
    return train


def _data_parallel(train: DictConfig, cuda: bool) -> int:
    """Data-parallel size of the layout: world / (tensor parallel x context parallel)."""
    world = int(train.get("num_nodes") or 1) * int(train.get("num_gpus_per_node") or 1) if cuda \
        else _launched_world()
    return max(1, world // (int(train.get("tensor_parallel") or 1) * int(train.get("context_parallel") or 1)))


def _default_global_batch(train: DictConfig, cuda: bool) -> int:
    """``global_batch_size: null`` (train/gpu_9min): one micro batch per data-parallel rank, so
    every GPU does the step one GPU does (weak scaling) and each layout's default is valid.
    Said in one line when it differs from one GPU's; an explicit value is kept as set."""
    dp = _data_parallel(train, cuda)
    gbs = int(train.micro_batch_size) * dp
    if dp > 1 and _rank() == 0:
        print(f"[pretrain] global batch {gbs} = micro batch {train.micro_batch_size} x data parallel {dp} "
              f"(train.global_batch_size was not set; set it to fix the global batch across layouts)", flush=True)
    return gbs


def _rank() -> int:
    """This process's global rank as a launcher set it (torchrun, Slurm, Lightning's
    subprocess launcher); 0 for a plain launch (and for the process that starts the others)."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key):
            return int(os.environ[key])
    if os.environ.get("LOCAL_RANK"):  # Lightning's launcher: node rank x devices + local rank
        return int(os.environ.get("NODE_RANK", "0") or 0) * 10**6 + int(os.environ["LOCAL_RANK"])
    return 0


def _launched_world() -> int:
    """World size set by an external launcher (torchrun / Slurm); 1 otherwise."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def _data(cfg: DictConfig):
    """(prefix, tokenizer_dir): the user's dataset, or the embedded corpus (built once).

    Several processes of one node build it under a file lock: the first builds, the others
    reuse it (multi-node runs on a shared file system: build it once beforehand with
    ``scripts/build_corpus.py``)."""
    data = cfg.data
    if data.get("prefix"):
        if not data.get("tokenizer_dir"):
            raise SystemExit("data.prefix needs data.tokenizer_dir (the tokenizer the dataset was built with)")
        return str(data.prefix), str(data.tokenizer_dir)
    from nemo_ssa.data import build_corpus_locked, default_corpus_dir

    info = build_corpus_locked(data.get("dir") or default_corpus_dir(data.source), source=data.source,
                               vocab_size=int(data.vocab_size), max_bytes=data.get("max_bytes"),
                               tokenizer_from=data.get("tokenizer_from"))
    return info.prefix, info.tokenizer_dir


def _nemo_checkpoint_dir(run_dir: str, name: str) -> str:
    """Where the NeMo path keeps checkpoints (the recipe pins NeMoLogger to
    ``<run_dir>/<name>/checkpoints`` for fresh and resumed runs alike)."""
    return os.path.join(run_dir, name, "checkpoints")


def _distributed_optimizer(train: DictConfig, cfg: DictConfig, run_dir: str, name: str, cuda: bool):
    """train.distributed_optimizer: true/false as given; auto/null -> the resumed checkpoint's
    optimizer type when resuming one, else the recipe's default (on with data parallel > 1)."""
    value = train.get("distributed_optimizer")
    if value is not None and value != "auto":
        return bool(value)
    if not cfg.resume:
        return None
    from nemo_ssa.megatron.checkpoints import uses_distributed_optimizer

    if cuda:
        ckpt = nemo_loadable_checkpoint(_nemo_checkpoint_dir(run_dir, name))[0]
    else:
        from nemo_ssa.train.checkpoint_io import resume_checkpoint

        ckpt = resume_checkpoint(os.path.join(run_dir, "checkpoints"))[0]
    return uses_distributed_optimizer(ckpt) if ckpt else None


def nemo_loadable_checkpoint(checkpoint_dir: str):
    """(weights path of the checkpoint to resume, NeMo checkpoint dir to pass as
    ``resume_from_path`` or None when NeMo's own pick is that one, [(skipped, why)]).

    NeMo's AutoResume takes the newest ``-last`` checkpoint; when that one cannot load
    (``checkpoint_problem``), the newest loadable checkpoint of any step is named explicitly."""
    from nemo_ssa.megatron.checkpoints import weights_dir, checkpoint_problem, nemo_checkpoints

    last = nemo_checkpoints(checkpoint_dir)
    if not last:  # nothing NeMo would resume from: a fresh start, as without the check
        return None, None, []
    skipped = []
    for d in nemo_checkpoints(checkpoint_dir, last_only=False):
        why = checkpoint_problem(weights_dir(d))
        if why is None:
            return weights_dir(d), (None if d == last[0] else d), skipped
        skipped.append((d, why))
    return None, None, skipped


def build_recipe(cfg: DictConfig, train: DictConfig, prefix: str, tokenizer_dir: str, run_dir: str):
    from recipes import nemotron_114m
    from nemo_ssa.config.policy import resolve_attention

    options = {k: v for k, v in OmegaConf.to_container(cfg.attention.options).items() if v is not None}
    import torch

    cuda = torch.cuda.is_available()
    resolved = resolve_attention(cfg.attention.name, options, policy=cfg.policy,
                                 device="cuda" if cuda else "cpu")
    if _rank() == 0:
        resolved.write(run_dir)
    # the CPU loop's world is the launcher's (torchrun); the GPU path's is nodes x GPUs
    nodes = int(train.get("num_nodes") or 1) if cuda else 1
    gpus = int(train.get("num_gpus_per_node") or 1) if cuda else _launched_world()
    recipe = nemotron_114m.pretrain_recipe(
        dir=run_dir,
        name=f"{resolved.name}",
        num_nodes=nodes,
        num_gpus_per_node=gpus,
        tensor_parallel=int(train.get("tensor_parallel") or 1),
        context_parallel=int(train.get("context_parallel") or 1),
        sequence_parallel=bool(train.get("sequence_parallel") or False),
        attention=resolved.name,
        attention_options=resolved.options,
        policy=cfg.policy,
        data_prefix=prefix,
        tokenizer_dir=tokenizer_dir,
        seq_length=int(train.seq_length),
        micro_batch_size=int(train.micro_batch_size),
        global_batch_size=int(train.global_batch_size),
        max_steps=int(train.max_steps),
        warmup_steps=int(train.warmup_steps),
        lr=float(train.lr),
        min_lr=float(train.min_lr),
        weight_decay=float(train.weight_decay),
        clip_grad=float(train.clip_grad),
        seed=int(cfg.seed),
        log_every_n_steps=int(train.log_every_n_steps),
        val_check_interval=held_out_every(int(train.max_steps), train.get("val_check_interval"))[0],
        limit_val_batches=int(train.get("limit_val_batches") or 1),
        ckpt_every_n_steps=train.get("ckpt_every_n_steps"),
        vocab_size=cfg.model.get("vocab_size"),
        fused_cross_entropy=cfg.model.get("fused_cross_entropy", "auto"),
        fused_mlp=cfg.model.get("fused_mlp", "auto"),
        fused_layernorm=cfg.model.get("fused_layernorm", False),
        cuda_graphs=cfg.model.get("cuda_graphs") or "none",
        init_on_cpu=bool(cfg.model.get("init_on_cpu", False)),
        num_workers=int(train.get("num_workers", 2)),
        precision=str(train.precision),
        use_distributed_optimizer=_distributed_optimizer(train, cfg, run_dir, resolved.name, cuda),
    )
    return recipe, resolved


def launcher_callbacks(cfg, train, recipe, resolved, run_dir) -> None:
    """The trainer's callbacks on the launcher's GPU path: the recipe's, less NeMo's
    TimingCallback, plus the metrics log (which prints the progress), the resume cadence, the
    warm-up, the profiler and the early stop as asked; Lightning's progress bar off."""
    import nemo_run as run

    from nemo_ssa.tools.metrics_log import flops_per_token
    from nemo_ssa.nemo.callbacks import AttentionWarmupCallback, MetricsCallback, ResumeCadenceCallback

    # The launcher prints the progress itself (MetricsCallback(progress=True), from the rows it
    # reads once per log_every_n_steps): NeMo's progress printer and TimingCallback log and read
    # metrics through Lightning on every step, host time the micro-batch-8 step pays for
    # (docs/training-step.md). A recipe used without the launcher keeps both.
    recipe.trainer.enable_progress_bar = False
    callbacks = [c for c in (recipe.trainer.callbacks or [])
                 if getattr(getattr(c, "__fn_or_cls__", None), "__name__", "") != "TimingCallback"]
    # with the progress bar off, train.progress_bar_values=drop (the default) stops Lightning's
    # per-batch read of the values a bar would show (LightningLogCallback, docs/training-step.md)
    for c in callbacks:
        if getattr(getattr(c, "__fn_or_cls__", None), "__name__", "") == "LightningLogCallback":
            c.progress_bar_values = str(train.get("progress_bar_values") or "drop")
    mc = recipe.model.config
    vocab = mc.vocab_size or -(-int(cfg.data.get("vocab_size") or 50257) // 128) * 128  # padded as megatron pads
    fpt = flops_per_token(int(mc.hidden_size), int(mc.num_layers), int(mc.ffn_hidden_size),
                          int(mc.kv_channels or mc.hidden_size // mc.num_attention_heads),
                          int(mc.num_query_groups or mc.num_attention_heads), int(vocab), int(train.seq_length))
    callbacks.append(run.Config(MetricsCallback, run_dir=run_dir, seq_length=int(train.seq_length),
                                global_batch_size=int(train.global_batch_size), attention=resolved.name,
                                flush_every=int(train.log_every_n_steps), flops_per_token=fpt, progress=True))
    callbacks.append(run.Config(ResumeCadenceCallback))
    if cfg.warmup:
        callbacks.append(run.Config(AttentionWarmupCallback, micro_batch_size=int(train.micro_batch_size),
                                    seq_length=int(train.seq_length)))
    if cfg.get("profile") and cfg.profile.get("start"):
        from nemo_ssa.nemo.callbacks import ProfilerCallback

        graphs = str(cfg.model.get("cuda_graphs") or "none").lower()
        graphed = graphs in ("local", "full")
        if graphed:
            print(f"[pretrain] profile under model.cuda_graphs={graphs}: kernel families and the trace, no module "
                  "table (its ranges are hooks a graph replay does not run, and megatron refuses on a graphed "
                  "layer)", flush=True)
        callbacks.append(run.Config(ProfilerCallback, run_dir=run_dir, start=int(cfg.profile.start),
                                    num_steps=int(cfg.profile.steps), with_stack=bool(cfg.profile.with_stack),
                                    module_ranges=not graphed))
    if cfg.get("stop_after"):
        from nemo_ssa.nemo.callbacks import StopAfterCallback

        callbacks.append(run.Config(StopAfterCallback, step=int(cfg.stop_after)))
    recipe.trainer.callbacks = callbacks


def run_gpu(cfg, train, recipe, resolved, run_dir) -> None:
    import nemo_run as run

    launcher_callbacks(cfg, train, recipe, resolved, run_dir)
    recipe.resume.resume_if_exists = bool(cfg.resume)
    if cfg.resume:
        ckpt, explicit, skipped = nemo_loadable_checkpoint(_nemo_checkpoint_dir(run_dir, resolved.name))
        if explicit is not None:
            recipe.resume.resume_from_path = explicit
        if _rank() == 0:
            for d, why in skipped:
                print(f"[pretrain] resume: skipped {d}: {why}", flush=True)
            print(f"[pretrain] resume: {ckpt or 'no loadable checkpoint found, starting from step 0'}", flush=True)
    strategy = recipe.trainer.strategy
    world = int(recipe.trainer.num_nodes) * int(recipe.trainer.devices)
    if _rank() == 0:
        print(f"[pretrain] path: NeMo trainer on {os.environ.get('CUDA_VISIBLE_DEVICES', 'all')} GPU(s), "
              f"attention={resolved.name}, world {world} = DP{world // (strategy.tensor_model_parallel_size * strategy.context_parallel_size)}"
              f" x TP{strategy.tensor_model_parallel_size}{'+SP' if strategy.sequence_parallel else ''}"
              f" x CP{strategy.context_parallel_size}, distributed optimizer "
              f"{'on' if recipe.optim.config.use_distributed_optimizer else 'off'}, CUDA graphs "
              f"{_graphs_label(recipe.model.config)}", flush=True)
    run.run(recipe, direct=True)
    _end_process_group()


def _graphs_label(config) -> str:
    """The path line's CUDA graphs: megatron's impl, and its scope where that is the whole
    iteration (model.cuda_graphs=full is impl 'local' with that scope; 'local' alone read as the
    layer graphs)."""
    impl = getattr(config, "cuda_graph_impl", None) or "none"
    scope = getattr(config, "cuda_graph_scope", None)
    scopes = [scope] if isinstance(scope, str) else list(scope or [])
    scopes = [getattr(s, "name", s) for s in scopes]
    return f"{impl} (full_iteration)" if "full_iteration" in scopes else impl


def _end_process_group() -> None:
    """Leave the NCCL world together. NeMo returns with the process group still up; on two
    launchers (nodes) the rank whose agent hosts the rendezvous store can exit first, and the
    other's NCCL watchdog then polls a store that is gone instead of exiting (seen on 2 x
    H100 with two torchrun processes). A barrier and an explicit destroy end both cleanly."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def run_cpu(cfg, train, recipe, run_dir) -> None:
    from nemo_ssa.train.cpu_recipe import shrink_for_cpu
    from nemo_ssa.train.loop import train_on_cpu

    heldout_every = train.get("val_check_interval")
    if heldout_every:  # unset on CPU: no held-out evaluation (the GPU path's null is one at the end)
        heldout_every = held_out_every(int(train.max_steps), heldout_every)[0]
    shrink_for_cpu(recipe, arch=OmegaConf.to_container(cfg.model.cpu_arch), heldout=bool(heldout_every))
    train_on_cpu(
        recipe, run_dir,
        max_steps=int(train.max_steps),
        log_every=int(train.log_every_n_steps),
        ckpt_every=train.get("ckpt_every_n_steps"),
        resume=bool(cfg.resume),
        warmup=bool(cfg.warmup),
        seed=int(cfg.seed),
        stop_after=int(cfg.stop_after) if cfg.get("stop_after") else None,
        heldout_every=int(heldout_every) if heldout_every else None,
        heldout_batches=int(train.get("limit_val_batches") or 1),
    )


# ---------------------------------------------------------------------------- one run

_NOT_IN_IDENTITY = ("resume", "compare_to", "reuse_baselines", "reuse_if_complete", "stop_after", "profile")
_ARTIFACTS = ("metrics.csv", "summary.json", "complete.json", "tb", "checkpoints", "ranks")


def _nemo_log_dirs(run_dir: str) -> tuple:
    """NeMo's per-attention log directories in ``run_dir`` (``<run_dir>/<name>/``, holding
    its checkpoints): set aside with the rest on a fresh run, or a ``resume=true`` would
    find a stale run's checkpoint there."""
    from nemo_ssa.config.attentions import ATTENTIONS

    return tuple(n for n in ATTENTIONS if os.path.isdir(os.path.join(run_dir, n)))


#: options added after runs were recorded, at the value that means "as before": left out of the
#: identity there, so a run finished before the option existed is still reused (a sweep resumed
#: across sessions from its returned run directories)
_NEUTRAL_DEFAULTS = {("data", "tokenizer_from"): None, ("model", "cuda_graphs"): "none"}
#: options that change how a step is logged, not what it computes: never in the identity, so a run
#: finished under either value is reused under the other
_LOGGING_ONLY = (("train", "progress_bar_values"),)


def _identity(resolved_cfg: dict) -> str:
    """Hash of what determines a run's result (not how it was launched or resumed)."""
    ident = {k: v for k, v in resolved_cfg.items() if k not in _NOT_IN_IDENTITY}
    for (group, key), neutral in _NEUTRAL_DEFAULTS.items():
        sub = ident.get(group)
        if isinstance(sub, dict) and key in sub and sub[key] == neutral:
            ident[group] = {k: v for k, v in sub.items() if k != key}
    for group, key in _LOGGING_ONLY:
        if isinstance(ident.get(group), dict):
            ident[group] = {k: v for k, v in ident[group].items() if k != key}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _finished(run_dir: str, identity: str) -> bool:
    path = os.path.join(run_dir, "complete.json")
    if not os.path.isfile(path):
        return False
    try:
        return json.load(open(path)).get("identity") == identity
    except (OSError, ValueError):
        return False


def _megatron_version() -> Optional[str]:
    from nemo_ssa.config.check import installed_megatron_version

    return installed_megatron_version()


def _decide_cuda_graphs(cfg: DictConfig, train: DictConfig, cuda: bool, say: bool = True) -> str:
    """``model.cuda_graphs=auto`` made ``none`` or ``local`` in ``cfg`` (``resolve_cuda_graphs``
    decides; the launcher prints what and why), so the run's config.yaml and identity hold what
    it ran with."""
    from nemo_ssa.config.check import resolve_cuda_graphs
    from nemo_ssa.config.policy import resolve_attention

    value = cfg.model.get("cuda_graphs")
    if value is None or str(value).strip().lower() != "auto":
        return str(value or "none").lower()
    options = {k: v for k, v in OmegaConf.to_container(cfg.attention.options).items() if v is not None}
    name = resolve_attention(cfg.attention.name, options, policy=cfg.policy,
                             device="cuda" if cuda else "cpu").name
    world = int(train.get("num_nodes") or 1) * int(train.get("num_gpus_per_node") or 1) if cuda \
        else _launched_world()
    decided, why = resolve_cuda_graphs(
        "auto", cuda=cuda, attention=name, world=world, tensor_parallel=train.get("tensor_parallel"),
        context_parallel=train.get("context_parallel"), sequence_parallel=bool(train.get("sequence_parallel") or False),
        megatron_version=_megatron_version() if cuda else None)
    with open_dict(cfg):
        cfg.model.cuda_graphs = decided
    if say and cuda:  # the CPU loop has no graphs to speak of
        print(f"[pretrain] model.cuda_graphs=auto -> {decided}: {why}", flush=True)
    return decided


def _check_config(cfg: DictConfig, cuda: bool) -> None:
    """Every unsupported combination fails here, before any data or model is built."""
    from nemo_ssa.config.check import check_run_config

    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["train"] = OmegaConf.to_container(_train_cfg(cfg, cuda), resolve=True)
    world = None if cuda else _launched_world()
    if cuda and _launched_world() > 1:
        want = int(resolved["train"].get("num_nodes") or 1) * int(resolved["train"].get("num_gpus_per_node") or 1)
        if want != _launched_world():
            raise SystemExit(f"[pretrain] the launcher started {_launched_world()} processes but train.num_nodes x "
                             f"train.num_gpus_per_node = {want}; make them agree")
    try:
        check_run_config(resolved, cuda=cuda, world=world)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"[pretrain] invalid configuration: {e}") from None


def _set_aside_previous(run_dir: str, extra: tuple = ()) -> None:
    """A fresh (not resumed) run into a used directory: move the old logs/checkpoints to
    ``previous-<time>/`` instead of mixing them into the new curve or deleting them."""
    old = [n for n in _ARTIFACTS + tuple(extra) if os.path.exists(os.path.join(run_dir, n))]
    if not old:
        return
    dest = os.path.join(run_dir, "previous-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(dest, exist_ok=True)
    for name in old:
        shutil.move(os.path.join(run_dir, name), os.path.join(dest, name))
    print(f"[pretrain] run_dir held an earlier run (resume=false): moved {', '.join(old)} to {dest}", flush=True)


def train_one(cfg: DictConfig) -> None:
    import torch

    cuda = torch.cuda.is_available()
    _check_config(cfg, cuda)
    train = _train_cfg(cfg, cuda)
    run_dir = os.path.abspath(cfg.run_dir)
    main = _rank() == 0
    _decide_cuda_graphs(cfg, train, cuda, say=main)  # before the identity: a run is what it ran with
    resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
    resolved_cfg["train"] = OmegaConf.to_container(train, resolve=True)
    resolved_cfg["path"] = "gpu" if cuda else "cpu"
    identity = _identity(resolved_cfg)
    if cfg.get("reuse_if_complete") and _finished(run_dir, identity):
        print(f"[pretrain] reusing the finished run in {run_dir} (same configuration, identity {identity}); "
              f"reuse_baselines=false retrains it", flush=True)
        print(f"[pretrain] done. logs: {run_dir} (metrics.csv, tb/, attention_policy.json, checkpoints/)", flush=True)
        return
    os.makedirs(run_dir, exist_ok=True)
    if main:
        if not cfg.resume:
            _set_aside_previous(run_dir, extra=_nemo_log_dirs(run_dir))
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(resolved_cfg))
    prefix, tokenizer_dir = _data(cfg)
    if main:
        _, clamped = held_out_every(int(train.max_steps), train.get("val_check_interval"))
        passes = passes_note(prefix, max_steps=int(train.max_steps), global_batch_size=int(train.global_batch_size),
                             seq_length=int(train.seq_length))
        for line in (clamped, passes):
            if line:
                print(f"[pretrain] {line}", flush=True)
        with open(os.path.join(run_dir, PASSES_RECORD), "w") as f:
            json.dump(passes_record(prefix, max_steps=int(train.max_steps), global_batch_size=int(train.global_batch_size),
                                    seq_length=int(train.seq_length)), f, indent=1)
    if cfg.attention.get("max_micro_batch_size") and int(train.micro_batch_size) == int(cfg.attention.max_micro_batch_size) \
            and int(train.global_batch_size) > int(train.micro_batch_size) and main:
        print(f"[pretrain] attention={cfg.attention.name}: micro batch {train.micro_batch_size} (its memory cap; "
              f"global batch {train.global_batch_size} by gradient accumulation)", flush=True)
    recipe, resolved = build_recipe(cfg, train, prefix, tokenizer_dir, run_dir)
    print(f"[pretrain] attention={cfg.attention.name} -> {resolved.name} (policy={cfg.policy}); "
          f"options {json.dumps(resolved.options)}", flush=True)
    if cuda:
        run_gpu(cfg, train, recipe, resolved, run_dir)
    else:
        run_cpu(cfg, train, recipe, run_dir)
    stopped_early = bool(cfg.get("stop_after")) and int(cfg.stop_after) < int(train.max_steps)
    if not main:
        return
    resolved.write(run_dir)  # again: now with the kernels the calls took (``kernels``)
    if not stopped_early:
        with open(os.path.join(run_dir, "complete.json"), "w") as f:
            json.dump({"identity": identity, "attention": cfg.attention.name, "seed": int(cfg.seed),
                       "max_steps": int(train.max_steps),
                       "finished": datetime.datetime.now(datetime.timezone.utc).isoformat()}, f, indent=2)
    print(f"[pretrain] done. logs: {run_dir} (metrics.csv, tb/, attention_policy.json, checkpoints/)", flush=True)


# ---------------------------------------------------------------------------- the story


def _story_names(cfg: DictConfig) -> list:
    names = []
    for name in list(cfg.get("compare_to") or []) + [cfg.attention.name]:
        if name not in names:
            names.append(str(name))
    return names


def _attention_group(name: str) -> None:
    if not os.path.isfile(config_file("attention", f"{name}.yaml")):
        known = sorted(f[:-5] for f in os.listdir(config_file("attention")) if f.endswith(".yaml"))
        raise SystemExit(f"compare_to names attention {name!r}, which has no nemo_ssa/configs/attention/{name}.yaml; "
                         f"known: {', '.join(known)}")


def train_and_compare(cfg: DictConfig) -> None:
    """Train every attention in ``compare_to`` + ``attention`` (one process each), then compare."""
    from hydra.core.hydra_config import HydraConfig

    from nemo_ssa.tools.compare import main as compare_main

    if _launched_world() > 1:
        raise SystemExit("[pretrain] compare_to trains several runs one after another; under torchrun / Slurm "
                         "launch one attention per command (compare_to=[]) and compare with "
                         "scripts/compare_losses.py, or launch the story with plain `python` "
                         "(train.num_gpus_per_node=N: Lightning starts the other GPU processes)")
    names = _story_names(cfg)
    for name in names:
        _attention_group(name)
    overrides = [o for o in HydraConfig.get().overrides.task
                 if o.split("=", 1)[0].lstrip("+~") not in ("attention", "compare_to", "reuse_if_complete")]
    if any(o.split("=", 1)[0].lstrip("+~") == "run_dir" for o in overrides):
        raise SystemExit(f"run_dir names one directory but compare_to trains {len(names)} runs ({', '.join(names)}); "
                         f"set runs_root=... instead, or compare_to=[] for a single run")
    overrides = _story_cuda_graphs(cfg, names, overrides)
    baselines = names[:-1]
    run_dirs = []
    for i, name in enumerate(names):
        reuse = name in baselines and bool(cfg.reuse_baselines)
        cmd = pretrain_command(*overrides, f"attention={name}", "compare_to=[]",
                               f"reuse_if_complete={str(reuse).lower()}")
        print(f"[pretrain] ({i + 1}/{len(names)}) attention={name}: {' '.join(cmd[3:])}", flush=True)
        proc = subprocess.run(cmd, cwd=os.getcwd(), env=child_env())
        if proc.returncode != 0:
            raise SystemExit(f"[pretrain] the attention={name} run failed (exit {proc.returncode}); "
                             f"not comparing")
        run_dirs.append(os.path.abspath(os.path.join(str(cfg.runs_root), f"{name}-s{cfg.seed}")))
    out = os.path.abspath(os.path.join(str(cfg.runs_root), f"compare-{'_vs_'.join(names)}-s{cfg.seed}"))
    print(f"[pretrain] comparing {', '.join(names)} (baseline {names[0]})", flush=True)
    rc = compare_main([f"{n}={d}" for n, d in zip(names, run_dirs)] +
                      ["--out", out, "--ema", str(cfg.compare_ema),
                       "--title", f"{' vs '.join(names)} (seed {cfg.seed})"])
    if rc != 0:
        raise SystemExit(f"[pretrain] the comparison failed (exit {rc})")
    print(f"[pretrain] done. runs: {', '.join(run_dirs)}; comparison: {out} (loss.png, ssa_n.png, summary.md)",
          flush=True)


def _story_cuda_graphs(cfg: DictConfig, names: list, overrides: list) -> list:
    """The story's runs take graphs all or none (``compared_cuda_graphs``); said with CUDA only
    (without it every run decides none itself)."""
    import torch

    if not torch.cuda.is_available():
        return overrides
    overrides, why = compared_cuda_graphs(names, overrides, default=str(cfg.model.get("cuda_graphs") or "none"))
    if why:
        print(f"[pretrain] {why}", flush=True)
    return overrides


def _compare_to_was_set() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return any(o.split("=", 1)[0].lstrip("+~") == "compare_to" for o in HydraConfig.get().overrides.task)


# An absolute path from this file: the same tree whether this runs from a checkout, an
# installed wheel, ``-m nemo_ssa.cli.pretrain`` or scripts/pretrain.py (hydra's relative
# paths resolve against the calling file or module, which differ between those).
@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.get("compare_to") and _launched_world() > 1 and not _compare_to_was_set():
        # Under torchrun / Slurm every rank is one process of one run: the story's default
        # baseline (compare_to: [softmax]) cannot run one after another here, so a
        # multi-GPU line trains the attention it names, and says so.
        if _rank() == 0:
            print(f"[pretrain] launched as {_launched_world()} processes: training attention={cfg.attention.name} "
                  f"alone (the default compare_to={list(cfg.compare_to)} runs with a plain `python` launch; "
                  f"compare afterwards with scripts/compare_losses.py)", flush=True)
        cfg.compare_to = []
    if cfg.get("compare_to"):
        train_and_compare(cfg)
    else:
        train_one(cfg)


if __name__ == "__main__":
    main()
