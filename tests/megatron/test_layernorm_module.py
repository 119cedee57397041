"""FusedLayerNorm1P (nemo_ssa/megatron/layernorm.py) against LayerNorm1P on CPU.

- model level: a tiny GPT built through ``layer_spec(fused_layernorm=true)`` has the fused
  norm in every layer and as the final norm (the Triton kernels in the interpreter) and
  gives the torch path's loss and gradients in fp32;
- module level, fp16: within 2x the error of the torch path's fp16 LayerNorm against fp64;
- the option: auto is off without CUDA; true with a hidden size the kernels cannot hold is
  refused when the model is built, naming what is supported; the run config refuses
  unknown values.
"""

import pytest
import torch
from megatron.core.activations import squared_relu
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_ssa.megatron.cpu import cpu_device_shims
from nemo_ssa.megatron.layernorm import FusedLayerNorm1P, LayerNorm1P, parse_fused_layernorm, use_fused_layernorm
from nemo_ssa.megatron.spec import layer_spec
from nemo_ssa.testing.tiny_gpt import assert_same_loss_and_grads, tiny_gpt
from nemo_ssa.ops.norm import fused as fused_op
from nemo_ssa.testing import assert_within_2x_eager

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model-level test (megatron_cpu, interpreter)")

S, B, HIDDEN, HEADS, VOCAB = 9, 2, 64, 4, 64


def make_config(**overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=128, num_attention_heads=HEADS, num_query_groups=2,
              use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False,
              activation_func=squared_relu, add_bias_linear=False, gated_linear_unit=False,
              bias_activation_fusion=False, layernorm_zero_centered_gamma=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(fused_layernorm, cfg=None):
    cfg = cfg or make_config()
    return tiny_gpt(cfg, layer_spec(cfg, attention="softmax", fused_mlp=False, fused_layernorm=fused_layernorm),
                    VOCAB, S)


def test_gpt_with_fused_layernorm_gives_the_torch_paths_loss_and_grads(megatron_cpu, monkeypatch):
    launches = []
    real = fused_op._launch_bwd
    monkeypatch.setattr(fused_op, "_launch_bwd", lambda *a: launches.append(1) or real(*a))
    fused, stock = build_gpt("true"), build_gpt(False)
    with torch.no_grad():  # trained-looking norms, not the zero init (1 + 0 hides the scale's form)
        for name, p in fused.named_parameters():
            if "layernorm" in name:
                p.normal_(0, 0.1)
    stock.load_state_dict(fused.state_dict())
    norms = [m for m in fused.modules() if isinstance(m, LayerNorm1P)]
    assert len(norms) == 2 * 2 + 1 and all(type(m) is FusedLayerNorm1P for m in norms)
    assert all(type(m) is LayerNorm1P for m in stock.modules() if isinstance(m, LayerNorm1P))
    assert_same_loss_and_grads(fused, stock, torch.randint(0, VOCAB, (B, S)), "layernorm", grad_rtol=1e-4)
    assert len(launches) == 5  # every norm's backward ran the Triton kernel


def test_module_fp16_within_2x_of_the_torch_paths_fp16(megatron_cpu):
    cfg = make_config(params_dtype=torch.float16, fp16=True)
    with cpu_device_shims():
        stock, fused = LayerNorm1P(cfg, HIDDEN), FusedLayerNorm1P(cfg, HIDDEN)
        ref = LayerNorm1P(make_config(params_dtype=torch.float64), HIDDEN)
    with torch.no_grad():
        for m in (stock, fused, ref):
            m.weight.copy_(torch.linspace(-0.2, 0.3, HIDDEN))
            m.bias.copy_(torch.linspace(0.1, -0.1, HIDDEN))
    x = torch.randn(S, B, HIDDEN, dtype=torch.float64) * 3 + 1
    dy = torch.randn(S, B, HIDDEN, dtype=torch.float64)

    def run(m, dtype):
        m.zero_grad(set_to_none=True)
        xx = x.to(dtype).requires_grad_()
        y = m(xx)
        y.backward(dy.to(dtype))
        return [y.detach(), xx.grad, m.weight.grad, m.bias.grad]

    for g, e, w, name in zip(run(fused, torch.float16), run(stock, torch.float16), run(ref, torch.float64),
                             ("y", "dx", "dw", "db")):
        assert g.dtype == torch.float16
        assert_within_2x_eager(g, e, w, name=name)


def test_auto_is_torchs_layernorm_without_cuda(megatron_cpu):
    assert not use_fused_layernorm(make_config(), "auto")
    model = build_gpt("auto", make_config(num_layers=1))
    assert type(model.decoder.final_layernorm) is LayerNorm1P


def test_true_with_an_unsupported_hidden_size_is_refused_at_build(megatron_cpu):
    cfg = make_config(num_layers=1)
    cfg.hidden_size = fused_op.MAX_N + 16  # set after construction: no model is built
    with pytest.raises(ValueError, match="hidden size") as e:
        layer_spec(cfg, attention="softmax", fused_mlp=False, fused_layernorm=True)
    assert "supported:" in str(e.value) and "\n" not in str(e.value)
    assert not use_fused_layernorm(cfg, "auto")


def test_option_values():
    assert [parse_fused_layernorm(v) for v in ("auto", None, "true", "False", True, False)] == [
        None, None, True, False, True, False]
    with pytest.raises(ValueError, match="supported: auto, true, false"):
        parse_fused_layernorm("yes")


def test_run_config_check_refuses_unknown_values():
    from nemo_ssa.config.check import check_fused_layernorm, check_run_config

    for v in ("auto", "true", False, None):
        check_fused_layernorm(v)
    with pytest.raises(ValueError, match="model.fused_layernorm='on' is not supported"):
        check_fused_layernorm("on")
    cfg = {"attention": {"name": "softmax"}, "policy": "pinned", "seed": 1,
           "train": {"tensor_parallel": 1, "num_gpus_per_node": 1, "precision": "bf16-mixed",
                     "micro_batch_size": 1, "global_batch_size": 1},
           "model": {"fused_layernorm": "on"}}
    with pytest.raises(ValueError, match="fused_layernorm"):
        check_run_config(cfg, cuda=True)
