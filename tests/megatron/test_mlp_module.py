"""FusedReLU2MLP (nemo_ssa/megatron/mlp.py) against megatron-core's MLP on CPU.

- module level, same weights: fp32 (the op's torch path: megatron's math, tight
  tolerance) and fp16 (the Triton kernels in the interpreter: within 2x the error of
  megatron's own fp16 MLP against an fp64 reference), output and every gradient;
- model level: a tiny GPT built through ``layer_spec(fused_mlp=true)`` has the fused MLP
  in every layer and gives megatron's loss and gradients;
- the option: auto is off without CUDA, true with tensor parallel > 1 (or a bias, a gate,
  another activation) is refused when the model is built, naming what is supported.
"""

import pytest
import torch
from megatron.core.activations import squared_relu
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_ssa.megatron.cpu import cpu_device_shims
from nemo_ssa.megatron.mlp import FusedReLU2MLP, parse_fused_mlp, use_fused_mlp
from nemo_ssa.megatron.spec import layer_spec
from nemo_ssa.testing.tiny_gpt import assert_same_loss_and_grads, tiny_gpt
from nemo_ssa.ops.mlp import fused as fused_op
from nemo_ssa.testing import assert_within_2x_eager

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model-level test (megatron_cpu, interpreter)")

S, B, HIDDEN, FFN, HEADS, VOCAB = 9, 2, 64, 128, 4, 64


def make_config(**overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=2,
              use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False,
              activation_func=squared_relu, add_bias_linear=False, gated_linear_unit=False,
              bias_activation_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def mlp_pair(cfg, dtype):
    submodules = get_gpt_layer_local_spec(normalization="LayerNorm").submodules.mlp.submodules
    with cpu_device_shims():
        stock = build_module(MLP, config=cfg, submodules=submodules, ffn_hidden_size=FFN)
        fused = build_module(FusedReLU2MLP, config=cfg, submodules=submodules, ffn_hidden_size=FFN)
    fused.load_state_dict(stock.state_dict())
    return stock.to(dtype), fused.to(dtype)


def run(module, x, dy):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out, bias = module(x)
    assert bias is None
    out.backward(dy)
    return [out.detach(), x.grad, module.linear_fc1.weight.grad, module.linear_fc2.weight.grad]


def test_module_fp32_equals_megatrons_mlp(megatron_cpu):
    stock, fused = mlp_pair(make_config(), torch.float32)
    x = torch.randn(S, B, HIDDEN)
    dy = torch.randn(S, B, HIDDEN)
    for got, want, name in zip(run(fused, x, dy), run(stock, x, dy), ("out", "dx", "dw1", "dw2")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_module_fp16_kernels_within_2x_of_megatrons_fp16_mlp(megatron_cpu, monkeypatch):
    monkeypatch.setenv("NEMO_SSA_MLP_TILES", "fwd=16x32x16/1/4,bwd=16x32x16/1/4")
    monkeypatch.setattr(fused_op, "_empty", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype,
                                                                          device=like.device))
    calls = []
    real = fused_op._launch_bwd_du
    monkeypatch.setattr(fused_op, "_launch_bwd_du", lambda *a: calls.append(1) or real(*a))
    cfg = make_config(params_dtype=torch.float16, fp16=True)
    stock, fused = mlp_pair(cfg, torch.float16)
    ref, _ = mlp_pair(cfg, torch.float64)
    ref.load_state_dict({k: v.double() if torch.is_tensor(v) else v for k, v in fused.state_dict().items()})
    x = torch.randn(S, B, HIDDEN, dtype=torch.float16)
    dy = torch.randn(S, B, HIDDEN, dtype=torch.float16)
    got, eager, want = run(fused, x, dy), run(stock, x, dy), run(ref, x.double(), dy.double())
    assert calls == [1]  # the Triton backward kernel ran (the fp16 path, not the torch fallback)
    for g, e, w, name in zip(got, eager, want, ("out", "dx", "dw1", "dw2")):
        assert g.dtype == torch.float16
        assert_within_2x_eager(g, e, w, name=name)


def build_gpt(fused_mlp, cfg=None):
    cfg = cfg or make_config()
    return tiny_gpt(cfg, layer_spec(cfg, attention="softmax", fused_mlp=fused_mlp), VOCAB, S)


def test_gpt_with_fused_mlp_gives_megatrons_loss_and_grads(megatron_cpu):
    fused, stock = build_gpt("true"), build_gpt(False)
    stock.load_state_dict(fused.state_dict())
    assert all(type(layer.mlp) is FusedReLU2MLP for layer in fused.decoder.layers)
    assert all(type(layer.mlp) is MLP for layer in stock.decoder.layers)
    assert_same_loss_and_grads(fused, stock, torch.randint(0, VOCAB, (B, S)), "linear_fc1", grad_rtol=1e-5)


def test_auto_is_megatrons_mlp_without_cuda(megatron_cpu):
    assert not use_fused_mlp(make_config(), "auto")
    assert type(build_gpt("auto", make_config(num_layers=1)).decoder.layers[0].mlp) is MLP


@pytest.mark.parametrize("overrides, match", [
    (dict(tensor_model_parallel_size=2), "tensor_parallel=2"),
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(gated_linear_unit=True), "gated_linear_unit"),
    (dict(activation_func=torch.nn.functional.gelu), "not squared ReLU"),
    (dict(ffn_hidden_size=120), "multiple of 16"),
])
def test_true_with_an_unsupported_config_is_refused_at_build(megatron_cpu, overrides, match):
    cfg = make_config(num_layers=1)
    for k, v in overrides.items():  # set after construction: TP 2 needs no process group this way
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=match) as e:
        layer_spec(cfg, attention="softmax", fused_mlp=True)
    assert "supported:" in str(e.value) and "\n" not in str(e.value)
    assert not use_fused_mlp(cfg, "auto")  # auto keeps megatron's MLP instead
    with pytest.raises(ValueError, match=match):  # the module refuses on its own too
        mlp_pair(cfg, torch.float32)


