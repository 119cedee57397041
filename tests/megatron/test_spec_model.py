"""The recipe's model, built the way the CPU loop builds it (NeMo config -> megatron GPTModel).

Checks the spec end to end: the core attention each layer gets, LayerNorm1P everywhere,
squared ReLU in the MLP, the pinned 114M parameter count (on the meta device, no
allocation) and the weight-decay groups that megatron's optimizer forms with our
``no_weight_decay_cond``.
"""


import pytest
import torch

fdl = pytest.importorskip("fiddle")

from nemo_ssa.megatron.core_attention import (  # noqa: E402
    SoftmaxCoreAttention,
    SSAReferenceCoreAttention,
    _TransformedSoftmaxAttention,
)
from nemo_ssa.megatron.cpu import cpu_device_shims  # noqa: E402
from nemo_ssa.megatron.introspect import no_weight_decay_cond  # noqa: E402
from nemo_ssa.megatron.layernorm import LayerNorm1P  # noqa: E402
from nemo_ssa.train.cpu_recipe import TINY_ARCH, shrink_for_cpu  # noqa: E402
from nemo_ssa.config.policy import PINNED  # noqa: E402

TINY_VOCAB = 512
FULL_VOCAB = 50304
SOFTMAX_114M = 114_169_344


def make_recipe(tmp_path_factory, attention):
    from recipes.nemotron_114m import pretrain_recipe

    return pretrain_recipe(dir=str(tmp_path_factory.mktemp(f"run_{attention}")),
                           attention=attention, max_steps=2)


def build_tiny(tmp_path_factory, attention):
    recipe = make_recipe(tmp_path_factory, attention)
    shrink_for_cpu(recipe)
    recipe.model.config.vocab_size = TINY_VOCAB
    with cpu_device_shims():
        cfg = fdl.build(recipe.model.config)
        model = cfg.configure_model(None)
    return recipe, cfg, model


@pytest.fixture(scope="module")
def tiny_models(megatron_cpu, tmp_path_factory):
    return {a: build_tiny(tmp_path_factory, a) for a in ("softmax", "ssa", "ssa_reference")}


def build_full_on_meta(tmp_path_factory, attention):
    recipe = make_recipe(tmp_path_factory, attention)
    recipe.model.config.vocab_size = FULL_VOCAB
    recipe.model.config.init_model_with_meta_device = True
    # without this megatron places weights on current_device() explicitly (-> CPU here)
    recipe.model.config.use_cpu_initialization = True
    with cpu_device_shims():
        cfg = fdl.build(recipe.model.config)
        model = cfg.configure_model(None)
    return cfg, model


@pytest.fixture(scope="module")
def full_models(megatron_cpu, tmp_path_factory):
    return {a: build_full_on_meta(tmp_path_factory, a) for a in ("softmax", "ssa")}


# ------------------------------------------------------------------------ architecture
EXPECTED_CLASS = {
    "softmax": SoftmaxCoreAttention,
    "ssa": SSAReferenceCoreAttention,  # on CPU the policy's cpu_kernel (GPU: ssa_triton)
    "ssa_reference": SSAReferenceCoreAttention,
}


@pytest.mark.parametrize("attention", ["softmax", "ssa", "ssa_reference"])
def test_every_layer_gets_the_expected_core_attention(tiny_models, attention):
    from nemo_ssa.megatron.spec import CORE_ATTENTIONS

    _, cfg, model = tiny_models[attention]
    if attention == "ssa":  # `ssa` means whatever the pinned policy names
        assert PINNED.pinned_kernel == "ssa_triton" and PINNED.cpu_kernel == "ssa_reference"
        assert CORE_ATTENTIONS[PINNED.cpu_kernel] is EXPECTED_CLASS["ssa"]
        assert CORE_ATTENTIONS[PINNED.pinned_kernel].__name__ == "SSATritonCoreAttention"
    layers = model.decoder.layers
    assert len(layers) == cfg.num_layers == TINY_ARCH["num_layers"]
    for i, layer in enumerate(layers):
        assert type(layer.self_attention.core_attention) is EXPECTED_CLASS[attention], i
        assert layer.self_attention.core_attention.layer_number == i + 1
    found = [m for m in model.modules() if isinstance(m, _TransformedSoftmaxAttention)]
    assert len(found) == cfg.num_layers


