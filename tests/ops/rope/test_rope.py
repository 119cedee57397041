"""Fused RoPE + layout (nemo_ssa/ops/rope) vs the torch reference and megatron's own RoPE.

Inputs are megatron-like strided views (q from a transposed buffer, k/v slices of one
mixed QKV buffer, or that buffer itself for the ``_qkv`` form); freqs are built like megatron's RotaryEmbedding ([s, 1, 1, rot] fp32,
cat(freqs, freqs)), rot < d as in the 114M recipe (rotary_percent 0.5) and rot == d.
Triton runs in the CPU interpreter: tiny shapes.
"""

import pytest
import torch

from nemo_ssa.ops.rope import naive as rope_naive
from nemo_ssa.ops.rope import rope_layout_naive, rope_layout_qkv_naive, rope_layout_qkv_triton, rope_layout_triton
from nemo_ssa.ops.rope import triton as rope_triton
from nemo_ssa.testing import assert_within_2x_eager, rel_err

#: the kernel runs compiled on a GPU machine, in the interpreter on CPU (tests/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def freqs_like_megatron(s, rot, base=10000.0, offset=0):
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(offset, offset + s, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :].to(DEVICE)


def megatron_views(s, b, hq, hkv, d, dtype, requires_grad=False):
    """q [s, b, hq, d] and k, v [s, b, hkv, d] as strided views, like get_query_key_value_tensors."""
    g = hq // hkv
    mixed = torch.randn(s, b, hkv, (g + 2) * d + 3, dtype=dtype, device=DEVICE)  # +3: odd row pitch
    mixed.requires_grad_(requires_grad)
    q = mixed[..., : g * d].reshape(s, b, hq, d)  # like megatron: a copy when g > 1, a view when g == 1
    k = mixed[..., g * d: (g + 1) * d]
    v = mixed[..., (g + 1) * d: (g + 2) * d]
    return mixed, q, k, v


