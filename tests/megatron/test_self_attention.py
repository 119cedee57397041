"""FusedRopeSelfAttention + the core attention's fused RoPE/layout path, at model level (CPU).

A tiny GPT built through our spec (rope, rotary_percent 0.5, GQA, odd s) with the fused
path must give the same loss and gradients (fp32, tight tolerance) as the stock megatron
RoPE + layout-copy path on the same weights; reading q, k, v straight from the QKV buffer
must give bit for bit what the fused pass on megatron's split gives, with no split or cat
left in the autograd graph. The Triton kernels run in the interpreter.
"""

import pytest
import torch

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig

import nemo_ssa.megatron.core_attention as core_attention_mod
import nemo_ssa.megatron.self_attention as self_attention_mod
from nemo_ssa.megatron.core_attention import SoftmaxTritonCoreAttention
from nemo_ssa.megatron.self_attention import FusedRopeSelfAttention
from nemo_ssa.megatron.spec import layer_spec
from nemo_ssa.testing.tiny_gpt import loss_and_grads, tiny_gpt

S, B, HIDDEN, HEADS, GROUPS, VOCAB = 9, 2, 96, 6, 2, 64  # head dim 16, GQA 3, rot dim 8

# CPU models with the Triton kernels in the interpreter (on a GPU machine the GPU side is
# tests/ops/rope/test_rope.py and benchmarks/bench_rope_layout.py)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model-level test (Triton interpreter)")


def make_config(**overrides):
    kw = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
              use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(attention, fused, cfg=None):
    cfg = cfg or make_config()
    return tiny_gpt(cfg, layer_spec(cfg, attention=attention, attention_options={"fused_rope_layout": fused}),
                    VOCAB, S)


class Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.mark.parametrize("attention", ["softmax", "softmax_triton", "ssa_triton"])
def test_fused_path_matches_megatron_rope_and_copies(megatron_cpu, monkeypatch, attention):
    import megatron.core.transformer.attention as mattn

    # softmax (SDPA) defaults to the fused pass only with CUDA: ask for it explicitly here
    fused, stock = build_gpt(attention, True if attention == "softmax" else None), build_gpt(attention, False)
    stock.load_state_dict(fused.state_dict())
    for layer in fused.decoder.layers:
        assert type(layer.self_attention) is FusedRopeSelfAttention
        assert layer.self_attention.core_attention.fused_rope_layout
    for layer in stock.decoder.layers:
        assert type(layer.self_attention) is SelfAttention
    tokens = torch.randint(0, VOCAB, (B, S))
    rope_kernel = Counter(self_attention_mod.rope_layout_qkv_triton)
    views_kernel = Counter(core_attention_mod.rope_layout_triton)
    megatron_rope = Counter(mattn.apply_rotary_pos_emb)
    monkeypatch.setattr(self_attention_mod, "rope_layout_qkv_triton", rope_kernel)
    monkeypatch.setattr(core_attention_mod, "rope_layout_triton", views_kernel)
    monkeypatch.setattr(mattn, "apply_rotary_pos_emb", megatron_rope)

    loss_f, grads_f = loss_and_grads(fused, tokens)
    # one fused pass per layer, from the QKV buffer; no megatron RoPE, no pass on split views
    assert (rope_kernel.calls, views_kernel.calls, megatron_rope.calls) == (2, 0, 0)
    loss_s, grads_s = loss_and_grads(stock, tokens)
    assert (rope_kernel.calls, megatron_rope.calls) == (2, 4)  # stock: megatron ropes q and k per layer
    torch.testing.assert_close(loss_f, loss_s, atol=1e-6, rtol=1e-6)
    assert set(grads_f) == set(grads_s) and any("linear_qkv" in n for n in grads_f)
    for name in grads_s:
        torch.testing.assert_close(grads_f[name], grads_s[name], atol=1e-6, rtol=1e-5, msg=name)

    # negative control: the same model without RoPE at all gives a different loss, so the
    # comparison above can see a missing rotation
    monkeypatch.setattr(self_attention_mod, "rope_layout_qkv_triton",
                        lambda mixed, p, fq, fk, m: rope_kernel.fn(mixed, p, None, None, m))
    loss_norope, _ = loss_and_grads(fused, tokens)
    assert abs(loss_norope.item() - loss_s.item()) > 1e-4