@pytest.mark.parametrize("attention", ["softmax", "ssa"])
def test_layer_norms_are_layernorm1p(tiny_models, attention):
    _, cfg, model = tiny_models[attention]
    assert cfg.layernorm_zero_centered_gamma  # nemotron's layernorm1p
    norms = {name: m for name, m in model.named_modules()
             if "norm" in type(m).__name__.lower() and type(m).__name__ != "IdentityOp"}
    expected_names = {"decoder.final_layernorm"}
    for i in range(cfg.num_layers):
        expected_names |= {f"decoder.layers.{i}.input_layernorm", f"decoder.layers.{i}.pre_mlp_layernorm"}
    assert set(norms) == expected_names
    for name, m in norms.items():
        assert type(m) is LayerNorm1P, name
        assert m.zero_centered_gamma, name
        assert torch.count_nonzero(m.weight) == 0, name  # stored gamma starts at 0: scale 1 + 0


@pytest.mark.parametrize("attention", ["softmax", "ssa"])
def test_mlp_is_squared_relu(tiny_models, attention):
    _, cfg, model = tiny_models[attention]
    x = torch.linspace(-3.0, 3.0, 13)
    torch.testing.assert_close(cfg.activation_func(x), torch.relu(x) ** 2)
    assert not cfg.gated_linear_unit
    # ... and the built MLP computes fc2(relu(fc1 x)^2)
    mlp = model.decoder.layers[0].mlp
    h = torch.randn(3, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out, bias = mlp(h)
    ref = (torch.relu(h @ mlp.linear_fc1.weight.T) ** 2) @ mlp.linear_fc2.weight.T
    if bias is not None:
        ref = ref + bias
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------- parameter count
def expected_param_count(arch, vocab):
    """Independent count for the tied-embedding, bias-free nemotron block."""
    h, L, ffn = arch["hidden_size"], arch["num_layers"], arch["ffn_hidden_size"]
    heads, groups = arch["num_attention_heads"], arch["num_query_groups"]
    kv = arch["kv_channels"] or h // heads
    qkv = h * (heads * kv + 2 * groups * kv)
    proj = heads * kv * h
    mlp = 2 * h * ffn
    norms = 2 * (2 * h)  # two LayerNorm1P (weight + bias) per layer
    return vocab * h + L * (qkv + proj + mlp + norms) + 2 * h  # + final norm; output tied


def test_softmax_114m_parameter_count(full_models):
    from recipes.nemotron_114m import ARCH

    cfg, model = full_models["softmax"]
    assert next(model.parameters()).device.type == "meta"  # nothing allocated
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
            cfg.ffn_hidden_size, cfg.kv_channels) == (12, 768, 24, 8, 3072, 32)
    count = sum(p.numel() for p in model.parameters())
    assert count == SOFTMAX_114M
    assert expected_param_count(ARCH, FULL_VOCAB) == SOFTMAX_114M


def test_ssa_adds_exactly_one_n_per_layer(full_models):
    soft = dict(full_models["softmax"][1].named_parameters())
    ssa = dict(full_models["ssa"][1].named_parameters())
    assert sum(p.numel() for p in ssa.values()) == SOFTMAX_114M + 12
    extra = set(ssa) - set(soft)
    assert extra == {f"decoder.layers.{i}.self_attention.core_attention.n" for i in range(12)}
    assert set(soft) <= set(ssa)
    assert all(ssa[k].shape == (1,) for k in extra)
    assert all(ssa[k].shape == soft[k].shape for k in soft)


# ------------------------------------------------------------------------ weight decay
def test_optimizer_exempts_ssa_n_from_weight_decay(megatron_cpu, tmp_path_factory):
    from nemo_ssa.train.ddp import wrap_for_training

    recipe, cfg, model = build_tiny(tmp_path_factory, "ssa")
    with cpu_device_shims():
        opt_cfg = fdl.build(recipe.optim.config)
        ddp, optimizer = wrap_for_training(cfg, model, opt_cfg)
    assert opt_cfg.weight_decay == pytest.approx(0.1)

    names = {id(p): n for n, p in ddp.module.named_parameters()}
    effective_wd = {}
    for group in optimizer.param_groups:
        wd = group["weight_decay"] * group.get("wd_mult", 1.0)
        for p in group["params"]:
            effective_wd[names[id(p)]] = wd
    assert set(effective_wd) == set(names.values())  # every parameter is in some group

    ns = [k for k in effective_wd if k.endswith("core_attention.n")]
    assert len(ns) == cfg.num_layers
    assert all(effective_wd[k] == 0.0 for k in ns), {k: effective_wd[k] for k in ns}
    matrices = [n for n, p in ddp.module.named_parameters() if p.dim() == 2]
    assert len(matrices) >= 4 * cfg.num_layers + 1
    assert all(effective_wd[k] == pytest.approx(0.1) for k in matrices)


