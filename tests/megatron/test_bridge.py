"""nemo_ssa.megatron.bridge: the callable for Megatron-Bridge's ``GPTModelProvider.transformer_layer_spec``.

Megatron-Bridge does not install here (Python 3.11); a stand-in provider -- a dataclass
subclassing megatron's ``TransformerConfig`` with a few of the provider's own fields -- is
built the way ``GPTModelProvider.provide`` builds its model: the callable with ``vp_stage``
where its signature has it, then megatron's ``GPTModel`` from the result.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from typing import Any, Optional

import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend

from nemo_ssa.megatron import bridge, te_spec
from nemo_ssa.megatron.core_attention import SoftmaxCoreAttention, SSAReferenceCoreAttention
from nemo_ssa.megatron.cpu import cpu_device_shims


@dataclasses.dataclass
class StandInProvider(TransformerConfig):
    """What our callable sees of Bridge's GPTModelProvider: a TransformerConfig with fields of its own."""

    seq_length: int = 16
    vocab_size: int = 64
    share_embeddings_and_output_weights: bool = True
    transformer_layer_spec: Any = None


def provider(**overrides) -> StandInProvider:
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, transformer_impl="local",
              use_cpu_initialization=True, add_bias_linear=False, apply_rope_fusion=False,
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False,
              layernorm_zero_centered_gamma=True, activation_func=lambda x: torch.relu(x) ** 2)
    kw.update(overrides)
    return StandInProvider(**kw)


def spec_for(p: StandInProvider, vp_stage: Optional[int] = None):
    """The call GPTModelProvider.provide makes (megatron/bridge/models/gpt_provider.py)."""
    fn = p.transformer_layer_spec
    return fn(p, vp_stage=vp_stage) if "vp_stage" in inspect.signature(fn).parameters else fn(p)


def provide(p: StandInProvider, vp_stage: Optional[int] = None, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(p, transformer_layer_spec=spec_for(p, vp_stage), vocab_size=p.vocab_size,
                    max_sequence_length=p.seq_length, position_embedding_type="rope",
                    share_embeddings_and_output_weights=p.share_embeddings_and_output_weights,
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


@pytest.mark.parametrize("attention,cls", [("ssa", SSAReferenceCoreAttention), ("softmax", SoftmaxCoreAttention)])
def test_a_gpt_model_from_the_callable_trains_a_step_on_cpu(megatron_cpu, attention, cls):
    if torch.cuda.is_available():
        pytest.skip("CPU test (ssa resolves to ssa_triton with CUDA)")
    p = provider(transformer_layer_spec=bridge.layer_spec_for_bridge(attention))
    with cpu_device_shims():
        model = provide(p)
        tokens = torch.randint(0, p.vocab_size, (2, p.seq_length))
        loss = model(tokens, torch.arange(p.seq_length).expand(2, -1), None, labels=tokens)
        loss.mean().backward()
    assert loss.shape == (2, p.seq_length) and torch.isfinite(loss).all()
    cores = [m for m in model.modules() if isinstance(m, cls)]
    assert len(cores) == p.num_layers
    grads = {n: q.grad for n, q in model.named_parameters() if q.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None or not torch.isfinite(g).all()]
    if attention == "ssa":  # the policy's learnable n reaches the optimizer with a gradient
        assert all(c.n.grad is not None and c.n.grad.abs().sum() > 0 for c in cores)


def test_the_callable_takes_vp_stage_and_pickles_by_name():
    fn = bridge.layer_spec_for_bridge("ssa_reference", {"n": 1.5})
    assert list(inspect.signature(fn).parameters)[:2] == ["provider", "vp_stage"]
    assert fn.func is bridge.bridge_layer_spec and fn.args == ()  # keywords only: Bridge's YAML dump names them
    again = pickle.loads(pickle.dumps(fn))
    assert again.func is fn.func and again.keywords == fn.keywords


def test_vp_stage_decides_the_layers_built(megatron_cpu):
    """Two virtual stages of one pipeline rank, 3 and 1 decoder layers: what megatron builds
    for each is what our spec holds."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    p = provider(num_layers=4, pipeline_model_parallel_layout="Ettt|tL", virtual_pipeline_model_parallel_size=2,
                 transformer_layer_spec=bridge.layer_spec_for_bridge("softmax"))
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        counts = [len(spec_for(p, vp_stage=s).layer_specs) for s in (0, 1)]
        assert counts == [get_num_layers_to_build(p, vp_stage=s) for s in (0, 1)] == [3, 1]
        with cpu_device_shims():
            last = provide(p, vp_stage=1, pre_process=False, post_process=True)
        assert len(last.decoder.layers) == 1
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_a_bad_attention_name_fails_when_bridge_builds_with_the_known_list():
    fn = bridge.layer_spec_for_bridge("flash_ssa")  # nothing is resolved before Bridge calls it
    with pytest.raises(ValueError, match="known: .*softmax.*ssa"):
        fn(provider())


@pytest.mark.parametrize("overrides,error,words", [
    ({"transformer_impl": "inference_optimized"}, ValueError, "supported: local, transformer_engine"),
    ({"attention_backend": AttnBackend.local}, ValueError, "DotProductAttention"),
    ({"mtp_num_layers": 1}, NotImplementedError, "mtp_num_layers"),
])
def test_refused_provider_settings_name_what_is_supported(overrides, error, words):
    fn = bridge.layer_spec_for_bridge("softmax")
    p = provider()
    for k, v in overrides.items():  # set after __post_init__: the refusal is ours, not megatron's
        setattr(p, k, v)
    with pytest.raises(error, match=words):
        fn(p)


@pytest.mark.skipif(te_spec.te_missing() is None, reason="Transformer Engine is usable here")
def test_transformer_engine_impl_without_te_names_the_local_spec():
    with pytest.raises(ImportError, match="transformer_impl='local'"):
        bridge.layer_spec_for_bridge("softmax")(provider(transformer_impl="transformer_engine"))


def test_transformer_engine_impl_takes_the_te_spec(monkeypatch):
    seen = []
    monkeypatch.setattr(bridge, "te_layer_spec", lambda *a: seen.append(a) or "te layer")
    p = provider(transformer_impl="transformer_engine")
    assert bridge.layer_spec_for_bridge("softmax", policy="free")(p, vp_stage=0) == "te layer"
    assert seen == [(p, "softmax", None, "free")]
    with pytest.raises(NotImplementedError, match="fused_mlp=auto or false"):
        bridge.layer_spec_for_bridge("softmax", fused_mlp=True)(p)