def split_path(monkeypatch):
    """The fused pass on megatron's split views (the core attention's), as before the QKV-buffer read."""
    monkeypatch.setattr(FusedRopeSelfAttention, "read_qkv_buffer", False)


@pytest.mark.parametrize("attention", ["softmax", "softmax_triton", "ssa_triton"])
@pytest.mark.parametrize("groups", [GROUPS, HEADS], ids=["gqa3", "mha"])
def test_qkv_buffer_path_is_bitwise_the_split_path(megatron_cpu, monkeypatch, attention, groups):
    """Reading q, k, v from the QKV buffer changes addressing only: the loss and every gradient
    are bit for bit those of the fused pass on megatron's split (the path it replaces)."""
    cfg = make_config(num_query_groups=groups)
    model = build_gpt(attention, True if attention == "softmax" else None, cfg)
    tokens = torch.randint(0, VOCAB, (B, S))
    qkv_kernel = Counter(self_attention_mod.rope_layout_qkv_triton)
    monkeypatch.setattr(self_attention_mod, "rope_layout_qkv_triton", qkv_kernel)
    loss_new, grads_new = loss_and_grads(model, tokens)
    assert qkv_kernel.calls == 2
    with monkeypatch.context() as m:
        split_path(m)
        views_kernel = Counter(core_attention_mod.rope_layout_triton)
        m.setattr(core_attention_mod, "rope_layout_triton", views_kernel)
        loss_old, grads_old = loss_and_grads(model, tokens)
        assert (qkv_kernel.calls, views_kernel.calls) == (2, 2)
    assert torch.equal(loss_new, loss_old)
    assert set(grads_new) == set(grads_old) and any("linear_qkv" in n for n in grads_new)
    for name in grads_old:
        assert torch.equal(grads_new[name], grads_old[name]), name
    # no parameter or buffer changed: a checkpoint of one path loads into the other as is
    assert set(model.state_dict()) == set(build_gpt(attention, False, cfg).state_dict())


def graph_names(root) -> dict:
    """Every autograd node reachable from ``root`` (a tensor), counted by type name."""
    seen, todo, names = set(), [root.grad_fn], {}
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names[type(f).__name__] = names.get(type(f).__name__, 0) + 1
        todo += [g for g, _ in f.next_functions]
    return names


#: megatron's split (its backward is the cat) and q's reshape copy
_COPY_NODES = ("SplitWithSizesBackward0", "SplitBackward0", "CatBackward0", "UnsafeViewBackward0")


@pytest.mark.parametrize("attention", ["softmax_triton", "ssa_triton"])
def test_qkv_buffer_path_leaves_no_split_or_cat_in_the_graph(megatron_cpu, monkeypatch, attention):
    """What proves the copies gone without a GPU: from the loss back to the embeddings there is
    no split, cat or reshape copy anywhere, and q reaches the QKV projection through the one
    fused node; the split path (the control) has megatron's split and q's reshape copy per layer."""
    from nemo_ssa.megatron.cpu import cpu_device_shims

    model = build_gpt(attention, None)
    tokens = torch.randint(0, VOCAB, (B, S))
    seen_q = []
    hooks = [layer.self_attention.core_attention.register_forward_pre_hook(lambda mod, args: seen_q.append(args[0]))
             for layer in model.decoder.layers]

    def loss_graph():
        with cpu_device_shims():
            pos = torch.arange(S)[None].expand(B, S)
            return graph_names(model(tokens, pos, attention_mask=None, labels=tokens).mean())

    names = loss_graph()
    assert names.get("_RopeLayoutQKVBackward") == 2, names
    assert not set(_COPY_NODES) & set(names), names
    for q in seen_q:  # [s, b, h, d] view -> the fused node -> mixed_qkv's view of the projection
        (node, _), = q.grad_fn.next_functions
        assert type(node).__name__ == "_RopeLayoutQKVBackward"
        assert [type(f).__name__ for f, _ in node.next_functions if f is not None] == ["ViewBackward0"]
    with monkeypatch.context() as m:
        split_path(m)
        control = loss_graph()
    for hook in hooks:
        hook.remove()
    assert control.get("SplitWithSizesBackward0") == 2 and control.get("_RopeLayoutBackward") == 2, control
    assert control.get("UnsafeViewBackward0") == 2, control  # q's reshape, a copy (its clone below)
    # the only clones left are the output layer's (logits' transpose), in both graphs
    assert control["CloneBackward0"] - names.get("CloneBackward0", 0) == 2, (names, control)