SHAPES = [  # s, b, hq, hkv, d, rot
    (7, 2, 6, 2, 32, 16),   # recipe-like: GQA 3:1, rotary_percent 0.5, odd s
    (5, 3, 4, 4, 16, 16),   # full rotation, MHA
    (9, 1, 3, 1, 24, 8),    # non-power-of-2 head dim, MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{s}b{b}h{h}kv{kv}d{d}r{r}" for s, b, h, kv, d, r in SHAPES])
def test_forward_and_backward_within_2x_eager(shape, dtype, monkeypatch):
    s, b, hq, hkv, d, rot = shape
    # poison every allocation the op makes: an unwritten element is NaN and fails
    monkeypatch.setattr(rope_triton, "_empty",
                        lambda shp, like: torch.full(shp, float("nan"), dtype=like.dtype, device=like.device))
    mixed, q, k, v = megatron_views(s, b, hq, hkv, d, dtype, requires_grad=True)
    freqs = freqs_like_megatron(s, rot)
    out = rope_layout_triton(q, k, v, freqs)
    for o, (hh, name) in zip(out, ((hq, "q"), (hkv, "k"), (hkv, "v"))):
        assert o.shape == (b, hh, s, d) and o.is_contiguous() and o.dtype == dtype, name
    grads = [torch.randn_like(o) for o in out]
    (gmixed,) = torch.autograd.grad(out, mixed, grads)

    ref_mixed = mixed.detach().double().requires_grad_(True)
    q64, k64, v64 = split(ref_mixed, hq, hkv, d)
    ref = rope_layout_naive(q64, k64, v64, freqs.double())
    (gref,) = torch.autograd.grad(ref, ref_mixed, [g.double() for g in grads])

    eag_mixed = mixed.detach().clone().requires_grad_(True)
    eager = rope_layout_naive(*split(eag_mixed, hq, hkv, d), freqs)
    (geager,) = torch.autograd.grad(eager, eag_mixed, grads)

    for o, e, r, name in zip(out, eager, ref, "qkv"):
        assert_within_2x_eager(o, e, r, name=name)
    assert_within_2x_eager(gmixed, geager, gref, name="grad")
    # the pad columns of the mixed buffer get exactly zero grad
    assert torch.all(gmixed[..., (hq // hkv + 2) * d:] == 0)


def split(mixed, hq, hkv, d):
    g = hq // hkv
    s, b = mixed.shape[:2]
    q = mixed[..., : g * d].reshape(s, b, hq, d)
    return q, mixed[..., g * d: (g + 1) * d], mixed[..., (g + 1) * d: (g + 2) * d]


def test_matches_megatron_apply_rotary_pos_emb():
    """Against megatron-core's own unfused apply_rotary_pos_emb (fp32, rotary_percent 0.5)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, b, hq, hkv, d = 11, 2, 6, 2, 32
    cfg = TransformerConfig(num_layers=1, hidden_size=hq * d, num_attention_heads=hq, num_query_groups=hkv,
                            apply_rope_fusion=False)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=0.5, use_cpu_initialization=True)
    from nemo_ssa.megatron.cpu import cpu_device_shims

    import contextlib

    with cpu_device_shims() if DEVICE == "cpu" else contextlib.nullcontext():
        freqs = rope(s).to(DEVICE)
    assert freqs.shape == (s, 1, 1, d // 2)
    mixed = torch.randn(s, b, hkv, (hq // hkv + 2) * d + 3, dtype=torch.float32, device=DEVICE)
    q, k, v = split(mixed, hq, hkv, d)
    cp = object()  # only read for packed (THD) sequences; avoids needing parallel_state
    want_q = apply_rotary_pos_emb(q, freqs, config=cfg, cp_group=cp)
    want_k = apply_rotary_pos_emb(k, freqs, config=cfg, cp_group=cp)
    got_q, got_k, got_v = rope_layout_triton(q, k, v, freqs)
    # the kernel's fp32 cos/sin (libdevice) and torch's CUDA ones differ by an ulp or two
    tol = dict(atol=1e-5, rtol=1e-5) if DEVICE == "cuda" else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_q, want_q.permute(1, 2, 0, 3), **tol)
    torch.testing.assert_close(got_k, want_k.permute(1, 2, 0, 3), **tol)
    assert torch.equal(got_v, v.permute(1, 2, 0, 3))
    # negative control: the rotation is not the identity on this data
    assert rel_err(got_q, q.permute(1, 2, 0, 3)) > 0.1
    # and the reference agrees with megatron too
    torch.testing.assert_close(rope_naive.apply_rope_sbhd(q, freqs), want_q, atol=0, rtol=0)


def test_separate_q_and_k_freqs_and_mscale():
    s, b, hq, hkv, d = 6, 1, 2, 1, 16
    _, q, k, v = megatron_views(s, b, hq, hkv, d, torch.float32)
    fq, fk = freqs_like_megatron(s, d, offset=0), freqs_like_megatron(s, d, offset=5)
    got = rope_layout_triton(q, k, v, fq, fk, mscale=1.3)
    want = rope_layout_naive(q, k, v, fq, fk, mscale=1.3)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
    swapped = rope_layout_triton(q, k, v, fk, fq, mscale=1.3)
    assert rel_err(swapped[1], want[1]) > 0.05  # negative control: freqs_k is really used


@pytest.mark.parametrize("bad,msg", [
    (lambda f: f[:-1], "must be"),
    (lambda f: f[..., :-1], "even"),
    (lambda f: f.expand(-1, 2, -1, -1), "must be"),
])
def test_bad_freqs_raise_clear_errors(bad, msg):
    _, q, k, v = megatron_views(4, 2, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match=msg):
        rope_layout_triton(q, k, v, bad(freqs_like_megatron(4, 16)))


def test_layout_only_and_partial_grads():
    """freqs None: a pure layout pass (exact); a loss on q alone still gives exact zero dk/dv."""
    mixed, q, k, v = megatron_views(5, 2, 4, 2, 16, torch.float32, requires_grad=True)
    got = rope_layout_triton(q, k, v, None)
    for a, t in zip(got, (q, k, v)):
        assert torch.equal(a, t.permute(1, 2, 0, 3))
    fq = freqs_like_megatron(5, 8)
    oq, _, _ = rope_layout_triton(q, k, v, fq)
    (g,) = torch.autograd.grad(oq.square().sum(), mixed)
    (want,) = torch.autograd.grad(rope_layout_naive(q, k, v, fq)[0].square().sum(), mixed)
    torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    assert torch.all(g[..., 2 * 16:] == 0) and g[..., : 2 * 16].abs().max() > 0


def test_mismatched_inputs_raise():
    _, q, k, v = megatron_views(4, 2, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="same number of heads"):
        rope_layout_triton(q, k, v[:, :, :1], None)
    with pytest.raises(ValueError, match="dtype"):
        rope_layout_triton(q, k, v.double(), None)
    with pytest.raises(ValueError, match="both"):
        rope_layout_triton(q, k, v, freqs_like_megatron(4, 16), freqs_like_megatron(4, 8))


# ------------------------------------------------------------------------------ from the QKV buffer
QKV_SHAPES = [  # s, b, ng, heads per group, d, rot (None: layout only)
    (7, 2, 2, 3, 32, 16),   # the recipe's GQA 3:1, rotary_percent 0.5, odd s
    (5, 3, 3, 1, 16, 16),   # one query head per group (MHA), full rotation, odd b
    (9, 1, 1, 4, 24, 8),    # non-power-of-2 head dim, one group (MQA)
    (3, 3, 3, 3, 8, None),  # layout only
]
QKV_IDS = [f"s{s}b{b}g{g}p{p}d{d}r{r}" for s, b, g, p, d, r in QKV_SHAPES]


def qkv_buffer(s, b, ng, p, d, dtype, pitch=0):
    """Megatron's QKV projection output viewed [s, b, ng, (p + 2) * d]; ``pitch`` extra columns
    make it a strided view of a wider buffer (any strides are taken)."""
    buf = torch.randn(s, b, ng, (p + 2) * d + pitch, dtype=dtype, device=DEVICE)
    return buf[..., : (p + 2) * d].requires_grad_(True) if pitch == 0 else buf.requires_grad_(True)


def _poison(monkeypatch):
    monkeypatch.setattr(rope_triton, "_empty",
                        lambda shp, like: torch.full(shp, float("nan"), dtype=like.dtype, device=like.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", QKV_SHAPES, ids=QKV_IDS)
def test_qkv_forward_and_backward_within_2x_eager(shape, dtype, monkeypatch):
    """Against megatron's split + reshape + RoPE + layout copies in torch: fp64 anchor, the
    same-dtype eager run as the 2x baseline; every output the op allocates NaN-poisoned."""
    s, b, ng, p, d, rot = shape
    _poison(monkeypatch)
    mixed = qkv_buffer(s, b, ng, p, d, dtype)
    freqs = None if rot is None else freqs_like_megatron(s, rot)
    out = rope_layout_qkv_triton(mixed, p, freqs)
    for o, (hh, name) in zip(out, ((ng * p, "q"), (ng, "k"), (ng, "v"))):
        assert o.shape == (b, hh, s, d) and o.is_contiguous() and o.dtype == dtype, name
    grads = [torch.randn_like(o) for o in out]
    (gmixed,) = torch.autograd.grad(out, mixed, grads)
    assert gmixed.shape == mixed.shape and gmixed.is_contiguous()

    ref_mixed = mixed.detach().double().requires_grad_(True)
    ref = rope_layout_qkv_naive(ref_mixed, p, None if freqs is None else freqs.double())
    (gref,) = torch.autograd.grad(ref, ref_mixed, [g.double() for g in grads])
    eag_mixed = mixed.detach().clone().requires_grad_(True)
    eager = rope_layout_qkv_naive(eag_mixed, p, freqs)
    (geager,) = torch.autograd.grad(eager, eag_mixed, grads)
    for o, e, r, name in zip(out, eager, ref, "qkv"):
        assert_within_2x_eager(o, e, r, name=name)
    assert_within_2x_eager(gmixed, geager, gref, name="grad")


@pytest.mark.parametrize("shape", QKV_SHAPES, ids=QKV_IDS)
def test_qkv_form_is_bitwise_the_views_form(shape):
    """Same arithmetic, other addressing: the buffer form gives exactly what the [s, b, h, d]
    form gives on megatron's split of the same buffer, forward and gradient -- so the model
    trains bit for bit as before. Here on a strided buffer (an odd row pitch)."""
    s, b, ng, p, d, rot = shape
    mixed = qkv_buffer(s, b, ng, p, d, torch.bfloat16, pitch=3)
    freqs = None if rot is None else freqs_like_megatron(s, rot)
    w = (p + 2) * d
    new = rope_layout_qkv_triton(mixed[..., :w], p, freqs, mscale=1.1)
    old = rope_layout_triton(*split(mixed[..., :w], ng * p, ng, d), freqs, mscale=1.1)
    grads = [torch.randn_like(o) for o in new]
    (g_new,) = torch.autograd.grad(new, mixed, grads)
    (g_old,) = torch.autograd.grad(old, mixed, grads)
    for a, o in zip(new, old):
        assert torch.equal(a, o)
    assert torch.equal(g_new, g_old) and torch.all(g_new[..., w:] == 0)
    # negative control: a wrong grouping (the heads read as if one stride apart) differs
    if p > 1 and ng > 1:
        m = mixed.detach()
        flat = m.as_strided((s, b, ng * p, d), (m.stride(0), m.stride(1), d, 1))
        wrong = rope_layout_triton(flat, *split(m[..., :w], ng * p, ng, d)[1:], freqs, mscale=1.1)
        assert not torch.equal(wrong[0], new[0])


def test_qkv_separate_freqs_mscale_and_partial_grads():
    s, b, ng, p, d = 6, 2, 2, 3, 16
    mixed = qkv_buffer(s, b, ng, p, d, torch.float32)
    fq, fk = freqs_like_megatron(s, 8, offset=0), freqs_like_megatron(s, 8, offset=5)
    got = rope_layout_qkv_triton(mixed, p, fq, fk, mscale=1.3)
    want = rope_layout_qkv_naive(mixed, p, fq, fk, mscale=1.3)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
    swapped = rope_layout_qkv_triton(mixed, p, fk, fq, mscale=1.3)
    assert rel_err(swapped[1], want[1]) > 0.05  # negative control: freqs_k is really used
    # a loss on k alone: the q and v columns of the one gradient buffer are exact zeros
    (g,) = torch.autograd.grad(got[1].square().sum(), mixed)
    (gw,) = torch.autograd.grad(want[1].square().sum(), mixed)
    torch.testing.assert_close(g, gw, atol=1e-5, rtol=1e-5)
    assert torch.all(g[..., : p * d] == 0) and torch.all(g[..., (p + 1) * d:] == 0)
    assert g[..., p * d: (p + 1) * d].abs().max() > 0


def test_qkv_autograd_graph_has_no_split_or_cat():
    """The point of the buffer form: q, k, v hang off one node whose only input is the buffer,
    so backward runs no split / cat / reshape copy; megatron's split has them (the control)."""
    mixed = qkv_buffer(4, 2, 2, 3, 8, torch.float32)
    new = rope_layout_qkv_triton(mixed, 3, freqs_like_megatron(4, 8))
    nodes = {o.grad_fn for o in new}
    assert len(nodes) == 1
    (node,) = nodes
    assert type(node).__name__ == "_RopeLayoutQKVBackward"
    inputs = [f for f, _ in node.next_functions if f is not None]
    assert [type(f).__name__ for f in inputs] == ["AccumulateGrad"] and inputs[0].variable is mixed
    q, k, v = torch.split(mixed, [3 * 8, 8, 8], dim=3)  # get_query_key_value_tensors
    old = rope_layout_triton(q.reshape(4, 2, 6, 8), k, v, freqs_like_megatron(4, 8))
    assert {"SplitWithSizesBackward0", "CloneBackward0"} & graph_node_names(old[0]), graph_node_names(old[0])
    assert not {"SplitWithSizesBackward0", "SplitBackward0", "CatBackward0", "CloneBackward0",
                "UnsafeViewBackward0"} & graph_node_names(new[0])


def graph_node_names(t):
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        todo += [g for g, _ in f.next_functions]
    return names


@pytest.mark.parametrize("bad,p,msg", [
    (lambda m: m[..., :-1], 3, "last dim"),
    (lambda m: m[0], 3, "must be"),
    (lambda m: m, 0, "heads_per_group"),
    (lambda m: m, 2.0, "heads_per_group"),
])
def test_qkv_bad_inputs_raise(bad, p, msg):
    mixed = qkv_buffer(4, 2, 2, 3, 8, torch.float32)
    with pytest.raises(ValueError, match=msg):
        rope_layout_qkv_triton(bad(mixed), p, None)
    with pytest.raises(ValueError, match="rot_dim"):
        rope_layout_qkv_triton(mixed, 3, freqs_like_megatron(4, 16))  # rot 16 > head dim 8


def test_backward_takes_sin_at_the_partner_index():
    """Megatron's freqs are cat(f, f): position i and its partner p(i) = i +- rot/2 share a
    frequency, so sin_i == sin_p(i) and a backward reading sin at i would pass every other
    test. Here the two halves differ, and the gradient (g_i cos_i - sgn_i g_p(i) sin_p(i))
    must match the reference's autograd."""
    s, b, ng, p, d, rot = 5, 2, 2, 2, 16, 8
    mixed = qkv_buffer(s, b, ng, p, d, torch.float32)
    freqs = torch.rand(s, 1, 1, rot, device=DEVICE) * 6.0
    assert rel_err(freqs[..., : rot // 2], freqs[..., rot // 2:]) > 0.1
    got = rope_layout_qkv_triton(mixed, p, freqs, mscale=1.1)
    ref_mixed = mixed.detach().double().requires_grad_(True)
    want = rope_layout_qkv_naive(ref_mixed, p, freqs.double(), mscale=1.1)
    grads = [torch.randn_like(o) for o in got]
    (g,) = torch.autograd.grad(got, mixed, grads)
    (gw,) = torch.autograd.grad(want, ref_mixed, [x.double() for x in grads])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, gw.float(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the cos / sin tables
@pytest.fixture
def trig_cache(monkeypatch):
    """An empty table cache of the op's own, and a count of the tables it computes."""
    cache, computed = {}, []
    real = rope_triton._trig_compute

    def counting(freqs, mscale):
        computed.append((id(freqs), mscale))
        return real(freqs, mscale)
    monkeypatch.setattr(rope_triton, "_TRIG", cache)
    monkeypatch.setattr(rope_triton, "_trig_compute", counting)
    return cache, computed


@pytest.mark.parametrize("change", ["mul_", "copy_"])
def test_inplace_change_of_freqs_is_seen(change, trig_cache):
    """The same rotary tensor object, rewritten in place between two calls: the second call
    rotates by the new values, forward and backward (a cache keyed on the object alone would
    serve the first call's tables, and the comparison with the reference would fail)."""
    s, b, ng, p, d, rot = 6, 2, 2, 3, 16, 8
    mixed = qkv_buffer(s, b, ng, p, d, torch.float32)
    freqs = freqs_like_megatron(s, rot)
    first = rope_layout_qkv_triton(mixed, p, freqs, mscale=1.3)
    if change == "mul_":
        freqs.mul_(0.5)
    else:
        freqs.copy_(freqs_like_megatron(s, rot, offset=3))
    got = rope_layout_qkv_triton(mixed, p, freqs, mscale=1.3)
    want = rope_layout_qkv_naive(mixed, p, freqs, mscale=1.3)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
    assert rel_err(got[0], first[0]) > 0.05 and rel_err(got[1], first[1]) > 0.05  # the change mattered
    grads = [torch.randn_like(o) for o in got]
    (g,) = torch.autograd.grad(got, mixed, grads)
    (gw,) = torch.autograd.grad(want, mixed, grads)
    torch.testing.assert_close(g, gw, atol=1e-5, rtol=1e-5)
    assert len(trig_cache[1]) == 2  # one table pair per version of freqs (q and k share it)


def test_backward_rotates_by_the_forwards_tables(trig_cache):
    """freqs rewritten between forward and backward: the gradient is still the one of the
    forward that ran (backward keeps forward's tables, it does not look freqs up again)."""
    s, b, ng, p, d, rot = 5, 2, 1, 2, 8, 8
    mixed = qkv_buffer(s, b, ng, p, d, torch.float32)
    freqs = freqs_like_megatron(s, rot)
    want = rope_layout_qkv_naive(mixed, p, freqs.clone())
    got = rope_layout_qkv_triton(mixed, p, freqs)
    freqs.mul_(0.5)
    grads = [torch.randn_like(o) for o in got]
    (g,) = torch.autograd.grad(got, mixed, grads)
    (gw,) = torch.autograd.grad(want, mixed, grads)
    torch.testing.assert_close(g, gw, atol=1e-5, rtol=1e-5)


def test_tables_are_computed_once_per_freqs_and_mscale(trig_cache):
    """Two forward + backward calls with one rotary tensor (q and k sharing it, as megatron
    passes it): one table pair, computed once, the same tensor objects on every lookup;
    another mscale is another pair; the entry goes when the rotary tensor does."""
    cache, computed = trig_cache
    s, b, ng, p, d, rot = 4, 2, 2, 2, 8, 8
    mixed = qkv_buffer(s, b, ng, p, d, torch.float32)
    freqs = freqs_like_megatron(s, rot)
    for _ in range(2):
        out = rope_layout_qkv_triton(mixed, p, freqs, freqs, mscale=1.3)
        torch.autograd.grad(out, mixed, [torch.randn_like(o) for o in out])
    assert computed == [(id(freqs), 1.3)] and list(cache) == [(id(freqs), 1.3)]
    cos_t, sin_t = rope_triton._trig(freqs, 1.3)
    assert rope_triton._trig(freqs, 1.3)[0] is cos_t and rope_triton._trig(freqs, 1.3)[1] is sin_t
    assert cos_t.shape == (s, rot) and cos_t.is_contiguous() and cos_t.dtype == torch.float32
    assert torch.equal(cos_t, torch.cos(freqs[:, 0, 0]) * 1.3) and torch.equal(sin_t, torch.sin(freqs[:, 0, 0]) * 1.3)
    assert rope_triton._trig(freqs, 1.0)[0] is not cos_t and len(cache) == 2 and len(computed) == 2
    del freqs
    import gc

    gc.collect()
    assert not cache


def test_table_cache_is_bounded(trig_cache):
    """More live rotary tensors than the cache holds: at most ``_TRIG_MAX`` entries, the
    oldest evicted, and every call still rotates by its own tensor."""
    cache, _ = trig_cache
    s, b, ng, p, d, rot = 3, 1, 1, 1, 8, 8
    mixed = qkv_buffer(s, b, ng, p, d, torch.float32)
    n = rope_triton._TRIG_MAX + 4
    freqs = [freqs_like_megatron(s, rot, offset=i) for i in range(n)]  # all alive throughout
    for f in freqs:
        got = rope_layout_qkv_triton(mixed, p, f)
        torch.testing.assert_close(got[0], rope_layout_qkv_naive(mixed, p, f)[0], atol=1e-5, rtol=1e-5)
        assert len(cache) <= rope_triton._TRIG_MAX
    assert rope_triton._TRIG_MAX == 16 and list(cache) == [(id(f), 1.0) for f in freqs[4:]]