class _Chunks(list):
    """What NeMo hands setup_megatron_optimizer: its MegatronParallel (a list of model chunks
    whose .module is megatron's DDP, with the DDP config on it)."""

    def __init__(self, chunks, ddp_config):
        super().__init__(chunks)
        self.ddp_config = ddp_config


def test_nemo_optimizer_setup_exempts_ssa_n_on_this_megatron(megatron_cpu, tmp_path_factory):
    """NeMo 2.7.3 builds the optimizer with get_megatron_optimizer(no_weight_decay_cond=,
    scale_lr_cond=, lr_mult=), arguments megatron-core 0.16 removed: the recipe's optimizer
    module calls it inside compat.legacy_optimizer_arguments, which translates them; on 0.15
    it changes nothing. Either way n ends up without weight decay."""
    import inspect
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from nemo.lightning._strategy_lib import setup_megatron_optimizer

    import megatron.core.optimizer as mo
    from nemo_ssa.megatron.compat import legacy_optimizer_arguments

    recipe, cfg, model = build_tiny(tmp_path_factory, "ssa")
    with cpu_device_shims():
        opt_cfg = fdl.build(recipe.optim.config)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        with legacy_optimizer_arguments():
            chunks = [SimpleNamespace(module=ddp)]
            opt = setup_megatron_optimizer(_Chunks(chunks, ddp.ddp_config), opt_cfg,
                                           no_weight_decay_cond=no_weight_decay_cond)
    assert "no_weight_decay_cond" in inspect.signature(mo.get_megatron_optimizer).parameters or \
        mo.get_megatron_optimizer.__name__ == "get_megatron_optimizer"  # restored on exit
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    wd = {names[id(p)]: g["weight_decay"] for g in opt.mcore_optimizer.param_groups for p in g["params"]}
    ns = [k for k in wd if k.endswith("core_attention.n")]
    assert len(ns) == cfg.num_layers and all(wd[k] == 0.0 for k in ns), wd
    assert all(wd[n] == pytest.approx(0.1) for n, p in ddp.module.named_parameters() if p.dim() == 2)


def test_zero_dim_n_is_exempt_through_our_condition():
    import inspect

    from megatron.core.optimizer import _get_param_groups

    if "no_weight_decay_cond" not in inspect.signature(_get_param_groups).parameters:
        pytest.skip("megatron-core >= 0.16 groups parameters by ParamKey (covered by the optimizer tests)")

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n = torch.nn.Parameter(torch.tensor(1.5))  # 0-d: megatron's default rule decays it

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.core_attention = Attn()
            self.other = Attn()  # same shape, not an SSA name
            self.proj = torch.nn.Linear(4, 4, bias=False)

    layer = Layer()
    name_n, name_other = "core_attention.n", "other.n"
    assert no_weight_decay_cond(name_n, layer.core_attention.n)
    assert not no_weight_decay_cond(name_other, layer.other.n)
    assert not no_weight_decay_cond("proj.weight", layer.proj.weight)

    def wd_mult_of(cond):
        groups = _get_param_groups([layer], cond, None, 1.0, 1e-3, 0.0, None, None)
        return {id(p): g["wd_mult"] for g in groups for p in g["params"]}

    ours = wd_mult_of(no_weight_decay_cond)
    assert ours[id(layer.core_attention.n)] == 0.0
    assert ours[id(layer.other.n)] == 1.0
    assert ours[id(layer.proj.weight)] == 1.0
    default = wd_mult_of(None)  # negative control: megatron's own rule decays a 0-d n
    assert default[id(layer.core_attention.n)] == 1.0


def test_init_on_cpu_sets_megatrons_cpu_initialisation(tmp_path):
    """model.init_on_cpu sets megatron's use_cpu_initialization (the full weight from one CPU
    generator, then split: the CPU layout tests, which always initialise so, show TP2
    reproducing one rank); the default keeps megatron's GPU init."""
    from recipes.nemotron_114m import pretrain_recipe

    on = pretrain_recipe(dir=str(tmp_path / "a"), attention="ssa", max_steps=2, init_on_cpu=True)
    off = pretrain_recipe(dir=str(tmp_path / "b"), attention="ssa", max_steps=2)
    assert on.model.config.use_cpu_initialization is True
    assert not getattr(off.model.config, "use_cpu_initialization", False)
