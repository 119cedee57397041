"""NSA: the torch reference against brute-force formulations, and the Triton kernels
(interpreter on CPU, native on CUDA) against the reference.

Ground truths, independent of the code under test:
 - per-token Python loops that follow the paper's definitions literally (compressed
   blocks, overlap scores, top-n with forced blocks, window), in fp64;
 - ``attention_naive`` (tests/ops/attention/test_naive.py) with each branch's ``keep_mask``;
 - torch.autograd.gradcheck of the reference in fp64.
Kernels are compared with the fp32 reference for the output and every gradient (q, each
branch's k and v, gate logits, φ parameters, SSA's n and b), and fp16 with the "≤ 2×
eager same-dtype error" rule (the interpreter's bf16 ``tl.dot`` is broken; bf16 runs in
tests/ops/nsa/test_nsa_gpu.py). Sizes are tiny (block_len 4, stride 2, select_block 8);
GQA ratio 3 throughout; odd N.
"""

import importlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

from nemo_ssa.ops.nsa import (  # noqa: E402
    NSAConfig,
    PhiParams,
    compress_kv,
    init_phi_params,
    nsa_attention,
    nsa_attention_naive,
    num_compressed_blocks,
    num_select_blocks,
    select_blocks,
    selection_importance,
)
from nemo_ssa.ops.nsa.naive import (  # noqa: E402
    compressed_visibility,
    masked_attention,
    overlap_matrix,
    selection_keep_mask,
    window_mask,
)
from nemo_ssa.ops.attention.naive import attention_naive  # noqa: E402
from nemo_ssa.testing import (  # noqa: E402
    assert_scalar_grad_close,
    assert_within_2x_eager,
    nsa_scalar_grad_terms,
    rel_err,
    ssa_scalar_grad_terms,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = NSAConfig(block_len=4, stride=2, select_block=8, top_n=4, window=8)
KERNEL_MODULES = ("nemo_ssa.ops.common.transforms", "nemo_ssa.ops.nsa.range_attn",
                  "nemo_ssa.ops.nsa.select", "nemo_ssa.ops.nsa.selected_attn", "nemo_ssa.ops.nsa.gate")


def kernels_interpreted() -> bool:
    """True when Triton (its standard library included) was set up for the interpreter.

    ``triton.jit`` picks interpreter vs compiler when a function is decorated, and triton's
    own ``tl.zeros`` & co. are decorated when triton is first imported; megatron imports
    triton, so a session that imports megatron first builds everything for the GPU.
    """
    import triton.language.standard as std

    return type(std.zeros).__name__ == "InterpretedFunction"


def test_kernels_are_interpreted_on_cpu():
    """Fails (not skips) when the kernel tests below cannot run on this CPU session.
    Fix: ``TRITON_INTERPRET=1 pytest ...`` or set it in conftest before anything imports triton."""
    if DEV == "cpu":
        assert kernels_interpreted(), "set TRITON_INTERPRET=1 before triton is imported (conftest)"


@pytest.fixture(scope="module")
def K():
    """The kernel modules (imported lazily: after TRITON_INTERPRET is settled)."""
    from types import SimpleNamespace

    if DEV == "cpu" and not kernels_interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set, and there is no CUDA")
    mods = [importlib.import_module(m) for m in KERNEL_MODULES]
    _, range_attn, select, selected_attn, gate = mods
    return SimpleNamespace(range_attn=range_attn, select=select, selected=selected_attn, gate=gate)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype).requires_grad_()


def layer_inputs(B, Hq, Hkv, N, D, cfg, dtype=torch.float32, seed=0, separate_kv=True):
    g = gen(seed)
    q = rnd(B, Hq, N, D, g=g, dtype=dtype)
    kv = [rnd(B, Hkv, N, D, g=g, dtype=dtype) for _ in range(6 if separate_kv else 2)]
    gates = rnd(B, Hq, N, 3, g=g, dtype=dtype)
    phi_k = phi_v = None
    if cfg.compress == "mlp":
        phi_k = init_phi_params(cfg, D, dtype=dtype, device=DEV, generator=g, std=0.3, requires_grad=True)
        phi_v = init_phi_params(cfg, D, dtype=dtype, device=DEV, generator=g, std=0.3, requires_grad=True)
    kw = dict(phi_k=phi_k, phi_v=phi_v)
    if separate_kv:
        kw.update(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5])
    leaves = dict(q=q, k=kv[0], v=kv[1], gate=gates)
    if separate_kv:
        leaves.update(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5])
    for which, phi in (("phi_k", phi_k), ("phi_v", phi_v)):
        if phi is not None:
            leaves.update({f"{which}.{f}": t for f, t in zip(PhiParams._fields, phi)})
    return (q, kv[0], kv[1], gates), kw, leaves


def grads(out, leaves, do):
    names = list(leaves)
    gs = torch.autograd.grad(out, [leaves[n] for n in names], do, allow_unused=True)
    return dict(zip(names, gs))


def ssa_scalars(transform, dtype=torch.float32):
    if transform != "ssa":
        return {}
    return dict(n=torch.tensor([1.3], dtype=dtype, device=DEV, requires_grad=True),
                b=torch.tensor([0.7], dtype=dtype, device=DEV, requires_grad=True))


def check_grads(got, ref, tol, transform, label="", terms=None):
    """Gradients vs an fp32 reference, relative error < ``tol``; SSA's scalar sums dn, db
    (``terms = {"n": sum|dn terms|, "b": ...}``) bounded by ``tol * sum|terms|`` instead
    (they may cancel to near 0; nemo_ssa.testing)."""
    for name, r in ref.items():
        x = got[name]
        if name == "phi_k.b2" and transform == "softmax":
            # a constant shift of every compressed key: softmax-invariant, the true grad is 0
            scale = max(ref["phi_k.w2"].abs().max().item(), 1e-6)
            assert x.abs().max().item() <= 1e-4 * scale and r.abs().max().item() <= 1e-4 * scale, label
            continue
        if name in ("n", "b") and terms is not None:
            assert_scalar_grad_close(f"{label} d{name}", x, r, terms[name], torch.float32, rtol=tol)
            continue
        err = rel_err(x, r)
        assert math.isfinite(err) and err < tol, f"{label} d{name}: rel err {err:.3e} >= {tol:g}"


def check_grads_fp64(got, leaves, ref_fn, do, tol, label="", keep=None):
    """Kernel gradients vs a float64 reference. Bound: ``max(tol, 2 x the fp32 eager
    error)`` (the project's tolerance rule); the scalar grads dn, db (sums of many
    cancelling terms) within 2x the fp32 eager error + 2e-5 x sum|terms| of the masked
    attention ``keep`` (``assert_scalar_grad_close``), never relative to their own value."""
    l64 = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref64 = grads(ref_fn(l64), l64, do.double())
    ref32 = grads(ref_fn(leaves), leaves, do)
    terms = None
    if "n" in leaves:
        terms = dict(zip("nb", ssa_scalar_grad_terms(leaves["q"], leaves["k"], leaves["v"], leaves["n"],
                                                     leaves["b"], do, mask=keep)))
    for name, r in ref64.items():
        if name in ("n", "b"):
            assert_scalar_grad_close(f"{label} d{name}", got[name], r, terms[name], torch.float32, eager=ref32[name])
            continue
        err, eager = rel_err(got[name], r), rel_err(ref32[name], r)
        bound = max(tol, 2.0 * eager)
        assert math.isfinite(err) and err < bound, f"{label} d{name}: rel err {err:.3e} >= {bound:.3e} (eager fp32 {eager:.3e})"


