"""Pretrain the 114M Nemotron with a selectable core attention (hydra launcher).

    python scripts/pretrain.py                       # attention=ssa, embedded local corpus
    python scripts/pretrain.py attention=softmax     # the baseline: one flag differs
    python scripts/pretrain.py train=gpu_9min train.max_steps=200 run_dir=runs/x

On a GPU it builds ``recipes.nemotron_114m.pretrain_recipe`` and runs it through NeMo
(nemo-run's direct executor). Without CUDA, NeMo's trainer cannot run; the same recipe
(same NeMo config, our spec, same data module) then trains through a minimal
megatron-core CPU loop at a tiny size (``model.cpu_arch``). Either way the run directory
gets ``metrics.csv``, TensorBoard events, the effective attention policy and
checkpoints, and the last line printed says where.
"""

from __future__ import annotations

import json
import logging
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout first, even where an installed nemo_ssa (e.g. the offline bundle's wheel on
# PYTHONPATH) would otherwise shadow the code being run.
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

log = logging.getLogger("nemo_ssa.pretrain")


def _train_cfg(cfg: DictConfig, cuda: bool) -> DictConfig:
    """``train=auto`` resolves to gpu_9min / cpu_smoke; explicit keys still override."""
    train = cfg.train
    if train.get("device", "auto") == "auto":
        name = "gpu_9min" if cuda else "cpu_smoke"
        base = OmegaConf.load(os.path.join(REPO, "configs", "train", f"{name}.yaml"))
        overrides = {k: v for k, v in OmegaConf.to_container(train).items()
                     if k != "device" and v is not None}
        train = OmegaConf.merge(base, overrides)
    if train.device == "gpu" and not cuda:
        raise SystemExit("train config asks for a GPU (device=gpu) but CUDA is not available; "
                         "use train=cpu_smoke (or train=auto)")
    return train


def _data(cfg: DictConfig):
    """(prefix, tokenizer_dir): the user's dataset, or the embedded corpus (built once)."""
    data = cfg.data
    if data.get("prefix"):
        if not data.get("tokenizer_dir"):
            raise SystemExit("data.prefix needs data.tokenizer_dir (the tokenizer the dataset was built with)")
        return str(data.prefix), str(data.tokenizer_dir)
    from nemo_ssa.data import build_corpus, default_corpus_dir

    out = data.get("dir") or default_corpus_dir()
    info = build_corpus(out, source=data.source, vocab_size=int(data.vocab_size),
                        max_bytes=data.get("max_bytes"))
    return info.prefix, info.tokenizer_dir


def build_recipe(cfg: DictConfig, train: DictConfig, prefix: str, tokenizer_dir: str, run_dir: str):
    from recipes import nemotron_114m
    from nemo_ssa.policy import resolve_attention

    options = {k: v for k, v in OmegaConf.to_container(cfg.attention.options).items() if v is not None}
    resolved = resolve_attention(cfg.attention.name, options, policy=cfg.policy)
    resolved.write(run_dir)
    recipe = nemotron_114m.pretrain_recipe(
        dir=run_dir,
        name=f"{resolved.name}",
        num_nodes=int(train.get("num_nodes", 1)),
        num_gpus_per_node=int(train.get("num_gpus_per_node", 1)),
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
        val_check_interval=int(train.get("val_check_interval", train.max_steps)),
        limit_val_batches=int(train.get("limit_val_batches", 1)),
        ckpt_every_n_steps=train.get("ckpt_every_n_steps"),
        vocab_size=cfg.model.get("vocab_size"),
        num_workers=int(train.get("num_workers", 2)),
        precision=str(train.precision),
        use_distributed_optimizer=bool(train.get("distributed_optimizer") or False),
    )
    return recipe, resolved


def run_gpu(cfg, train, recipe, resolved, run_dir) -> None:
    import nemo_run as run

    from nemo_ssa.nemo.callbacks import AttentionWarmupCallback, MetricsCallback

    callbacks = list(recipe.trainer.callbacks or [])
    callbacks.append(run.Config(MetricsCallback, run_dir=run_dir, seq_length=int(train.seq_length),
                                global_batch_size=int(train.global_batch_size), attention=resolved.name))
    if cfg.warmup:
        callbacks.append(run.Config(AttentionWarmupCallback, micro_batch_size=int(train.micro_batch_size),
                                    seq_length=int(train.seq_length)))
    recipe.trainer.callbacks = callbacks
    recipe.resume.resume_if_exists = bool(cfg.resume)
    print(f"[pretrain] path: NeMo trainer on {os.environ.get('CUDA_VISIBLE_DEVICES', 'all')} GPU(s), "
          f"attention={resolved.name}", flush=True)
    run.run(recipe, direct=True)


def run_cpu(cfg, train, recipe, run_dir) -> None:
    from nemo_ssa.nemo.cpu_loop import shrink_for_cpu, train_on_cpu

    shrink_for_cpu(recipe, arch=OmegaConf.to_container(cfg.model.cpu_arch))
    train_on_cpu(
        recipe, run_dir,
        max_steps=int(train.max_steps),
        log_every=int(train.log_every_n_steps),
        ckpt_every=train.get("ckpt_every_n_steps"),
        resume=bool(cfg.resume),
        warmup=bool(cfg.warmup),
        seed=int(cfg.seed),
    )


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    import torch

    cuda = torch.cuda.is_available()
    train = _train_cfg(cfg, cuda)
    run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
        resolved_cfg["train"] = OmegaConf.to_container(train, resolve=True)
        f.write(OmegaConf.to_yaml(resolved_cfg))
    prefix, tokenizer_dir = _data(cfg)
    recipe, resolved = build_recipe(cfg, train, prefix, tokenizer_dir, run_dir)
    print(f"[pretrain] attention={cfg.attention.name} -> {resolved.name} (policy={cfg.policy}); "
          f"options {json.dumps(resolved.options)}", flush=True)
    if cuda:
        run_gpu(cfg, train, recipe, resolved, run_dir)
    else:
        run_cpu(cfg, train, recipe, run_dir)
    print(f"[pretrain] done. logs: {run_dir} (metrics.csv, tb/, attention_policy.json, checkpoints/)", flush=True)


if __name__ == "__main__":
    main()
