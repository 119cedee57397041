"""Megatron-LM's own training loop with a nemo-ssa attention: ``megatron.training.pretrain`` as
the megatron-core 0.19 wheel ships it -- no NeMo, no Megatron-LM checkout, no Transformer Engine::

    python scripts/build_corpus.py                    # the embedded corpus (once; no downloads)
    torchrun --nproc-per-node 1 -m nemo_ssa.megatron.lm_pretrain \\
        --spec nemo_ssa.megatron.block_specs ssa_triton --train-iters 200
    # two GPUs, stop at 100 with a checkpoint, then resume to 200:
    torchrun --nproc-per-node 2 -m nemo_ssa.megatron.lm_pretrain \\
        --spec nemo_ssa.megatron.block_specs ssa_triton --train-iters 200 \\
        --save ck --save-interval 100 --exit-interval 100
    torchrun --nproc-per-node 2 -m nemo_ssa.megatron.lm_pretrain \\
        --spec nemo_ssa.megatron.block_specs ssa_triton --train-iters 200 --save ck --load ck

Every argument is Megatron-LM's (``pretrain_gpt.py``'s parser, from ``megatron.training``),
plus one of ours: ``--preset`` (default ``nemotron-114m``: the NeMo recipe's 114M model and
nemo_ssa/configs/train/gpu_9min.yaml's schedule, :data:`PRESETS`; ``none``: Megatron's own defaults).
The preset goes first on the command line, so any argument given after it wins; the
argument list a run used is printed by rank 0. Without ``--data-path`` (or ``--mock-data``)
the embedded corpus is used (``nemo_ssa.data.corpus``: a Megatron indexed dataset and its
byte-level BPE tokenizer, read through ``HuggingFaceTokenizer`` from its local directory).

What this module supplies, as ``pretrain_gpt.py`` does for Megatron-LM: the dataset provider
(``GPTDataset`` through ``BlendedMegatronDatasetBuilder``), ``forward_step`` and its loss
(the mean over unmasked tokens, Megatron's per-token reduction). The model is megatron's
``GPTModelBuilder`` over ``--spec``: ``nemo_ssa.megatron.block_specs.<name>`` (the recipe's
block: LayerNorm1P everywhere, the fused MLP) or ``nemo_ssa.megatron.layer_specs.<name>``
(one layer; megatron's final norm, which refuses ``--apply-layernorm-1p`` without TE).
Without ``--spec`` megatron's own local layer runs (its ``DotProductAttention``): the softmax
reference for a loss comparison (with ``--preset none`` or without ``--apply-layernorm-1p``).

Two changes to megatron's loop, made here and logged: the optimizer megatron builds gets
``nemo_ssa.megatron.optimizer_fixes.patch_megatron_optimizer`` (SSA's fp32 ``n`` inside a bf16
model, the distributed optimizer's checkpoints with torch's Adam); megatron's default
weight-decay rule already exempts ``n`` (a 1-element parameter); and the start-up's ``make`` of
the dataset helpers is skipped where the wheel's prebuilt ones import (the wheel has no
Makefile). Supported: megatron-core
0.19.x (:data:`MEGATRON_CORE`), pipeline parallel 1; TP, CP and DP as megatron runs them.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from nemo_ssa.versions import MEGATRON_LM_LOOP  # the range is decided there, with the others

__all__ = ["PRESETS", "MEGATRON_CORE", "build_argv", "check_megatron", "check_args", "get_batch",
           "loss_func", "forward_step", "train_valid_test_datasets_provider", "main"]

#: the megatron-core releases whose ``megatron.training`` this entry is written for and ran on
MEGATRON_CORE = MEGATRON_LM_LOOP

#: --preset name -> Megatron-LM arguments (before the user's: a later argument wins)
PRESETS: Dict[str, List[str]] = {
    # recipes/nemotron_114m.py (nemotron3_4b shrunk: 12 x 768, 24 heads / 8 groups, ffn 3072,
    # squared ReLU, layernorm1p, RoPE on half the head dim, no biases, tied embeddings) under
    # nemo_ssa/configs/train/gpu_9min.yaml (micro batch 32 x 1024, bf16, 6e-4 cosine to 6e-5 after 20
    # warm-up steps, weight decay 0.1, clip 1.0, Adam 0.9 / 0.95); without Transformer Engine:
    # the local implementation, no fused RoPE / persistent LN / gradient-accumulation fusion
    "nemotron-114m": [
        "--transformer-impl", "local",
        "--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072",
        "--num-attention-heads", "24", "--group-query-attention", "--num-query-groups", "8",
        "--seq-length", "1024", "--max-position-embeddings", "1024",
        "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--no-rope-fusion",
        "--normalization", "LayerNorm", "--apply-layernorm-1p", "--no-persist-layer-norm",
        "--squared-relu", "--disable-bias-linear", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--init-method-std", "0.0134",
        "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
        "--bf16", "--micro-batch-size", "32",
        "--lr", "6e-4", "--min-lr", "6e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--seed", "1234", "--split", "949,50,1",
        "--log-interval", "10", "--eval-interval", "125", "--eval-iters", "2",
    ],
    "none": [],
}

_TAG = "[lm_pretrain]"


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _say(msg: str) -> None:
    if _rank0():
        print(f"{_TAG} {msg}", flush=True)


def _has(argv: Sequence[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _corpus_args(corpus: Optional[Tuple[str, str]]) -> List[str]:
    if corpus is None:
        return []
    prefix, tokenizer_dir = corpus
    return ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir]


def build_argv(argv: Sequence[str], corpus: Optional[Tuple[str, str]] = None) -> Tuple[str, List[str]]:
    """(preset name, the Megatron-LM argument list): ``--preset`` taken out of ``argv``, its
    arguments first, the embedded corpus (``corpus`` = (prefix, tokenizer dir)) where the user
    names no data, then the user's own arguments (the last occurrence of a flag wins)."""
    argv = list(argv)
    preset = "nemotron-114m"
    rest: List[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--preset":
            if i + 1 >= len(argv):
                raise SystemExit(f"{_TAG} --preset needs a value: one of {sorted(PRESETS)}")
            preset = argv[i + 1]
            i += 2
            continue
        if a.startswith("--preset="):
            preset = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if preset not in PRESETS:
        raise SystemExit(f"{_TAG} --preset {preset!r}: one of {sorted(PRESETS)}")
    data = [] if _has(rest, "--data-path", "--train-data-path", "--data-args-path", "--mock-data") else _corpus_args(corpus)
    return preset, [*PRESETS[preset], *data, *rest]


def check_megatron(version: Optional[str] = None) -> str:
    """The installed megatron-core, refused with one line naming the supported range when its
    ``megatron.training`` is not the one this entry is written for."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if version is None:
        try:  # the megatron that imports, not a distribution's metadata (PYTHONPATH overlays)
            from megatron.core.package_info import __version__ as version
        except ImportError:
            version = None
    if version is None:
        raise SystemExit(f"{_TAG} megatron-core is not installed: pip install 'megatron-core{MEGATRON_CORE}'")
    if Version(Version(version).base_version) not in SpecifierSet(MEGATRON_CORE):
        raise SystemExit(
            f"{_TAG} megatron-core {version}: this entry runs megatron.training's loop of megatron-core"
            f"{MEGATRON_CORE} (Python >= 3.12; 0.16 and older ship no megatron.training, 0.17 and 0.18 "
            "another pretrain()). With megatron-core "
            "0.15-0.16 use NeMo (scripts/pretrain.py) or plain megatron-core (scripts/train_megatron_core.py); "
            "with a Megatron-LM checkout use its pretrain_gpt.py --spec nemo_ssa.megatron.layer_specs <name>.")
    return version


def _ours(spec: Optional[Sequence[str]]) -> bool:
    return bool(spec) and spec[0].startswith("nemo_ssa.")


def check_args(args) -> None:
    """What this entry does not run, refused with the reason before anything is built."""
    problems = []
    if getattr(args, "pipeline_model_parallel_size", 1) != 1:
        problems.append("--pipeline-model-parallel-size > 1 (this entry's batches and datasets are "
                        "for one pipeline stage; TP, CP and DP are supported)")
    if getattr(args, "transformer_impl", "local") != "local" and _ours(args.spec):
        problems.append(f"--transformer-impl {args.transformer_impl} with a nemo_ssa spec (our specs are "
                        "the local implementation: --transformer-impl local; the TE layer spec is "
                        "nemo_ssa.megatron.te_spec, for NeMo / Megatron-Bridge)")
    backend = str(getattr(args, "attention_backend", "")).rsplit(".", 1)[-1]
    if backend == "local" and _ours(args.spec):
        problems.append("--attention-backend local with a nemo_ssa spec (megatron then replaces the spec's "
                        "core attention with its DotProductAttention)")
    if getattr(args, "sft", False) or getattr(args, "fim_data", False):
        problems.append("--sft / --fim-data (this entry builds GPTDataset only)")
    if problems:
        raise SystemExit(f"{_TAG} not supported here:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------------------ what pretrain calls
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch(data_iterator):
    """One micro batch on this rank: read on tensor-parallel rank 0, broadcast to the TP group,
    cut to this context-parallel rank's share. No attention mask: every attention here applies
    causality itself (megatron's local softmax builds its causal mask when none is given)."""
    import torch
    from megatron.core import mpu, tensor_parallel
    from megatron.core.utils import get_batch_on_this_cp_rank

    data = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else None
    ints = tensor_parallel.broadcast_data(["tokens", "labels", "position_ids"], data, torch.int64)
    mask = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32)
    batch = {"tokens": ints["tokens"], "labels": ints["labels"], "position_ids": ints["position_ids"],
             "loss_mask": mask["loss_mask"]}
    if mpu.get_context_parallel_world_size() > 1:  # megatron's zigzag split, as the CP attentions expect
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return batch


def loss_func(loss_mask, output_tensor):
    """Megatron's per-token reduction: (sum of masked token losses, token count, report); the
    loop divides by the tokens of the whole global batch."""
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    if return_schedule_plan:
        raise NotImplementedError(f"{_TAG} MoE schedule plans are not supported (no MoE here)")
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    b = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])
    return output, functools.partial(loss_func, b["loss_mask"])


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPTDataset splits over ``--data-path`` (or megatron's mock dataset with ``--mock-data``),
    built on tensor-parallel rank 0 of each data-parallel replica (the others receive batches
    by broadcast)."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False, num_dataset_builder_threads=args.num_dataset_builder_threads,
    )
    kind = MockGPTDataset if args.mock_data else GPTDataset
    _say(f"building {kind.__name__} splits {list(train_val_test_num_samples)} (samples)")
    built = BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()
    return tuple(built)