# ====================================================================== reference
# ------------------------------------------------------------------------ config
@pytest.mark.parametrize("bad, match", [
    (dict(block_len=0), "block_len must be a positive int"),
    (dict(stride=8, block_len=4), "stride .* must be <= block_len"),
    (dict(top_n=2), "top_n must be >= 3"),
    (dict(compress="max"), r"compress must be one of \('mlp', 'mean'\)"),
    (dict(window=1.5), "window must be a positive int"),
    (dict(separate_kv="yes"), "separate_kv must be a bool"),
])
def test_config_validation_names_the_supported_set(bad, match):
    with pytest.raises(ValueError, match=match):
        NSAConfig(**bad)


def test_block_counts():
    cfg = NSAConfig()
    assert num_compressed_blocks(31, cfg) == 0 and num_compressed_blocks(32, cfg) == 1
    assert num_compressed_blocks(47, cfg) == 1 and num_compressed_blocks(48, cfg) == 2
    assert num_select_blocks(64, cfg) == 1 and num_select_blocks(65, cfg) == 2


def test_overlap_matrix_paper_pattern():
    m = overlap_matrix(1024, NSAConfig())  # l=32, d=16, l'=64
    torch.testing.assert_close(m.sum(1), torch.ones(m.shape[0]))
    for j in (1, 5, 9):  # interior selection blocks collect 4j-1 .. 4j+3 with (1,2,2,2,1)/2
        col = m[:, j]
        nz = col.nonzero().flatten().tolist()
        assert nz == list(range(4 * j - 1, 4 * j + 4))
        torch.testing.assert_close(col[nz], torch.tensor([1, 2, 2, 2, 1]) / 2.0)


# --------------------------------------------------------------------- compression
def test_compress_kv_matches_per_block_loop():
    g = gen(3)
    cfg = TINY
    x = torch.randn(2, 3, 13, 8, generator=g, dtype=torch.float64)
    phi = init_phi_params(cfg, 8, dtype=torch.float64, generator=g, std=0.5)
    mean_cfg = NSAConfig(**{**TINY.__dict__, "compress": "mean"})
    nc = num_compressed_blocks(13, cfg)
    assert nc == 5
    got_mlp, got_mean = compress_kv(x, cfg, phi), compress_kv(x, mean_cfg)
    for i in range(nc):
        blk = x[:, :, i * cfg.stride: i * cfg.stride + cfg.block_len]  # [B, H, l, D]
        mean = blk.mean(2)
        hid = torch.nn.functional.gelu((blk + phi.pe).flatten(2) @ phi.w1 + phi.b1)
        torch.testing.assert_close(got_mean[:, :, i], mean)
        torch.testing.assert_close(got_mlp[:, :, i], mean + hid @ phi.w2 + phi.b2)
    assert compress_kv(x[:, :, :3], cfg, phi).shape == (2, 3, 0, 8)  # N < l: no block