def test_split_path_is_logged_once_per_reason(megatron_cpu, caplog):
    """A q/k norm between the split and RoPE keeps megatron's split (the core attention fuses
    RoPE + layout on its views), logged once; the result is that of the QKV-buffer path."""
    model = build_gpt("softmax_triton", None, make_config(num_layers=1))
    tokens = torch.randint(0, VOCAB, (B, S))
    loss_new, grads_new = loss_and_grads(model, tokens)
    sa = model.decoder.layers[0].self_attention
    sa.q_layernorm = torch.nn.Identity()  # a norm megatron applies after its split (here an identity)
    assert sa._qkv_buffer_fallback_reason(None) == "q/k layer norm between the split and RoPE"
    with caplog.at_level("WARNING", logger="nemo_ssa.megatron.self_attention"):
        loss_old, grads_old = loss_and_grads(model, tokens)
        loss_and_grads(model, tokens)
    assert [r.getMessage() for r in caplog.records if "QKV buffer" in r.getMessage()] == [
        "q, k, v not read from the QKV buffer (q/k layer norm between the split and RoPE): megatron's split and "
        "its copies run, RoPE + layout is fused in the core attention"]
    assert torch.equal(loss_new, loss_old)
    for name in grads_old:
        assert torch.equal(grads_new[name], grads_old[name]), name
    assert sa._qkv_rope is None and sa.core_attention._pending_rope is None


def test_unsupported_configs_fall_back_to_megatron(megatron_cpu, caplog):
    """Interleaved RoPE is not fused: megatron's path runs (logged once) and the result is unchanged."""
    cfg = make_config(num_layers=1, rotary_interleaved=True)
    fused, stock = build_gpt("softmax_triton", None, cfg), build_gpt("softmax_triton", False, cfg)
    stock.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, VOCAB, (B, S))
    with caplog.at_level("WARNING", logger="nemo_ssa.megatron.self_attention"):
        loss_f, _ = loss_and_grads(fused, tokens)
    loss_s, _ = loss_and_grads(stock, tokens)
    assert loss_f.item() == loss_s.item()
    sa = fused.decoder.layers[0].self_attention
    assert "interleaved" in sa._fallback_reason(torch.zeros(S, 1, 1, 8), None, None, None, None, None, None)
    assert sa.core_attention._pending_rope is None


def test_option_wiring_and_refusal(megatron_cpu):
    cfg = make_config(num_layers=1)
    spec = layer_spec(cfg, attention="softmax")  # softmax without CUDA: megatron's SelfAttention (CPU loop)
    assert spec.layer_specs[0].submodules.self_attention.module is SelfAttention
    spec = layer_spec(cfg, attention="softmax", attention_options={"fused_rope_layout": True})
    assert spec.layer_specs[0].submodules.self_attention.module is FusedRopeSelfAttention
    spec = layer_spec(cfg, attention="ssa_triton")
    assert spec.layer_specs[0].submodules.self_attention.module is FusedRopeSelfAttention
    spec = layer_spec(cfg, attention="ssa_reference")  # the unfused reference keeps megatron's RoPE
    assert spec.layer_specs[0].submodules.self_attention.module is SelfAttention
    with pytest.raises(ValueError, match="fused_rope_layout"):  # the policy: not an option of ssa_reference
        layer_spec(cfg, attention="ssa_reference", attention_options={"fused_rope_layout": True})
    with pytest.raises(NotImplementedError, match="fused_rope_layout"):  # the module itself refuses too
        core_attention_mod.ElsaCoreAttention(cfg, 1, core_attention_mod.AttnMaskType.causal, "self",
                                             fused_rope_layout=True)