# the loop builds datasets on every rank that needs them and broadcasts nothing itself
train_valid_test_datasets_provider.is_distributed = True


# ------------------------------------------------------------------------------ the optimizer
def _patch_optimizer_builder() -> None:
    """megatron.training builds the optimizer itself (``training.get_megatron_optimizer``);
    wrap that one name so the instance it returns gets our fixes. Logged once."""
    from megatron.training import training

    built = training.get_megatron_optimizer
    if getattr(built, "_nemo_ssa", False):
        return

    @functools.wraps(built)
    def get_megatron_optimizer(*a, **k):
        from nemo_ssa.megatron.optimizer_fixes import patch_megatron_optimizer

        opt = built(*a, **k)
        done = patch_megatron_optimizer(opt)
        _say("optimizer: " + ("; ".join(done) if done else "no nemo_ssa fix needed"))
        return opt

    get_megatron_optimizer._nemo_ssa = True
    training.get_megatron_optimizer = get_megatron_optimizer


def _use_prebuilt_dataset_helpers() -> None:
    """megatron.training's start-up runs ``make`` in ``megatron/core/datasets`` on rank 0 to
    build the C++ dataset helpers (``_compile_dependencies``); the megatron-core 0.19 wheel ships
    them prebuilt (``helpers_cpp.cpython-312-*.so``) but no Makefile, so that ``make`` fails and
    the run exits ("Failed to compile the C++ dataset helper functions"; seen on an H200 with
    0.19.2). Where the prebuilt module imports, the compile step is skipped; otherwise
    megatron's own step runs (a source checkout has the Makefile)."""
    from megatron.core.datasets import utils

    make = utils.compile_helpers
    if getattr(make, "_nemo_ssa", False):
        return

    def compile_helpers():
        try:
            import megatron.core.datasets.helpers_cpp  # noqa: F401
        except ImportError:
            return make()
        _say("dataset helpers: megatron-core's prebuilt helpers_cpp imports; megatron's make step skipped")

    compile_helpers._nemo_ssa = True
    utils.compile_helpers = compile_helpers


def _default_corpus() -> Tuple[str, str]:
    """(prefix, tokenizer dir) of the embedded corpus (nemo_ssa/configs/data/stdlib.yaml's), built on
    first use by the first rank of the node (the others wait on its lock, then reuse it)."""
    from nemo_ssa.data import DEFAULT_VOCAB_SIZE, build_corpus_locked, default_corpus_dir

    info = build_corpus_locked(default_corpus_dir(), vocab_size=DEFAULT_VOCAB_SIZE, quiet=not _rank0())
    return info.prefix, info.tokenizer_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    version = check_megatron()
    user_data = _has(argv, "--data-path", "--train-data-path", "--data-args-path", "--mock-data")
    preset, full = build_argv(argv, None if user_data else _default_corpus())
    _say(f"megatron-core {version}, preset {preset}; Megatron-LM arguments:\n  " + " ".join(full))

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from nemo_ssa.megatron.compat import apply_megatron_compat

    apply_megatron_compat()
    _patch_optimizer_builder()
    _use_prebuilt_dataset_helpers()
    sys.argv = [sys.argv[0], *full]
    args = parse_and_validate_args()
    check_args(args)
    model_cfg = gpt_config_from_args(args)
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