# ------------------------------------------------------------------- brute force
def brute_force(q, k, v, ks, vs, kw, vw, gates, cfg, k_cmp, v_cmp):
    """Per-token loops over the paper's definitions (fp64). Returns o, branch outputs, selection."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    nc, ns = k_cmp.shape[2], num_select_blocks(N, cfg)
    scale = 1.0 / math.sqrt(D)

    def attn(qv, keys, vals):
        if keys.shape[0] == 0:
            return torch.zeros_like(qv)
        p = torch.softmax(keys @ qv * scale, dim=0)
        return p @ vals

    o_c, o_s, o_w = (torch.zeros_like(q) for _ in range(3))
    sel = torch.full((B, Hkv, N, cfg.top_n), -1, dtype=torch.long)
    for b in range(B):
        for t in range(N):
            vis = [i for i in range(nc) if i * cfg.stride + cfg.block_len - 1 <= t]
            for hk in range(Hkv):
                imp = [0.0] * ns
                for h in range(hk * G, hk * G + G):
                    if vis:
                        p = torch.softmax(k_cmp[b, hk, vis] @ q[b, h, t] * scale, 0)
                        for pi, i in zip(p.tolist(), vis):
                            for x in range(i * cfg.stride, i * cfg.stride + cfg.block_len):
                                imp[x // cfg.select_block] += pi / cfg.block_len
                    o_c[b, h, t] = attn(q[b, h, t], k_cmp[b, hk, vis], v_cmp[b, hk, vis])
                cur = t // cfg.select_block
                eligible = list(range(cur + 1))
                forced = [j for j in eligible if j in (0, cur, cur - 1)]
                rest = sorted((j for j in eligible if j not in forced), key=lambda j: (-imp[j], j))
                chosen = sorted(forced + rest[: cfg.top_n - len(forced)])
                sel[b, hk, t, : len(chosen)] = torch.tensor(chosen)
                keys = [s for s in range(t + 1) if s // cfg.select_block in chosen]
                wins = list(range(max(0, t - cfg.window + 1), t + 1))
                for h in range(hk * G, hk * G + G):
                    o_s[b, h, t] = attn(q[b, h, t], ks[b, hk, keys], vs[b, hk, keys])
                    o_w[b, h, t] = attn(q[b, h, t], kw[b, hk, wins], vw[b, hk, wins])
    g = torch.sigmoid(gates)
    o = g[..., 0:1] * o_c + g[..., 1:2] * o_s + g[..., 2:3] * o_w
    return o, dict(o_cmp=o_c, o_slc=o_s, o_win=o_w, block_idx=sel)


@pytest.mark.parametrize("N", [3, 21, 37])
def test_reference_matches_per_token_brute_force(N):
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=3 if N < 30 else 4, window=5)
    g = gen(N)
    B, Hq, Hkv, D = 1, 6, 2, 8
    q = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64)
    kv = [torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64) for _ in range(6)]
    gates = torch.randn(B, Hq, N, 3, generator=g, dtype=torch.float64)
    phi = [init_phi_params(cfg, D, dtype=torch.float64, generator=g, std=0.5) for _ in range(2)]
    o, aux = nsa_attention_naive(q, kv[0], kv[1], gates, cfg, k_slc=kv[2], v_slc=kv[3], k_win=kv[4],
                                 v_win=kv[5], phi_k=phi[0], phi_v=phi[1], return_aux=True)
    o_bf, aux_bf = brute_force(q, *kv, gates, cfg, aux["k_cmp"], aux["v_cmp"])
    assert torch.equal(aux["block_idx"], aux_bf["block_idx"])
    for name in ("o_cmp", "o_slc", "o_win"):
        torch.testing.assert_close(aux[name], aux_bf[name], atol=1e-12, rtol=1e-10, msg=name)
    torch.testing.assert_close(o, o_bf, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_each_branch_is_attention_naive_with_its_keep_mask(transform):
    cfg = TINY
    (q, k, v, gates), kw, _ = layer_inputs(2, 6, 2, 29, 8, cfg, seed=5)
    q, k, v = q.detach().double(), k.detach().double(), v.detach().double()
    kw = {n: (PhiParams(*(p.detach().double() for p in t)) if isinstance(t, PhiParams) else t.detach().double())
          for n, t in kw.items()}
    ssa = {n: t.detach().double() for n, t in ssa_scalars(transform).items()}
    o, aux = nsa_attention_naive(q, k, v, gates.detach().double(), cfg, **kw, transform=transform, **ssa,
                                 return_aux=True)
    N, G = q.shape[2], 3
    common = dict(transform=transform, **ssa)
    t = torch.arange(N, device=q.device)[:, None]
    last = torch.arange(aux["k_cmp"].shape[2], device=q.device)[None, :] * cfg.stride + cfg.block_len - 1
    ref_c = attention_naive(q, aux["k_cmp"], aux["v_cmp"], keep_mask=last <= t, **common)
    # selection as a dense one-hot over blocks, expanded to tokens
    onehot = torch.zeros(*aux["block_idx"].shape[:3], num_select_blocks(N, cfg) + 1, dtype=torch.bool,
                         device=q.device)
    onehot.scatter_(-1, aux["block_idx"].clamp(min=-1) % (onehot.shape[-1]), True)
    keep_s = onehot[..., torch.arange(N, device=q.device) // cfg.select_block].repeat_interleave(G, 1)
    ref_s = attention_naive(q, kw["k_slc"], kw["v_slc"], causal=True, keep_mask=keep_s, **common)
    ref_w = attention_naive(q, kw["k_win"], kw["v_win"], causal=True,
                            keep_mask=(t - torch.arange(N, device=q.device)[None, :]) < cfg.window, **common)
    for got, ref in ((aux["o_cmp"], ref_c), (aux["o_slc"], ref_s), (aux["o_win"], ref_w)):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)
    assert (aux["o_cmp"][:, :, : cfg.block_len - 1] == 0).all()  # nothing visible yet


def test_selection_rules():
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=5, window=8)
    N, ns = 70, num_select_blocks(70, cfg)
    imp = torch.rand(2, 3, N, ns, generator=gen(1))
    idx = select_blocks(imp, cfg)
    for t in range(N):
        cur = t // cfg.select_block
        row = idx[0, 1, t]
        valid = row[row >= 0].tolist()
        assert valid == sorted(valid) and len(set(valid)) == len(valid)
        assert len(valid) == min(cfg.top_n, cur + 1)
        assert all(j <= cur for j in valid)  # causal
        assert {0, cur, max(cur - 1, 0)} <= set(valid)  # forced
        rest = [j for j in range(cur + 1) if j not in (0, cur, cur - 1)]
        picked = [j for j in valid if j in rest]
        unpicked = [j for j in rest if j not in picked]
        if picked and unpicked:
            assert min(imp[0, 1, t, picked]) >= max(imp[0, 1, t, unpicked])
    # ties go to the lower index
    flat = torch.zeros(1, 1, N, ns)
    idx = select_blocks(flat, cfg)
    assert idx[0, 0, 69].tolist() == [0, 1, 2, 7, 8]


def test_selection_importance_is_summed_over_the_group():
    cfg = TINY
    p = torch.rand(1, 6, 30, num_compressed_blocks(30, cfg), generator=gen(2))
    imp = selection_importance(p, cfg, num_kv_heads=2)
    m = overlap_matrix(30, cfg)
    torch.testing.assert_close(imp[0, 1], (p[0, 3] + p[0, 4] + p[0, 5]) @ m)


@pytest.mark.parametrize("compress", ["mlp", "mean"])
def test_reference_gradcheck(compress):
    cfg = NSAConfig(block_len=4, stride=2, select_block=4, top_n=3, window=3, compress=compress)
    (q, k, v, gates), kw, leaves = layer_inputs(1, 3, 1, 11, 4, cfg, dtype=torch.float64, seed=7)
    _, aux = nsa_attention_naive(q, k, v, gates, cfg, **kw, return_aux=True)
    idx = aux["block_idx"]  # fixed: the selection is an index choice, not differentiable
    names = list(leaves)

    def f(*xs):
        d = dict(zip(names, xs))
        phis = {w: PhiParams(*(d[f"{w}.{f}"] for f in PhiParams._fields)) for w in ("phi_k", "phi_v")
                if f"{w}.pe" in d}
        return nsa_attention_naive(d["q"], d["k"], d["v"], d["gate"], cfg, k_slc=d["k_slc"], v_slc=d["v_slc"],
                                   k_win=d["k_win"], v_win=d["v_win"], **phis, block_idx=idx)

    assert torch.autograd.gradcheck(f, tuple(leaves[n] for n in names), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_torch_stages_equal_the_reference(transform):
    (q, k, v, gates), kw, leaves = layer_inputs(2, 6, 2, 33, 8, TINY, seed=11)
    ssa = ssa_scalars(transform)
    leaves.update(ssa)
    ref, aux = nsa_attention_naive(q, k, v, gates, TINY, **kw, transform=transform, **ssa, return_aux=True)
    got, aux2 = nsa_attention(q, k, v, gates, TINY, **kw, transform=transform, **ssa, impl="torch", return_aux=True)
    assert torch.equal(aux["block_idx"], aux2["block_idx"])
    do = torch.randn_like(ref)
    terms = _layer_terms(q, gates, TINY, ssa, do, aux, kw) if ssa else None
    check_grads(grads(got, leaves, do), grads(ref, leaves, do), 1e-5, transform, terms=terms)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def _layer_terms(q, gates, cfg, ssa, do, aux, kw):
    """{"n": sum|dn terms|, "b": ...} of the whole NSA layer (three branches, gated)."""
    kv = {name: kw.get(name) if kw.get(name) is not None else kw.get(name[0]) for name in ("k_slc", "v_slc", "k_win", "v_win")}
    tn, tb = nsa_scalar_grad_terms(q, gates, cfg, ssa["n"], ssa["b"], do, aux, **kv)
    return {"n": tn, "b": tb}


def test_layer_validation_errors():
    (q, k, v, gates), kw, _ = layer_inputs(1, 6, 2, 9, 8, TINY)
    with pytest.raises(ValueError, match=r"gate_logits must be \[B, Hq, N, 3\]"):
        nsa_attention(q, k, v, gates[..., :2], TINY, **kw)
    with pytest.raises(ValueError, match="compress='mlp' needs phi_k"):
        nsa_attention(q, k, v, gates, TINY, k_slc=kw["k_slc"])
    with pytest.raises(ValueError, match=r"unknown NSA impl .* supported: \('triton', 'torch', 'auto'\)"):
        nsa_attention(q, k, v, gates, TINY, **kw, impl="cuda")
    with pytest.raises(ValueError, match="unknown NSA stage"):
        nsa_attention(q, k, v, gates, TINY, **kw, impl={"gates": "torch"})
    with pytest.raises(ValueError, match="needs `n`"):
        nsa_attention(q, k, v, gates, TINY, **kw, transform="ssa")
    with pytest.raises(ValueError, match="unknown transform"):
        nsa_attention(q, k, v, gates, TINY, **kw, transform="relu")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        nsa_attention(q[:, :5], k, v, gates[:, :5], TINY, **kw)
    with pytest.raises(ValueError, match="must be an NSAConfig"):
        nsa_attention(q, k, v, gates, dict(block_len=4), **kw)


# ======================================================================== kernels
BRANCH_CASES = [  # (B, Hq, Hkv, N, D, transform)
    (1, 6, 2, 37, 32, "softmax"),
    (2, 6, 2, 70, 32, "softmax"),
    (2, 3, 1, 21, 48, "ssa"),  # non-power-of-two head dim (masked tile)
    (1, 4, 2, 100, 32, "ssa"),  # whole visible tiles: the unmasked stage of both branches
]


def _ids(c):
    return f"B{c[0]}-T{c[3]}-HQ{c[1]}-HKV{c[2]}-D{c[4]}-{c[5]}"


@pytest.mark.parametrize("case", BRANCH_CASES, ids=_ids)
def test_window_kernel(K, case):
    B, Hq, Hkv, N, D, transform = case
    g = gen(21)
    q, k, v = rnd(B, Hq, N, D, g=g), rnd(B, Hkv, N, D, g=g), rnd(B, Hkv, N, D, g=g)
    ssa = ssa_scalars(transform)
    leaves = dict(q=q, k=k, v=v, **ssa)
    w = 6 if N < 50 else 20 if N < 90 else 40  # inside one 16-row tile / spanning tiles / whole tiles inside
    out = K.range_attn.window_attention(q, k, v, w, transform=transform, **ssa)
    ref, _ = masked_attention(q, k, v, window_mask(N, w, DEV), transform=transform, **ssa)
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(ref)
    mask = window_mask(N, w, DEV)
    check_grads_fp64(grads(out, leaves, do), leaves, lambda l: masked_attention(
        l["q"], l["k"], l["v"], mask, transform=transform, n=l.get("n"), b=l.get("b"))[0], do, 1e-5, "window",
        keep=mask)


@pytest.mark.parametrize("case", BRANCH_CASES + [(1, 3, 1, 3, 32, "softmax")], ids=_ids)
def test_compressed_kernel_and_lse(K, case):
    B, Hq, Hkv, N, D, transform = case
    cfg = TINY
    g = gen(22)
    nc = num_compressed_blocks(N, cfg)
    q, kc, vc = rnd(B, Hq, N, D, g=g), rnd(B, Hkv, nc, D, g=g), rnd(B, Hkv, nc, D, g=g)
    ssa = ssa_scalars(transform)
    leaves = dict(q=q, k=kc, v=vc, **ssa)
    out, lse = K.range_attn.compressed_attention(q, kc, vc, cfg.block_len, cfg.stride, transform=transform, **ssa)
    vis = compressed_visibility(N, cfg, DEV)
    ref, _ = masked_attention(q, kc, vc, vis, transform=transform, **ssa)
    assert rel_err(out, ref) < 1e-5
    # lse: log2-domain log-sum-exp of the visible transformed scores; +inf on empty rows
    from nemo_ssa.ops.nsa.layer import _masked_lse2

    ref_lse = _masked_lse2(q, kc, vis, dict(transform=transform, softmax_scale=None, **ssa))
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[:, :, : min(N, cfg.block_len - 1)]).all()
    if nc:
        do = torch.randn_like(ref)
        check_grads_fp64(grads(out, leaves, do), leaves, lambda l: masked_attention(
            l["q"], l["k"], l["v"], vis, transform=transform, n=l.get("n"), b=l.get("b"))[0], do, 1e-5, "compressed",
            keep=vis)


# ------------------------------------------------ dK/dV split along the query axis
# (B, Hq, Hkv, N, D, transform, branch, split): odd N, GQA 2 and 3, uneven chunks
SPLIT_CASES = [
    (1, 6, 2, 37, 32, "softmax", "compressed", 2),
    (2, 6, 2, 70, 32, "softmax", "compressed", 3),
    (2, 4, 2, 53, 32, "ssa", "compressed", 3),
    (2, 6, 2, 70, 32, "softmax", "window", 2),
    (1, 4, 2, 53, 32, "ssa", "window", 3),
]
SPLIT_WINDOW = 20  # spans two 16-row tiles: a key tile's range is ~3 query blocks


def _split_ids(c):
    return f"B{c[0]}-T{c[3]}-HQ{c[1]}-HKV{c[2]}-{c[5]}-{c[6]}-S{c[7]}"


def _branch_inputs(case, seed):
    B, Hq, Hkv, N, D, transform, branch, _ = case
    nk = num_compressed_blocks(N, TINY) if branch == "compressed" else N
    g = gen(seed)
    q, k, v = rnd(B, Hq, N, D, g=g), rnd(B, Hkv, nk, D, g=g), rnd(B, Hkv, nk, D, g=g)
    do = torch.randn(B, Hq, N, D, generator=g).to(DEV)
    mask = compressed_visibility(N, TINY, DEV) if branch == "compressed" else window_mask(N, SPLIT_WINDOW, DEV)
    return q, k, v, do, mask, ssa_scalars(transform)


def _branch_grads(K, branch, leaves, do):
    """The branch's kernel output and the gradients of every leaf."""
    l = leaves
    ssa = {n: l[n] for n in ("n", "b") if n in l}
    transform = "ssa" if ssa else "softmax"
    if branch == "compressed":
        out, _ = K.range_attn.compressed_attention(l["q"], l["k"], l["v"], TINY.block_len, TINY.stride,
                                                   transform=transform, **ssa)
    else:
        out = K.range_attn.window_attention(l["q"], l["k"], l["v"], SPLIT_WINDOW, transform=transform, **ssa)
    return out, grads(out, leaves, do)


