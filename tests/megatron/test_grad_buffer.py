"""The gradient buffer in the parameters' dtype (nemo_ssa.nemo.callbacks.grad_buffer_in_param_dtype):
decided only where megatron's DDP and optimizer then give the same parameters bit for bit."""

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_ssa.megatron.cpu import cpu_device_shims  # noqa: E402
from nemo_ssa.nemo.callbacks import GradBufferCallback, grad_buffer_in_param_dtype  # noqa: E402


def _ddp_config(**kw):
    from megatron.core.distributed import DistributedDataParallelConfig

    kw.setdefault("grad_reduce_in_fp32", True)
    return DistributedDataParallelConfig(check_for_nan_in_grad=True, **kw)


@pytest.mark.parametrize("world, mbs, gbs, kw, fp32, says", [
    (1, 32, 32, {}, False, "one process, one micro batch per step"),
    (1, 8, 32, {}, True, "4 micro batches per step"),
    (2, 8, 16, {}, True, "2 processes"),
    (1, 8, 8, dict(use_distributed_optimizer=True), True, "the distributed optimizer"),
])
def test_decided_only_where_nothing_is_accumulated_or_reduced(world, mbs, gbs, kw, fp32, says):
    cfg = _ddp_config(**kw)
    said = grad_buffer_in_param_dtype(world, mbs, gbs, cfg)
    assert cfg.grad_reduce_in_fp32 is fp32 and says in said


def test_a_bf16_reduction_asked_for_is_left_alone():
    cfg = _ddp_config(grad_reduce_in_fp32=False)
    assert "as configured" in grad_buffer_in_param_dtype(4, 1, 64, cfg) and cfg.grad_reduce_in_fp32 is False


def test_the_callback_reads_the_data_module_and_says_so(capsys):
    cfg = _ddp_config()
    trainer = types.SimpleNamespace(datamodule=types.SimpleNamespace(micro_batch_size=8, global_batch_size=8),
                                    world_size=1, global_rank=0, strategy=types.SimpleNamespace(ddp_config=cfg))
    GradBufferCallback().setup(trainer, None, "fit")
    assert cfg.grad_reduce_in_fp32 is False and "[nemo_ssa] gradient buffer: the parameters' dtype" in capsys.readouterr().out


def _tiny_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, add_bias_linear=False, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                            bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=False)
    torch.manual_seed(7)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                     share_embeddings_and_output_weights=True)
    return cfg, model


def test_megatrons_step_gives_the_same_parameters_with_either_buffer(megatron_cpu):
    """One micro batch, one process: megatron's DDP + bf16 optimizer, three steps with clipping
    active, fp32 buffer vs the parameters' dtype: every parameter equal bit for bit."""
    if torch.cuda.is_available():
        pytest.skip("CPU test (the GPU path is the NeMo main job's A/B)")
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module

    from nemo_ssa.train.ddp import wrap_for_training

    results, start = {}, {}
    with cpu_device_shims():
        for fp32 in (True, False):
            cfg, model = _tiny_model()
            start[fp32] = [p.detach().clone() for p in model.parameters()]
            ddp, opt = wrap_for_training(cfg, Float16Module(cfg, model),
                                         OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.05,
                                                         use_distributed_optimizer=False),
                                         _ddp_config(grad_reduce_in_fp32=fp32))
            assert ddp.buffers[0].grad_dtype == (torch.float32 if fp32 else torch.bfloat16)
            g = torch.Generator().manual_seed(0)
            for _ in range(3):
                tokens = torch.randint(0, 64, (2, 16), generator=g)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                loss = ddp(tokens, torch.arange(16).expand(2, -1), None, labels=tokens).float().mean()
                loss.backward()
                ddp.finish_grad_sync()
                ok, norm, _ = opt.step()
                assert ok and float(norm) > 0.05  # clipping is active
            results[fp32] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(start[True], start[False]))  # the same model twice
    assert len(results[True]) == len(results[False])
    assert not all(torch.equal(a, b) for a, b in zip(start[True], results[True]))  # and it trained
    for a, b in zip(results[True], results[False]):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
