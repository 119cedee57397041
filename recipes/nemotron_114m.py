"""NeMo recipe: nemotron3_4b shrunk to ~114M parameters, with a selectable core attention.

Starts from ``nemo.collections.llm.recipes.nemotron3_4b.pretrain_recipe`` and changes only
what the SSA study pinned (seed 000): 12 layers, 24 heads, 8 query groups, hidden 768,
ffn 3072, ``kv_channels=None`` (-> 32), tied embeddings; TP=1, CP=1 unless asked
(``tensor_parallel``, ``context_parallel``, ``sequence_parallel``). With the local
tokenizer's ~50k vocabulary (padded to 50,304) the softmax model has 114,169,344
parameters; SSA adds one ``n`` per layer (12).

Runs that compare attentions differ only in ``attention=``.

Usage (the launcher, ``scripts/pretrain.py``, does this for you)::

    from recipes import nemotron_114m
    recipe = nemotron_114m.pretrain_recipe(dir="runs/x", attention="ssa",
                                           data_prefix=..., tokenizer_dir=...)
    run.run(recipe, direct=True)
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import nemo_run as run

NAME = "nemotron_114m"

#: the architecture this recipe pins (also used by tests and the CPU path)
ARCH = dict(
    num_layers=12,
    num_attention_heads=24,
    num_query_groups=8,
    hidden_size=768,
    ffn_hidden_size=3072,
    kv_channels=None,
    share_embeddings_and_output_weights=True,
)


def _layer_spec_partial(attention: str, attention_options: Optional[Dict[str, Any]], policy: str,
                        fused_mlp: Any = "auto", fused_layernorm: Any = False):
    from nemo_ssa.megatron.spec import layer_spec

    return run.Partial(
        layer_spec,
        attention=attention,
        attention_options=dict(attention_options or {}),
        policy=policy,
        fused_mlp=fused_mlp,
        fused_layernorm=fused_layernorm,
    )


def _apply_arch(config, attention, attention_options, policy, seq_length, vocab_size,
                fused_cross_entropy="auto", fused_mlp="auto", fused_layernorm=False) -> None:
    for key, value in ARCH.items():
        setattr(config, key, value)
    config.seq_length = seq_length
    if vocab_size is not None:
        config.vocab_size = vocab_size
    # Without Transformer Engine (the GPU image has none): no fused RoPE; layernorm1p
    # comes from our spec (LayerNorm1P), so keep zero-centred gamma and drop the
    # Apex-only persistent kernel flag.
    config.apply_rope_fusion = False
    config.persist_layer_norm = False
    config.transformer_layer_spec = _layer_spec_partial(attention, attention_options, policy, fused_mlp,
                                                        fused_layernorm)
    # Our core attention applies causality itself: no mask needed from the data.
    from nemo_ssa.nemo.steps import data_step, forward_step

    config.data_step_fn = data_step
    config.forward_step_fn = run.Partial(forward_step, fused_cross_entropy=fused_cross_entropy)


def model(
    attention: str = "softmax",
    attention_options: Optional[Dict[str, Any]] = None,
    policy: str = "pinned",
    seq_length: int = 1024,
    vocab_size: Optional[int] = None,
    fused_mlp: Any = "auto",
    fused_layernorm: Any = False,
) -> run.Config:
    """The 114M Nemotron model config with the named core attention.

    Args:
        attention: ``softmax``, ``ssa`` (the policy's pinned SSA kernel) or an
            implementation name such as ``ssa_reference``.
        attention_options: SSA options (n, b, learnable_n, learnable_b,
            force_contiguous_qkv) for attentions with the SSA transform, under
            ``policy=pinned`` reset with a warning when they differ, plus the attention's
            own options (``nemo_ssa.config.attentions.KERNEL_OPTION_KEYS``, e.g. NSA's sizes).
        policy: ``pinned`` (seed 000's SSA policy) or ``free``.
        seq_length: training sequence length.
        vocab_size: padded vocabulary size; None derives it from the tokenizer
            (padded to a multiple of 128).
        fused_mlp: the squared-ReLU MLP with its activation fused into the GEMM epilogues
            (nemo_ssa.megatron.mlp): auto (on with CUDA and TP=1), true, false.
        fused_layernorm: the layer norms through Triton (nemo_ssa.megatron.layernorm):
            auto (on with CUDA), true, false (torch's LayerNorm; the default).

    Returns:
        ``run.Config[NemotronModel]``.
    """
    from nemo_ssa.versions import check_stack

    check_stack()
    from nemo.collections.llm.recipes import nemotron3_4b

    cfg = nemotron3_4b.model()
    from nemo_ssa.config.check import check_fused_layernorm, check_fused_mlp

    check_fused_mlp(fused_mlp)
    check_fused_layernorm(fused_layernorm)
    _apply_arch(cfg.config, attention, attention_options, policy, seq_length, vocab_size, fused_mlp=fused_mlp,
                fused_layernorm=fused_layernorm)
    return cfg


def pretrain_recipe(
    dir: Optional[str] = None,
    name: str = "default",
    num_nodes: int = 1,
    num_gpus_per_node: int = 1,
    attention: str = "ssa",
    attention_options: Optional[Dict[str, Any]] = None,
    policy: str = "pinned",
    data_prefix: Optional[str] = None,
    tokenizer_dir: Optional[str] = None,
    seq_length: int = 1024,
    micro_batch_size: int = 8,
    global_batch_size: int = 8,
    max_steps: int = 1000,
    warmup_steps: int = 50,
    lr: float = 3e-4,
    min_lr: float = 3e-5,
    weight_decay: float = 0.1,
    clip_grad: float = 1.0,
    seed: int = 1234,
    log_every_n_steps: int = 10,
    val_check_interval: int = 1000,
    limit_val_batches: int = 4,
    ckpt_every_n_steps: Optional[int] = None,
    vocab_size: Optional[int] = None,
    fused_cross_entropy: Any = "auto",
    fused_mlp: Any = "auto",
    fused_layernorm: Any = False,
    cuda_graphs: str = "none",
    num_workers: int = 2,
    precision: str = "bf16-mixed",
    use_distributed_optimizer: Optional[bool] = None,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    overlap_grad_reduce: Optional[bool] = None,
    init_on_cpu: bool = False,
    fn=None,
) -> run.Partial:
    """Pre-training recipe for the 114M Nemotron with a selectable core attention.

    Args:
        dir: run directory (NeMo logs, TensorBoard, checkpoints).
        name: experiment name.
        num_nodes: nodes.
        num_gpus_per_node: GPUs per node. The world (``num_nodes x num_gpus_per_node``)
            is split into tensor x context x data parallel; data parallel takes what TP
            and CP leave.
        attention: ``attention=<name>``; see :func:`model`.
        attention_options: SSA options; see :func:`model`.
        policy: ``pinned`` or ``free``.
        data_prefix: Megatron indexed dataset prefix (``.bin``/``.idx`` without extension);
            ``None`` keeps NeMo's mock data (no tokenizer needed).
        tokenizer_dir: HF tokenizer directory matching ``data_prefix``.
        seq_length: sequence length.
        micro_batch_size: per-GPU micro batch.
        global_batch_size: global batch (gradient accumulation fills the gap).
        max_steps: optimizer steps.
        warmup_steps: linear LR warm-up steps.
        lr: peak learning rate (cosine decay to ``min_lr`` at ``max_steps``).
        min_lr: final learning rate.
        weight_decay: AdamW weight decay (1-d tensors, biases, norms and SSA's ``n`` are
            exempt).
        clip_grad: gradient-norm clipping.
        seed: data order and initialisation seed.
        log_every_n_steps: Lightning logging interval.
        val_check_interval: validation interval in steps.
        limit_val_batches: validation batches per check.
        ckpt_every_n_steps: checkpoint interval (None: at the end only).
        fused_cross_entropy: the fused output layer + LM loss (nemo_ssa.ops.cross_entropy,
            docs/fused-layers.md): auto (on with CUDA and TP=1), true (TP > 1 refused), false.
        fused_mlp: the squared-ReLU MLP with its activation fused into the GEMM epilogues
            (nemo_ssa.megatron.mlp, docs/fused-layers.md): auto (on with CUDA and TP=1),
            true (refused with TP > 1), false (megatron's MLP).
        fused_layernorm: the layer norms and the final norm through Triton
            (nemo_ssa.megatron.layernorm, docs/fused-layers.md): auto (on with CUDA), true
            (refused when the model's hidden size or dtype is not supported), false (the
            default: the op's host cost slows the micro batch 8 step).
        cuda_graphs: ``none`` (the default here), ``local`` or ``auto``: megatron-core's layerwise
            CUDA graphs (``cuda_graph_impl='local'``, nemo_ssa/megatron/cuda_graphs.py: each layer's
            forward and backward captured after the first step and replayed, the cudagraphable RNG
            tracker set up by a callback before the model is built). ``local`` needs CUDA, TP 1,
            CP 1 and an attention whose layers ran under the graphs (``check_cuda_graphs``).
            ``auto`` (the launcher's default, decided there with the device in hand) is ``none``
            in a recipe built here: the device it will run on is not known
            (``resolve_cuda_graphs``); pass ``local`` to take the graphs.
        vocab_size: padded vocabulary; None derives it from the tokenizer.
        num_workers: data-loader workers.
        precision: ``bf16-mixed`` (default), ``16-mixed`` or ``32``.
        init_on_cpu: initialise the full weights on the CPU from one generator and split
            them (megatron's ``use_cpu_initialization``): every parallel layout then starts
            from the identical model. Megatron's GPU initialisation (the default) draws each
            tensor-parallel shard from that rank's own RNG stream, so a TP2 run starts from
            another model than TP1 -- a different seed, in effect. For layout parity checks.
        use_distributed_optimizer: shard optimizer state (fp32 master weights, Adam
            moments) across data-parallel ranks. ``None`` (default): on when data parallel
            is > 1, where it saves memory for the same communication volume
            (reduce-scatter + all-gather instead of all-reduce); off at DP 1, where it
            only adds copies. Checkpoints use megatron's fully reshardable optimizer
            format, so a run saved at one layout resumes at another.
        tensor_parallel: tensor-model-parallel size (every attention; SSA's n is kept
            identical on the TP ranks, ``nemo_ssa/megatron/parallel.py``).
        context_parallel: context-parallel size (causal; megatron's load-balanced split
            into 2·CP chunks; ``seq_length`` must be a multiple of 2·CP).
        sequence_parallel: megatron's sequence parallel (needs tensor_parallel > 1).
        overlap_grad_reduce: overlap the data-parallel gradient reduction with the
            backward pass; ``None``: on when data (or context) parallel > 1.
        fn: the NeMo entry (default ``llm.pretrain``).

    Returns:
        ``run.Partial`` for ``run.run(recipe, direct=True)``.
    """
    from nemo_ssa.versions import check_stack

    check_stack()  # nemo_toolkit 3 (no LLM collection) or an untested megatron: one clear error
    from nemo.collections.llm.recipes import nemotron3_4b

    from nemo_ssa.megatron import compat

    compat.apply_megatron_compat()  # numpy 2 + megatron-core 0.15: multi-rank checkpoints
    kwargs = dict(dir=dir, name=name, num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node)
    if fn is not None:
        kwargs["fn"] = fn
    recipe = nemotron3_4b.pretrain_recipe(**kwargs)

    # Parallelism: checked before anything is built (one line naming what is supported)
    from nemo_ssa.config.check import check_fused_layernorm, check_fused_mlp, check_parallel, resolve_cuda_graphs
    from nemo_ssa.megatron.output_layer import check_fused_cross_entropy

    check_fused_cross_entropy(fused_cross_entropy, tensor_parallel, sequence_parallel)
    check_fused_mlp(fused_mlp, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)
    check_fused_layernorm(fused_layernorm)
    # the device and the environment are the launcher's to check: a recipe may be built where it
    # does not run (a login node submitting to Slurm)
    cuda_graphs, _ = resolve_cuda_graphs(cuda_graphs, cuda=None, attention=attention,
                                         world=int(num_nodes) * int(num_gpus_per_node),
                                         tensor_parallel=tensor_parallel, context_parallel=context_parallel,
                                         sequence_parallel=sequence_parallel, env={})
    _apply_arch(recipe.model.config, attention, attention_options, policy, seq_length, vocab_size,
                fused_cross_entropy, fused_mlp, fused_layernorm)
    apply_seed(recipe, seed)  # before apply_cuda_graphs: its callback keeps the seeded streams
    from nemo_ssa.nemo.callbacks import LightningLogCallback, SyncFreeLossReductionCallback

    # NeMo's training-loss reduction reads the device once a step; the same loss without the read.
    # NeMo's six to seven self.log calls a step: without Lightning's walk over each stored metric
    recipe.trainer.callbacks = list(recipe.trainer.callbacks or []) + [run.Config(SyncFreeLossReductionCallback),
                                                                        run.Config(LightningLogCallback)]
    apply_cuda_graphs(recipe, cuda_graphs)

    world = int(num_nodes) * int(num_gpus_per_node)
    dp = check_parallel(attention=attention, world=world, tensor_parallel=tensor_parallel,
                        context_parallel=context_parallel, sequence_parallel=sequence_parallel,
                        pipeline_parallel=1, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        global_batch_size=global_batch_size, arch=ARCH)
    if use_distributed_optimizer is None:
        use_distributed_optimizer = dp > 1
    if overlap_grad_reduce is None:
        overlap_grad_reduce = dp * int(context_parallel) > 1
    apply_parallel(recipe, tensor_parallel=tensor_parallel, context_parallel=context_parallel,
                   sequence_parallel=sequence_parallel, use_distributed_optimizer=use_distributed_optimizer,
                   overlap_grad_reduce=overlap_grad_reduce)
    strategy = recipe.trainer.strategy
    strategy.ckpt_async_save = False
    if init_on_cpu:
        recipe.model.config.use_cpu_initialization = True

    # Schedule
    recipe.trainer.max_steps = max_steps
    recipe.trainer.log_every_n_steps = log_every_n_steps
    recipe.trainer.val_check_interval = val_check_interval
    recipe.trainer.limit_val_batches = limit_val_batches
    recipe.trainer.limit_test_batches = limit_val_batches
    recipe.optim.config.lr = lr
    recipe.optim.config.weight_decay = weight_decay
    recipe.optim.config.clip_grad = clip_grad
    recipe.optim.lr_scheduler.warmup_steps = warmup_steps
    recipe.optim.lr_scheduler.min_lr = min_lr
    recipe.optim.lr_scheduler.max_steps = max_steps
    if precision != "bf16-mixed":
        from nemo.collections.llm.recipes.precision.mixed_precision import fp16_mixed

        if precision == "16-mixed":
            recipe.trainer.plugins = fp16_mixed()
            recipe.optim.config.bf16, recipe.optim.config.fp16 = False, True
        elif precision == "32":
            recipe.trainer.plugins = None
            recipe.optim.config.bf16 = recipe.optim.config.fp16 = False
        else:
            raise ValueError(f"precision={precision!r} (supported: bf16-mixed, 16-mixed, 32)")

    # Data: the local indexed dataset, or NeMo's mock data when none is given.
    if data_prefix is not None:
        if tokenizer_dir is None:
            raise ValueError("data_prefix needs tokenizer_dir (the tokenizer the corpus was built with)")
        recipe.data = local_data(data_prefix, tokenizer_dir, seq_length, micro_batch_size,
                                 global_batch_size, seed, num_workers)
    else:
        recipe.data.seq_length = seq_length
        recipe.data.micro_batch_size = micro_batch_size
        recipe.data.global_batch_size = global_batch_size

    # Optimizer: NeMo's module + nemo_ssa's fixes for megatron-core 0.15.3's optimizer
    # checkpoints (fp32 n in bf16 models; the distributed optimizer with torch's Adam).
    import fiddle as fdl

    from nemo_ssa.megatron.introspect import no_weight_decay_cond
    from nemo_ssa.nemo.optim import SSAMegatronOptimizerModule

    fdl.update_callable(recipe.optim, SSAMegatronOptimizerModule)
    recipe.optim.no_weight_decay_cond = no_weight_decay_cond

    # Checkpoints: keep the last, save on an interval if asked. Every checkpoint can be
    # resumed: NeMo saves the one at max_steps without optimizer state unless
    # save_optim_on_train_end (extending a finished run then failed with a KeyError for
    # optimizer.state.exp_avg..., the "second-generation resume"); and
    # fresh and resumed runs share <dir>/<name>/checkpoints (NeMo's default puts a fresh
    # run under a <date-time> version directory that resume=true never looks in).
    ckpt = recipe.log.ckpt
    ckpt.save_top_k = 1
    ckpt.save_last = True
    ckpt.monitor = "reduced_train_loss"
    ckpt.train_time_interval = None
    ckpt.every_n_train_steps = ckpt_every_n_steps or max_steps
    ckpt.filename = "{model_name}--{step}-{consumed_samples}"
    ckpt.save_optim_on_train_end = True
    recipe.log.use_datetime_version = False
    recipe.log.tensorboard.name = name
    return recipe


def apply_seed(recipe, seed: int) -> None:
    """The run's seed for the weights on NeMo's path: NeMo's strategy seeds every generator
    with 1234 whatever the recipe says (``nemo_ssa.nemo.callbacks.SeedCallback``), so a seed
    other than that one puts the callback that re-seeds them first in the trainer's callbacks
    (before the model is built). At 1234 the recipe is left as it was."""
    from nemo_ssa.nemo.callbacks import NEMO_DEFAULT_SEED, SeedCallback

    if int(seed) == NEMO_DEFAULT_SEED:
        return
    recipe.trainer.callbacks = [run.Config(SeedCallback, seed=int(seed))] + list(recipe.trainer.callbacks or [])


def apply_cuda_graphs(recipe, cuda_graphs: str = "none") -> None:
    """``cuda_graphs=local``: megatron's local CUDA graph fields on the model config and the
    callback that makes megatron's RNG tracker cudagraphable before the model is built. With
    ``none`` the recipe is left exactly as it was (no field set, no callback)."""
    from nemo_ssa.megatron.cuda_graphs import cuda_graph_fields

    fields = cuda_graph_fields(cuda_graphs)
    if not fields:
        return
    for key, value in fields.items():
        setattr(recipe.model.config, key, value)
    from nemo_ssa.nemo.callbacks import CudaGraphRNGCallback

    recipe.trainer.callbacks = list(recipe.trainer.callbacks or []) + [run.Config(CudaGraphRNGCallback)]


def apply_parallel(recipe, tensor_parallel: int = 1, context_parallel: int = 1, sequence_parallel: bool = False,
                   use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False) -> None:
    """Set the parallel layout on a recipe: the strategy (what NeMo's trainer uses), the
    model config (what the CPU loop and ``configure_model`` read), DDP and optimizer.

    Also pins the padded vocabulary to a multiple of 128 whatever the TP size: megatron
    pads to 128 x TP by default, which would give a TP2 model 50,432 embedding rows and a
    TP1 model 50,304, and a checkpoint could not move between them.
    """
    import math as _math

    tp, cp = int(tensor_parallel), int(context_parallel)
    strategy = recipe.trainer.strategy
    strategy.tensor_model_parallel_size = tp
    strategy.pipeline_model_parallel_size = 1
    strategy.context_parallel_size = cp
    strategy.sequence_parallel = bool(sequence_parallel)
    strategy.ddp.overlap_grad_reduce = bool(overlap_grad_reduce)
    strategy.ddp.overlap_param_gather = False
    strategy.ddp.use_distributed_optimizer = bool(use_distributed_optimizer)
    # the distributed optimizer's checkpoint in the format that reshards across TP/CP/DP
    strategy.ckpt_optim_fully_reshardable = bool(use_distributed_optimizer)
    recipe.optim.config.use_distributed_optimizer = bool(use_distributed_optimizer)
    cfg = recipe.model.config
    cfg.tensor_model_parallel_size = tp
    cfg.context_parallel_size = cp
    cfg.pipeline_model_parallel_size = 1
    cfg.sequence_parallel = bool(sequence_parallel)
    cfg.make_vocab_size_divisible_by = 128 // _math.gcd(128, tp)


def local_data(data_prefix, tokenizer_dir, seq_length, micro_batch_size, global_batch_size,
               seed, num_workers=2) -> run.Config:
    """PreTrainingDataModule over a local Megatron indexed dataset and HF tokenizer dir."""
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
    from nemo.collections.llm.gpt.data.pre_training import PreTrainingDataModule

    return run.Config(
        PreTrainingDataModule,
        paths=[str(data_prefix)],
        seq_length=seq_length,
        tokenizer=run.Config(AutoTokenizer, pretrained_model_name=str(tokenizer_dir), use_fast=True),
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        seed=seed,
        split="990,8,2",
        num_workers=num_workers,
        pin_memory=True,
        create_attention_mask=False,
        reset_attention_mask=False,
        reset_position_ids=False,
    )