def test_option_values():
    assert [parse_fused_mlp(v) for v in ("auto", None, "true", "False", True, False)] == [
        None, None, True, False, True, False]
    with pytest.raises(ValueError, match="supported: auto, true, false"):
        parse_fused_mlp("yes")


def test_recipe_and_config_check_refuse_true_with_tensor_parallel():
    from nemo_ssa.config.check import check_fused_mlp, check_run_config

    check_fused_mlp("true")
    check_fused_mlp("auto", tensor_parallel=2)
    with pytest.raises(ValueError, match="needs tensor_parallel=1"):
        check_fused_mlp(True, tensor_parallel=2)
    with pytest.raises(ValueError, match="supported: auto, true, false"):
        check_fused_mlp("on")
    cfg = {"attention": {"name": "softmax"}, "policy": "pinned", "seed": 1,
           "train": {"tensor_parallel": 2, "num_gpus_per_node": 2, "precision": "bf16-mixed",
                     "micro_batch_size": 1, "global_batch_size": 1},
           "model": {"fused_mlp": True}}
    with pytest.raises(ValueError, match="fused_mlp=true needs tensor_parallel=1"):
        check_run_config(cfg, cuda=True)
    cfg["model"]["fused_mlp"] = "auto"
    check_run_config(cfg, cuda=True)


def test_padding_mask_changes_nothing_and_the_0_18_builder_builds_it(megatron_cpu):
    """megatron-core 0.16+ passes ``padding_mask`` to the MLP (a dense MLP maps tokens one by
    one: the output is the same); 0.18+ builds the slot through ``as_mlp_submodule`` with
    ``config``, ``pg_collection``, ``is_mtp_layer`` and ``name`` (the keywords TransformerLayer
    passes there, tests/megatron/test_contracts.py)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    cfg = make_config()
    submodules = get_gpt_layer_local_spec(normalization="LayerNorm").submodules.mlp.submodules
    with cpu_device_shims():
        fused = FusedReLU2MLP.as_mlp_submodule(submodules=submodules, config=cfg,
                                               pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                                               is_mtp_layer=False, name="decoder.layers.0.mlp")
    x = torch.randn(S, B, HIDDEN)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, -2:] = True
    out, bias = fused(x, padding_mask=mask)
    assert bias is None
    torch.testing.assert_close(out, fused(x)[0], rtol=0, atol=0)