@pytest.fixture
def spy_dkv(K, monkeypatch):
    """Records every dK/dV launch: ``(split, dk, dv, dnb)`` as ``_range_bwd_dkv`` returned them
    (fp32 partials ``[split, B, Hkv, NK, D]`` when split > 1)."""
    calls = []
    real = K.range_attn._range_bwd_dkv

    def wrapped(*args):
        res = real(*args)
        calls.append((args[-2], *(t.detach().clone() for t in res)))
        return res

    monkeypatch.setattr(K.range_attn, "_range_bwd_dkv", wrapped)
    return calls


@pytest.mark.parametrize("case", SPLIT_CASES, ids=_split_ids)
def test_dkv_split_matches_unsplit_and_reference(K, monkeypatch, spy_dkv, case):
    """Forced SPLIT in {2, 3}: dq, dk, dv (dn, db) equal the unsplit kernel's up to fp32
    summation order, and the naive reference within the branch tests' bound."""
    branch, split = case[6], case[7]
    q, k, v, do, mask, ssa = _branch_inputs(case, 31)
    leaves = dict(q=q, k=k, v=v, **ssa)
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "dkv_split", 1)
    _, g1 = _branch_grads(K, branch, leaves, do)
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "dkv_split", split)
    out, gs = _branch_grads(K, branch, leaves, do)
    assert [c[0] for c in spy_dkv] == [1, split]  # the override reached the launcher
    assert spy_dkv[1][1].shape == (split, *k.shape) and spy_dkv[1][1].dtype == torch.float32
    assert torch.equal(gs["q"], g1["q"])  # the dQ kernel is not split
    for name in ("k", "v"):
        torch.testing.assert_close(gs[name], g1[name], rtol=1e-5, atol=1e-6, msg=f"d{name} split {split} vs 1")
    if ssa:
        terms = dict(zip("nb", ssa_scalar_grad_terms(q, k, v, ssa["n"], ssa["b"], do, mask=mask)))
        for name in ("n", "b"):
            assert abs(gs[name].item() - g1[name].item()) <= 1e-6 * terms[name], f"d{name} split {split} vs 1"
    transform = case[5]
    check_grads_fp64(gs, leaves, lambda l: masked_attention(
        l["q"], l["k"], l["v"], mask, transform=transform, n=l.get("n"), b=l.get("b"))[0], do, 1e-5,
        f"{branch} split {split}", keep=mask)