def test_out_argument_writes_megatron_layout_in_place(megatron_cpu):
    """An op with ``out=`` gets a [B, H, Sq, D] view of the [sq, b, h*d] output: no copy back."""
    cfg = make_config(num_layers=1)
    mod = SoftmaxTritonCoreAttention(cfg, 1, core_attention_mod.AttnMaskType.causal, "self")
    real = mod._attend
    seen = {}

    def with_out(q, k, v, *, out=None, **kw):
        seen["out"] = out
        res = real(q, k, v, **kw)
        return out.copy_(res) if out is not None else res

    mod._attend, mod._op_takes_out = with_out, core_attention_mod._accepts_out(with_out)
    assert mod._op_takes_out
    d = HIDDEN // HEADS
    q = torch.randn(S, B, HEADS, d, requires_grad=True)
    k, v = (torch.randn(S, B, GROUPS, d, requires_grad=True) for _ in range(2))
    got = mod(q, k, v, None)
    assert seen["out"].shape == (B, HEADS, S, d)
    assert got.shape == (S, B, HEADS * d) and got.data_ptr() == seen["out"].data_ptr()
    mod._attend, mod._op_takes_out = real, False
    want = mod(q, k, v, None)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_rope_tables_are_computed_once_for_every_layer_and_step(megatron_cpu, monkeypatch):
    """The premise of the op's cos / sin table cache: megatron hands every layer the same
    rotary tensor object (and, its RotaryEmbedding being lru_cached, the same one every
    step), so two steps of a 2-layer model (8 RoPE launches) compute one table pair."""
    from nemo_ssa.ops.rope import triton as rope_triton

    computes = Counter(rope_triton._trig_compute)
    launches = Counter(rope_triton.launch_kw)
    monkeypatch.setattr(rope_triton, "_TRIG", {})
    monkeypatch.setattr(rope_triton, "_trig_compute", computes)
    monkeypatch.setattr(rope_triton, "launch_kw", launches)
    model = build_gpt("softmax_triton", None)
    for _ in range(2):
        loss_and_grads(model, torch.randint(0, VOCAB, (B, S)))
    assert launches.calls == 8 and computes.calls == 1


def test_block_benchmark_smoke(tmp_path):
    """benchmarks/bench_rope_layout.py (the lead's GPU command) runs and checks agreement on CPU."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_rope_layout.py")
    spec = importlib.util.spec_from_file_location("bench_rope_layout", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.md"
    assert bench.main(["--smoke", "--attentions", "softmax_triton", "--out", str(out)]) == 0
    row = next(ln for ln in out.read_text().splitlines() if ln.startswith("| softmax_triton |"))
    assert row.startswith("| softmax_triton | B2 N9 H6/2 D16 float32 | True |")
    # the QKV-buffer path is bitwise the split path, and the split path bitwise itself on a rerun
    assert row.endswith("| True (True) |")


def _bench_qkv_buffer():
    import importlib.util
    import os
    import sys

    here = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, here)  # its `import bench_model`, as when run as a file
    try:
        spec = importlib.util.spec_from_file_location("bench_qkv_buffer", os.path.join(here, "bench_qkv_buffer.py"))
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(here)
    return bench


def test_qkv_buffer_benchmark_parity_check(megatron_cpu, monkeypatch):
    """benchmarks/bench_qkv_buffer.py's GPU parity check, on the tiny model: it toggles the
    paths (the buffer kernel runs once per layer on one, never on the other), finds them
    bitwise equal, and fails a buffer path that is off by a little (negative control)."""
    bench = _bench_qkv_buffer()
    model = build_gpt("softmax_triton", None)
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    par = bench.parity(model, lambda m: loss_and_grads(m, tokens))
    assert par["buffer_calls"] == 2 and par["split_calls"] == 0, par
    assert par["bitwise"] and par["rerun_bitwise"] and bench.parity_ok(par), par
    assert all(m.read_qkv_buffer for m in model.modules() if isinstance(m, FusedRopeSelfAttention))

    real = self_attention_mod.rope_layout_qkv_triton

    def off_by_a_little(mixed, p, fq, fk, m):
        q, k, v = real(mixed, p, fq, fk, m)
        return q * 1.001, k, v
    monkeypatch.setattr(self_attention_mod, "rope_layout_qkv_triton", off_by_a_little)
    bad = bench.parity(model, lambda m: loss_and_grads(m, tokens))
    assert not bad["bitwise"] and bad["rerun_bitwise"] and not bench.parity_ok(bad), bad
