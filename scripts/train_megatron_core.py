"""Train a GPT with a nemo-ssa attention through plain megatron-core: no NeMo, no Lightning.

    python scripts/train_megatron_core.py --attention ssa --steps 20                 # CPU or 1 GPU
    torchrun --nproc-per-node=2 scripts/train_megatron_core.py --attention ssa_triton --tp 2
    python scripts/train_megatron_core.py --attention ssa --save ck --save-at 10     # stop at 10 ...
    python scripts/train_megatron_core.py --attention ssa --load ck                  # ... resume 11-20
    python scripts/train_megatron_core.py --attention ssa --cuda-graph local         # 1 GPU: megatron's layer graphs

What a megatron-core user needs from nemo-ssa is three things, and this script is their
whole use (docs/megatron-core.md walks through it):

1. the layer spec: ``nemo_ssa.megatron.spec.layer_spec(config, attention)`` (the block:
   every layer plus the final LayerNorm1P) into ``GPTModel(config, transformer_layer_spec=...)``;
   ``nemo_ssa.megatron.layer_specs.<attention>`` is one layer's ``ModuleSpec``, what
   Megatron-LM's ``--spec`` takes (megatron's own final norm then: no zero-centred gamma, no SP);
2. the optimizer: ``nemo_ssa.megatron.compat.get_megatron_optimizer_compat`` with
   ``nemo_ssa.megatron.introspect.no_weight_decay_cond`` (SSA's n is not decayed; works on
   megatron-core 0.15 and 0.16), then ``optimizer_fixes.patch_megatron_optimizer`` (fp32 n
   inside bf16 models, the distributed optimizer's checkpoints with torch's Adam);
3. nothing else: the core attention applies causality itself (no attention mask), TP/CP
   reductions of n are inside the module.

``--cuda-graph local`` trains with megatron-core's own layerwise CUDA graphs
(``nemo_ssa.megatron.cuda_graphs``: the config fields, the cudagraphable RNG tracker, and
``create_cudagraphs()`` after each fwd+bwd, which megatron's schedules would call and this
loop, calling the model itself, calls); refused without CUDA, at TP or CP > 1 and for
attentions whose layers have not run under the graphs (``check_cuda_graphs``).

Data here is random tokens with a learnable pattern (each next token = token + 1 mod V), so
the loss falls within a few steps; bring your own dataset in its place. On a machine without
CUDA it runs on gloo with megatron's CUDA placements redirected (``nemo_ssa.megatron.cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

import torch  # noqa: E402


def build(args, cuda: bool):
    from megatron.core.activations import squared_relu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from nemo_ssa.megatron import layer_specs
    from nemo_ssa.megatron.compat import get_megatron_optimizer_compat
    from nemo_ssa.megatron.cuda_graphs import cuda_graph_fields
    from nemo_ssa.megatron.introspect import no_weight_decay_cond
    from nemo_ssa.megatron.optimizer_fixes import patch_megatron_optimizer
    from nemo_ssa.megatron.spec import layer_spec

    if args.attention not in layer_specs.ALL:
        raise SystemExit(f"--attention {args.attention!r}: one of {sorted(layer_specs.ALL)} "
                         "(others through nemo_ssa.megatron.spec.gpt_layer_spec(name, policy='free'))")
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=4 * args.hidden, kv_channels=args.hidden // args.heads,
        tensor_model_parallel_size=args.tp, sequence_parallel=args.tp > 1, context_parallel_size=args.cp,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        layernorm_zero_centered_gamma=True, activation_func=squared_relu, bf16=cuda, params_dtype=torch.bfloat16 if cuda else torch.float32,
        **cuda_graph_fields(args.cuda_graph),
    )
    # the block spec (all layers + our final LayerNorm1P): megatron's own final norm would
    # refuse zero-centred gamma and sequence parallel; layer_specs.<name> (one layer) is for
    # Megatron-LM's --spec, where megatron builds the rest
    spec = layer_spec(config, args.attention, fused_mlp=args.fused_mlp)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True)
    if cuda:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model.cuda())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer_compat(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.1, bf16=cuda, clip_grad=1.0),
        [ddp], no_weight_decay_cond=no_weight_decay_cond)
    patch_megatron_optimizer(opt)
    return config, ddp, opt


class _ConstantLR:
    """This script's learning rate never changes: the scheduler slot of a checkpoint is empty."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def batch(args, step: int, device):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    tokens = (start + torch.arange(args.seq + 1)) % args.vocab
    b = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:].contiguous(),
         "position_ids": torch.arange(args.seq).expand(args.batch, -1).contiguous()}
    b = {k: v.to(device) for k, v in b.items()}
    return get_batch_on_this_cp_rank(b) if parallel_state.get_context_parallel_world_size() > 1 else b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="ssa")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--fused-mlp", default="false", choices=("auto", "true", "false"),
                    help="the squared-ReLU MLP fused into its GEMMs (CUDA, TP 1); auto: where it runs")
    ap.add_argument("--cuda-graph", default="none", choices=("none", "local"),
                    help="local: megatron-core's layerwise CUDA graphs (cuda_graph_impl='local'; CUDA, TP 1, CP 1)")
    ap.add_argument("--out", default=None, help="write {losses, n} as JSON (global rank 0)")
    ap.add_argument("--save", default=None, help="checkpoint directory: megatron dist_checkpointing (torch_dist) "
                                                 "through nemo_ssa.train.checkpoint_io, at --save-at (default: the end)")
    ap.add_argument("--save-at", type=int, default=None, help="the step after which --save writes")
    ap.add_argument("--load", default=None, help="resume from the newest loadable checkpoint in this directory")
    args = ap.parse_args(argv)

    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_ssa.megatron.compat import apply_megatron_compat
    from nemo_ssa.megatron.cuda_graphs import capture_recorded_graphs
    from nemo_ssa.megatron.introspect import ssa_values

    cuda = torch.cuda.is_available()
    if args.cuda_graph != "none":
        from nemo_ssa.config.check import check_cuda_graphs

        try:
            check_cuda_graphs(args.cuda_graph, cuda=cuda, attention=args.attention, tensor_parallel=args.tp,
                              context_parallel=args.cp, name="--cuda-graph")
        except (ValueError, NotImplementedError) as e:
            raise SystemExit(f"[megatron-core] {e}") from None
    apply_megatron_compat()
    from nemo_ssa.megatron.single import init_single_process

    init_single_process(1234, tp=args.tp, cp=args.cp)
    if args.cuda_graph == "local":
        from nemo_ssa.megatron.cuda_graphs import use_cudagraphable_rng_tracker

        use_cudagraphable_rng_tracker()  # before the layers are built: their CudaGraphManager asserts it
    from nemo_ssa.megatron.cpu import cpu_device_shims
    import contextlib

    shims = contextlib.nullcontext() if cuda else cpu_device_shims()
    losses = []
    with shims:
        config, ddp, opt = build(args, cuda)
        device = torch.device("cuda") if cuda else torch.device("cpu")
        first = 0
        if args.load:
            from nemo_ssa.train.checkpoint_io import load_checkpoint, resume_checkpoint

            path, skipped = resume_checkpoint(args.load)
            for bad, why in skipped:
                print(f"[megatron-core] skipped {bad}: {why}", flush=True)
            if path is None:
                raise SystemExit(f"--load {args.load}: no loadable checkpoint there")
            first, note = load_checkpoint(path, ddp, opt, _ConstantLR())
            if dist.get_rank() == 0:
                print(f"[megatron-core] loaded {path} (step {first}{note})", flush=True)
        t0 = time.time()
        for step in range(first, args.steps):
            b = batch(args, step, device)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            per_token = ddp(b["tokens"], b["position_ids"], None, labels=b["labels"])
            loss = per_token.float().mean()
            loss.backward()
            ddp.finish_grad_sync()
            capture_recorded_graphs(config)  # after the first step: each layer's graphs (a no-op without)
            opt.step()
            reduced = loss.detach().clone()
            dist.all_reduce(reduced, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            reduced /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
            losses.append(float(reduced))
            if dist.get_rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
                print(f"[megatron-core] step {step + 1}/{args.steps} loss {losses[-1]:.4f}", flush=True)
            if args.save and step + 1 == (args.save_at or args.steps):
                from nemo_ssa.train.checkpoint_io import save_checkpoint

                path = save_checkpoint(args.save, step + 1, ddp, opt, _ConstantLR())
                if dist.get_rank() == 0:
                    print(f"[megatron-core] saved {path}", flush=True)
        n = {int(k): float(v) for k, v in ssa_values(ddp)["n"].items()}
    if dist.get_rank() == 0:
        from nemo_ssa.megatron.cuda_graphs import graphs_created

        graphs = {"mode": args.cuda_graph, "captured": graphs_created()}
        print(f"[megatron-core] {args.attention}: steps {first + 1}-{args.steps} in {time.time() - t0:.1f} s, "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" + (f", n {n}" if n else "")
              + f", CUDA graphs {graphs['mode']} (captured: {graphs['captured']})", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"first_step": first + 1, "losses": losses, "n": n, "cuda_graphs": graphs}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