@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_dkv_split_is_deterministic(K, monkeypatch, transform):
    """Two backward passes through the split path give bit-identical gradients (no atomics,
    fixed-order reduction)."""
    case = (2, 6, 2, 70, 32, transform, "compressed", 3)
    q, k, v, do, _, ssa = _branch_inputs(case, 32)
    leaves = dict(q=q, k=k, v=v, **ssa)
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "dkv_split", 3)
    _, a = _branch_grads(K, "compressed", leaves, do)
    _, b = _branch_grads(K, "compressed", leaves, do)
    for name in leaves:
        assert torch.equal(a[name], b[name]), f"d{name} differs between two runs"


def test_dkv_split_every_chunk_counts(K, monkeypatch, spy_dkv):
    """Negative control: every chunk's partial carries a share of dk, dv that the reduction
    cannot drop -- a sum that left any one chunk out would miss the tolerance above by orders
    of magnitude. Compressed branch, N = 70 (5 query blocks of 16), SPLIT = 3: key tile 0
    (keys 0..15, positions 3..33) is seen by rows 3..69, so each chunk (blocks 0 | 1-2 | 3-4)
    has visible keys."""
    case = (1, 6, 2, 70, 32, "ssa", "compressed", 3)
    q, k, v, do, _, ssa = _branch_inputs(case, 33)
    leaves = dict(q=q, k=k, v=v, **ssa)
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "dkv_split", 3)
    _, gs = _branch_grads(K, "compressed", leaves, do)
    (split, dk_p, dv_p, dnb), = spy_dkv
    assert split == 3 and dk_p.shape == (3, *k.shape)
    n_tiles = -(-k.shape[2] // 16)
    assert dnb.shape == (n_tiles * k.shape[0] * k.shape[1] * split, 2)  # one dn/db slot per program
    for name, part in (("k", dk_p), ("v", dv_p)):
        assert torch.equal(part.sum(0), gs[name])  # fp32 inputs: no cast after the reduction
        for s in range(split):
            assert part[s, :, :, :16].abs().sum() > 0, f"d{name} chunk {s} is empty"
            dropped = part.sum(0) - part[s]
            err = rel_err(dropped, gs[name])
            assert err > 1e-3, f"dropping chunk {s} of d{name} moves it by only {err:.2e}"


# (B, Hq, Hkv, N, D, transform, branch, split): whole visible tiles (the unmasked stages),
# ragged ends, the dK/dV split, a padded head dim
TMA_CASES = [
    (1, 4, 2, 100, 32, "softmax", "compressed", 1),
    (2, 3, 1, 83, 48, "ssa", "compressed", 2),
    (1, 4, 2, 100, 32, "softmax", "window", 1),
    (1, 4, 2, 91, 32, "ssa", "window", 1),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=_split_ids)
def test_range_kernels_tma_path(K, monkeypatch, case):
    """The tensor-descriptor path (``TILE_OVERRIDE["tma"] = 1``; the interpreter emulates the
    TMA) equals the pointer path up to fp32 reassociation and the fp64 reference. Its dK/dV
    kernel takes the masked/unmasked stages, which the pointer kernel does not."""
    branch, split = case[6], case[7]
    window = 40 if branch == "window" else None
    q, k, v, do, _, ssa = _branch_inputs(case, 34)
    mask = window_mask(q.shape[2], window, DEV) if window else compressed_visibility(q.shape[2], TINY, DEV)
    leaves = dict(q=q, k=k, v=v, **ssa)
    transform = case[5]
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "dkv_split", split)

    def run():
        ls = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
        if window:
            out = K.range_attn.window_attention(ls["q"], ls["k"], ls["v"], window, transform=transform,
                                                **{n: ls[n] for n in ("n", "b") if n in ls})
        else:
            out, _ = K.range_attn.compressed_attention(ls["q"], ls["k"], ls["v"], TINY.block_len, TINY.stride,
                                                       transform=transform, **{n: ls[n] for n in ("n", "b") if n in ls})
        return out, grads(out, ls, do)

    launched = []
    real = K.range_attn.descriptor
    monkeypatch.setattr(K.range_attn, "descriptor", lambda *a: launched.append(a[1:]) or real(*a))
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "tma", 0)
    o_ptr, g_ptr = run()
    assert not launched
    monkeypatch.setitem(K.range_attn.TILE_OVERRIDE, "tma", 1)
    o_tma, g_tma = run()
    assert len(launched) == 6  # k, v (forward); k, v (dQ); q, dO (dK/dV)
    torch.testing.assert_close(o_tma, o_ptr, rtol=1e-5, atol=1e-6)
    for name in ("q", "k", "v"):  # (dn, db: cancelling sums, checked against fp64 below)
        torch.testing.assert_close(g_tma[name], g_ptr[name], rtol=1e-4, atol=1e-5, msg=f"d{name}: tma vs pointers")
    check_grads_fp64(g_tma, leaves, lambda l: masked_attention(
        l["q"], l["k"], l["v"], mask, transform=transform, n=l.get("n"), b=l.get("b"))[0], do, 1e-5,
        f"{branch} tma", keep=mask)


def test_range_tma_choice(K, monkeypatch):
    """Which kernels take descriptors: all three up to D64; above it the dQ kernel keeps
    pointers (its descriptor build faults at D128 on sm_90, Triton 3.6), even when forced."""
    R = K.range_attn
    x = torch.zeros(1, 2, 8, 128)
    monkeypatch.setitem(R.TILE_OVERRIDE, "tma", 1)
    assert R._tma("fwd", 128, x, scores=0) == 1 and R._tma("dkv", 128, x, scores=0) == 1
    assert R._tma("dq", 128, x, scores=0) == 0 and R._tma("dq", 64, x[..., :64], scores=0) == 1
    monkeypatch.setitem(R.TILE_OVERRIDE, "tma", 0)
    assert R._tma("fwd", 64, x[..., :64], scores=1 << 30) == 0
    monkeypatch.delitem(R.TILE_OVERRIDE, "tma")
    assert R._tma("fwd", 64, x[..., :64], scores=1 << 30) == 1  # the interpreter emulates the TMA
    assert R._tma("fwd", 64, x[..., :64], scores=100) == 0  # short calls keep the cached pointer launch


def test_dkv_split_choice(K):
    """The host heuristic: 1 for the window branch and small problems, > 1 for the 64K
    compressed branch (enough programs, bounded per-program work), never more chunks than
    query blocks, memory-capped, and the override wins."""
    R = K.range_attn
    split = R._dkv_split
    # compressed branch, N = 64K, Hq 64 / Hkv 4, D 64, l 32, d 16, bwd tiles 128 x 64
    nk = (65536 - 32) // 16 + 1
    s64k = split(65536, nk, 1, 4, 16, 64, 128, 64, 16, None)
    tiles = -(-nk // 64)
    assert s64k > 1
    assert tiles * 4 * s64k >= R.DKV_PROGRAMS_PER_SM * 132  # fills an H100
    assert 16 * -(-512 // s64k) <= R.DKV_MAX_ITERS  # longest program's iterations
    assert s64k * 2 * 4 * nk * 64 * 4 <= R.DKV_PARTIAL_BYTES
    # window branch at the same size; tiny problems (the interpreter tests' sizes)
    assert split(65536, 65536, 1, 4, 16, 64, 128, 64, 1, 512) == 1
    assert split(70, num_compressed_blocks(70, TINY), 2, 2, 3, 32, 16, 16, 2, None) == 1
    assert split(4096, 4096, 1, 8, 3, 128, 64, 64, 1, 512) == 1
    # a window as long as the sequence is causal attention: split for bounded work
    assert split(65536, 65536, 1, 1, 64, 128, 64, 64, 1, 65536) > 1
    # memory cap: a huge batch at 64K keeps the partials within budget (here: no split)
    assert split(65536, nk, 64, 8, 2, 128, 64, 64, 16, None) == 1
    # never more chunks than query blocks, automatic or forced
    for n_tok in (1, 15, 17, 100, 1000, 4088, 65536):
        for window, kstride in ((None, 16), (512, 1), (7, 1)):
            nk_ = n_tok if window else max(0, (n_tok - 32) // 16 + 1)
            for bsz, hkv, group in ((1, 1, 1), (1, 4, 16), (4, 8, 3)):
                for ov in (0, 2, 3, 1000):
                    s = split(n_tok, nk_, bsz, hkv, group, 64, 128, 64, kstride, window, override=ov)
                    assert 1 <= s <= max(1, -(-n_tok // 128)), (n_tok, window, bsz, hkv, group, ov, s)
    # the override wins over the heuristic (both ways), clamped to the query blocks
    assert split(65536, nk, 1, 4, 16, 64, 128, 64, 16, None, override=1) == 1
    assert split(65536, 65536, 1, 4, 16, 64, 128, 64, 1, 512, override=5) == 5
    assert split(37, 17, 1, 2, 3, 32, 16, 16, 2, None, override=3) == 3
    assert split(37, 17, 1, 2, 3, 32, 16, 16, 2, None, override=9) == 3
    # more SMs: more programs wanted
    assert split(16384, 1023, 1, 8, 3, 32, 128, 64, 16, None, n_sm=264) >= \
        split(16384, 1023, 1, 8, 3, 32, 128, 64, 16, None, n_sm=132)


@pytest.mark.parametrize("heads_inner,banded,w_prec", [(False, False, None), (True, False, None),
                                                       (True, False, "split"), (True, True, None),
                                                       (True, True, "split")])
@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_selection_kernels_match_reference(K, transform, heads_inner, banded, w_prec, monkeypatch):
    # the three loop orders of the importance kernel (per head; heads summed per chunk over
    # selection tiles; banded: each chunk once, into two STEP-wide windows), and the hi/lo
    # split overlap product the 16-bit GPU path uses
    monkeypatch.setitem(K.select.TILE_OVERRIDE, "heads_inner", heads_inner)
    monkeypatch.setitem(K.select.TILE_OVERRIDE, "banded", banded)
    if w_prec:
        monkeypatch.setitem(K.select.TILE_OVERRIDE, "w_prec", w_prec)
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=5, window=8)
    # interpreter tiles: 16 compressed blocks per chunk, STEP = 16 * 2 / 8 = 4 selection blocks
    assert K.select.banded_step(16, cfg.stride, cfg.block_len, cfg.select_block) == 4
    # banded, N = 67: the last query tile sees exactly 32 compressed blocks, so the last
    # block of its last chunk overhangs into the final window (the one stored after the loop)
    B, Hq, Hkv, N, D = 2, 6, 2, 67 if banded else 70, 32
    g = gen(23)
    nc = num_compressed_blocks(N, cfg)
    q, kc = rnd(B, Hq, N, D, g=g).detach(), rnd(B, Hkv, nc, D, g=g).detach()
    ssa = {n: t.detach() for n, t in ssa_scalars(transform).items()}
    _, lse = K.range_attn.compressed_attention(q, kc, kc, cfg.block_len, cfg.stride, transform=transform, **ssa)
    _, p = masked_attention(q, kc, kc, compressed_visibility(N, cfg, DEV), transform=transform, **ssa)
    ref_imp = selection_importance(p, cfg, Hkv)
    imp = K.select.importance_scores(q, kc, lse, cfg, transform=transform, **ssa)
    assert rel_err(imp, ref_imp) < 1e-5
    # every entry, not only the norm: a block's share missing from one window shows here
    assert (imp - ref_imp).abs().max().item() <= 1e-5 * ref_imp.abs().max().item()
    # top-n on identical scores: exactly the reference's choice (ties -> lower index)
    raw = K.select.topn_blocks(ref_imp, cfg)
    key = torch.where(raw < 0, 999, raw)
    canon = torch.gather(raw, -1, torch.sort(key, -1).indices)
    assert torch.equal(canon.long(), select_blocks(ref_imp, cfg))
    # end to end, queries in chunks of 64 rows (buffer of 64 rows x Nsel x B*Hkv)
    idx = K.select.select_blocks_triton(q, kc, lse, cfg, transform=transform, **ssa,
                                        max_buffer_elems=64 * num_select_blocks(N, cfg) * B * Hkv)
    assert idx.dtype == torch.int32
    assert torch.equal(idx.long(), select_blocks(ref_imp, cfg))


def test_banded_step_applies_only_where_chunks_align(K):
    banded_step = K.select.banded_step
    assert banded_step(64, 16, 32, 64) == 16  # the paper's l=32, d=16, l'=64: 64 blocks = 16 selection blocks
    assert banded_step(128, 16, 32, 64) == 32
    assert banded_step(64, 24, 32, 64) == 0  # 64 * 24 = 1536 tokens: not a power-of-two count of l'
    assert banded_step(64, 16, 32, 48) == 0  # chunks do not start on selection-block boundaries


def test_topn_kernel_ties_and_short_rows(K):
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=5, window=8)
    N, ns = 70, num_select_blocks(70, cfg)
    imp = torch.zeros(1, 2, N, ns, device=DEV)
    imp[0, 1, :, 3] = 0.5  # one clear winner, the rest tied at zero
    raw = K.select.topn_blocks(imp, cfg, t0=0)
    canon = torch.gather(raw, -1, torch.sort(torch.where(raw < 0, 999, raw), -1).indices)
    assert torch.equal(canon.long(), select_blocks(imp, cfg))
    assert canon[0, 0, 5].tolist() == [0, -1, -1, -1, -1]  # one eligible block
    assert canon[0, 1, 69].tolist() == [0, 1, 3, 7, 8]


def test_topn_kernel_width_buckets_and_row_chunks(K):
    # Nsel = 25 > 16: rows before 16 * l' run with BLOCK_S = 16, later rows with 32; also
    # called on row chunks (t0 > 0) as select_blocks_triton does. NaN in the never-read
    # entries (blocks after a row's own) must not matter; distinct scores, no ties.
    cfg = NSAConfig(block_len=4, stride=2, select_block=4, top_n=5, window=8)
    N = 100
    ns = num_select_blocks(N, cfg)
    assert ns > 16
    g = gen(29)
    imp = torch.rand(1, 2, N, ns, generator=g).to(DEV)
    ref = select_blocks(imp, cfg)
    poisoned = imp.clone()
    future = torch.arange(ns, device=DEV)[None, :] > (torch.arange(N, device=DEV) // cfg.select_block)[:, None]
    poisoned[:, :, future] = float("nan")
    for bounds in ((0, N), (0, 37), (37, 64), (64, 71), (71, N)):
        t0, t1 = bounds
        raw = K.select.topn_blocks(poisoned[:, :, t0:t1].contiguous(), cfg, t0=t0)
        canon = torch.gather(raw, -1, torch.sort(torch.where(raw < 0, 999, raw), -1).indices)
        assert torch.equal(canon.long(), ref[:, :, t0:t1]), bounds


SELECTED_CASES = [  # (B, Hq, Hkv, N, D, transform, top_n)
    (1, 6, 2, 45, 32, "softmax", 4),
    (1, 3, 1, 29, 32, "ssa", 3),
    (2, 6, 2, 70, 64, "softmax", 5),
    (1, 16, 1, 37, 32, "ssa", 3),  # GQA 16: the query-major forward by default
]


@pytest.mark.parametrize("schedule", ["default", "kv-major", "query-major", "query-major-tma"])
@pytest.mark.parametrize("case", SELECTED_CASES, ids=lambda c: _ids(c[:6]) + f"-n{c[6]}")
def test_selected_kernel(K, case, schedule, monkeypatch):
    B, Hq, Hkv, N, D, transform, top_n = case
    if schedule != "default":  # both forwards on every group size (same contract: o, lse)
        monkeypatch.setitem(K.selected.TILE_OVERRIDE, "qmajor", schedule.startswith("query-major"))
    if schedule.startswith("query-major"):  # K/V through pointers, or descriptors (branch-free slot loop)
        monkeypatch.setitem(K.selected.TILE_OVERRIDE, "qmajor_tma", int(schedule.endswith("tma")))
        monkeypatch.setitem(K.selected.TILE_OVERRIDE, "qmajor_dq_tma", int(schedule.endswith("tma")))
        # the backward's dq: inside the KV-major kernel (fp32 atomics) under the pointer
        # forward, query-major (the default at GQA >= 16) under the descriptor one
        monkeypatch.setitem(K.selected.TILE_OVERRIDE, "qmajor_dq", schedule.endswith("tma"))
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=top_n, window=8)
    g = gen(24)
    q, k, v = rnd(B, Hq, N, D, g=g), rnd(B, Hkv, N, D, g=g), rnd(B, Hkv, N, D, g=g)
    idx = select_blocks(torch.rand(B, Hkv, N, num_select_blocks(N, cfg), generator=g).to(DEV), cfg)
    idx[0, 0, 3] = -1  # a row with no block at all: output 0, no NaN
    ssa = ssa_scalars(transform)
    leaves = dict(q=q, k=k, v=v, **ssa)
    out = K.selected.selected_attention(q, k, v, idx.int(), cfg.select_block, transform=transform, **ssa)
    causal = torch.ones(N, N, dtype=torch.bool, device=DEV).tril()
    keep = (selection_keep_mask(idx, N, cfg) & causal).repeat_interleave(Hq // Hkv, 1)
    ref, _ = masked_attention(q, k, v, keep, transform=transform, **ssa)
    assert rel_err(out, ref) < 1e-5
    assert (out[0, : Hq // Hkv, 3] == 0).all()
    do = torch.randn_like(ref)
    check_grads_fp64(grads(out, leaves, do), leaves, lambda l: masked_attention(
        l["q"], l["k"], l["v"], keep, transform=transform, n=l.get("n"), b=l.get("b"))[0], do, 1e-5, "selected",
        keep=keep)


def test_row_delta_matches_fp64_and_zeroes_the_accumulator(K):
    """The backwards' ``delta = rowsum(o * do)`` in one pass: fp64 reference on a permuted
    (Megatron-like) layout with odd sizes, and the NaN-poisoned fp32 accumulator zeroed."""
    from nemo_ssa.ops.nsa._common import row_delta

    g = gen(31)
    o = rnd(2, 37, 3, 24, g=g).permute(0, 2, 1, 3)  # [B, H, N, D] view of [B, N, H, D]
    do = rnd(2, 3, 37, 24, g=g)
    acc = torch.full((2, 3, 37, 24), float("nan"), device=DEV)
    delta = row_delta(o, do, zero=acc)
    ref = (o.double() * do.double()).sum(-1)
    assert delta.dtype == torch.float32 and delta.shape == (2, 3, 37)
    assert (delta.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert (acc == 0).all()


def test_selected_backward_tiles_refuse_the_miscompiled_one(K, monkeypatch):
    """The KV-major backward without dq at D > 64: 32 or fewer rows x 4 warps x 3+ stages
    gave a wrong dK on sm_90 under Triton 3.6 (2026-11-26-nsa-qmajor-dq, call 3), so the
    tile lookup refuses it by name; the defaults and the neighbouring tiles pass."""
    A = K.selected
    monkeypatch.setattr(A, "is_interpreter", lambda: False)
    assert A._dkv_tiles(128, 0) == (128, 8, 2) and A._dkv_tiles(64, 1) == (32, 4, 3)
    for ov in (dict(block_q=32, num_warps=4, num_stages=3), dict(block_q=16, num_warps=4, num_stages=3)):
        monkeypatch.setattr(A, "TILE_OVERRIDE", dict(ov))
        with pytest.raises(ValueError, match="miscompiled"):
            A._dkv_tiles(128, 1)
        assert A._dkv_tiles(64, 1) == (ov["block_q"], 4, 3)  # D64: measured right
    monkeypatch.setattr(A, "TILE_OVERRIDE", dict(block_q=32, num_warps=4, num_stages=2))
    assert A._dkv_tiles(128, 0) == (32, 4, 2)
    assert A.use_qmajor_dq(16, 128) and not A.use_qmajor_dq(3, 64) and not A.use_qmajor_dq(16, 256)


def test_worklist_inverts_the_selection(K):
    idx = torch.tensor([[[[0, 1], [0, -1], [1, 0]]]], device=DEV)  # B=1, Hkv=1, N=3, n=2
    wl = K.selected.build_worklist(idx, n_select_blocks=2, block_q=2)
    items = wl.items[wl.items[:, 2] > 0].tolist()
    # block 0: queries 0, 1, 2 (chunks of 2), block 1: queries 0, 2
    assert [(i[0], i[2]) for i in items] == [(0, 2), (0, 1), (1, 2)]
    pairs = [(int(wl.tq[s + r]), int(wl.ts[s + r])) for _, s, c in items for r in range(c)]
    assert pairs == [(0, 0), (1, 0), (2, 1), (0, 1), (2, 0)]


LAYER_CASES = [  # (B, Hq, Hkv, N, D, transform, separate_kv, compress)
    (1, 6, 2, 45, 32, "softmax", True, "mlp"),
    (2, 3, 1, 33, 16, "ssa", False, "mean"),
    (2, 6, 2, 70, 32, "softmax", True, "mlp"),
    (1, 6, 2, 61, 32, "ssa", True, "mlp"),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: _ids(c[:6]) + ("-sepkv" if c[6] else "-sharedkv") + f"-{c[7]}")
def test_whole_layer_kernels_fp32(K, case):
    B, Hq, Hkv, N, D, transform, separate_kv, compress = case
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=4, window=8, compress=compress,
                    separate_kv=separate_kv)
    (q, k, v, gates), kw, leaves = layer_inputs(B, Hq, Hkv, N, D, cfg, seed=31, separate_kv=separate_kv)
    ssa = ssa_scalars(transform)
    leaves.update(ssa)
    ref, aux_ref = nsa_attention_naive(q, k, v, gates, cfg, **kw, transform=transform, **ssa, return_aux=True)
    out, aux = nsa_attention(q, k, v, gates, cfg, **kw, transform=transform, **ssa, impl="triton", return_aux=True)
    # same selection (fixed seed, no near-tie); otherwise the outputs would differ by blocks
    assert torch.equal(aux["block_idx"].long(), aux_ref["block_idx"])
    assert rel_err(out, ref) < 1e-4
    do = torch.randn_like(ref)
    terms = _layer_terms(q, gates, cfg, ssa, do, aux, dict(kw, k=k, v=v)) if ssa else None
    check_grads(grads(out, leaves, do), grads(ref, leaves, do), 1e-4, transform, "layer", terms=terms)


def test_whole_layer_nan_poisoned_buffers(K, monkeypatch):
    """Every output/accumulator buffer the launchers allocate starts as NaN: an element a
    kernel forgets to write (or a zeros() the algorithm relies on being replaced by
    empty()) shows up as NaN in the output or a gradient."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(fn):
        def wrapped(*a, **k):
            t = fn(*a, **k)
            if t.is_floating_point():
                t.fill_(math.nan)
            return t
        return wrapped

    cfg = TINY
    (q, k, v, gates), kw, leaves = layer_inputs(1, 6, 2, 27, 32, cfg, seed=41)
    ref = nsa_attention_naive(q, k, v, gates, cfg, **kw)
    do = torch.randn_like(ref)
    ref_g = grads(ref, leaves, do)
    monkeypatch.setattr(torch, "empty", poisoned(real_empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(real_empty_like))
    out = nsa_attention(q, k, v, gates, cfg, **kw, impl="triton")
    got_g = grads(out, leaves, do)
    monkeypatch.undo()
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-4
    check_grads(got_g, ref_g, 1e-4, "softmax", "poisoned")


def test_whole_layer_fp16_within_2x_eager(K):
    cfg = TINY
    (q, k, v, gates), kw, leaves = layer_inputs(1, 6, 2, 41, 32, cfg, dtype=torch.float16, seed=51)
    ref, aux = nsa_attention_naive(q, k, v, gates, cfg, **kw, return_aux=True)
    idx = aux["block_idx"]  # one selection for all three: a fp16 near-tie must not flip a block
    eager = nsa_attention_naive(q, k, v, gates, cfg, **kw, upcast=False, block_idx=idx)
    out = nsa_attention(q, k, v, gates, cfg, **kw, impl="triton", block_idx=idx)
    assert out.dtype == torch.float16
    assert_within_2x_eager(out, eager, ref, "o")
    do = torch.randn_like(ref)
    g_ref, g_eager, g_out = grads(ref, leaves, do), grads(eager, leaves, do), grads(out, leaves, do)
    for name in leaves:
        if name == "phi_k.b2":
            continue  # true gradient 0 (see check_grads)
        assert_within_2x_eager(g_out[name], g_eager[name], g_ref[name], f"d{name}", floor=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gate_kernel(K, dtype):
    g = gen(71)
    o = [rnd(2, 3, 19, 48, g=g, dtype=dtype) for _ in range(3)]
    gates = rnd(2, 3, 19, 3, g=g, dtype=dtype, scale=2.0)
    out = K.gate.gate_combine(*o, gates)
    s = torch.sigmoid(gates.double())
    ref = s[..., 0:1] * o[0].double() + s[..., 1:2] * o[1].double() + s[..., 2:3] * o[2].double()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert out.dtype == dtype and rel_err(out, ref) < tol
    do = torch.randn(ref.shape, generator=g).to(DEV, dtype)
    for a, b in zip(torch.autograd.grad(out, [*o, gates], do), torch.autograd.grad(ref, [*o, gates], do.double())):
        assert rel_err(a, b) < tol * 3
    with pytest.raises(ValueError, match="do not match"):
        K.gate.gate_combine(o[0], o[1], o[2], gates[..., :2])


def test_kernel_input_validation(K):
    g = gen(61)
    q, k, v = (torch.randn(1, 3, 9, 32, generator=g, dtype=torch.float64).to(DEV) for _ in range(3))
    with pytest.raises(ValueError, match=r"support dtypes \['float16', 'bfloat16', 'float32'\]"):
        K.range_attn.window_attention(q, k[:, :1], v[:, :1], 4)
    q8 = torch.randn(1, 3, 9, 8, device=DEV)
    with pytest.raises(ValueError, match=r"head dim 8 not supported .*16\.\.256"):
        K.range_attn.window_attention(q8, q8[:, :1], q8[:, :1], 4)
    qf = q.float()
    with pytest.raises(ValueError, match="block_idx must be an int tensor"):
        K.selected.selected_attention(qf, qf[:, :1], qf[:, :1], torch.zeros(1, 1, 9, 3, device=DEV), 8)
    with pytest.raises(ValueError, match="takes no n/b"):
        K.range_attn.window_attention(qf, qf[:, :1], qf[:, :1], 4, n=torch.ones(1))
