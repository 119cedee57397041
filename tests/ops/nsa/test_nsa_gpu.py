"""NSA Triton kernels on a GPU at the paper's sizes (l=32, d=16, l'=64, n=16, w=512).

Model shape Hq=24, Hkv=8 (GQA 3), D in {32, 64, 128}, N = 1000 and 4088 (> the 512
window, 64 selection blocks of which 16 are chosen; both N = 8 mod 16 with ragged last
blocks, so Triton's integer specialisation -- ==1, divisible by 16 -- compiles one
variant for both lengths), softmax and SSA (``attention=nsa_ssa``) transforms. fp32:
output and every gradient (q, each branch's k/v, gates, φ) < 1e-3 relative to the fp32
reference, SSA's dn/db within 2e-5 x sum|terms| (``nsa_scalar_grad_terms``; they are sums
that cancel); bf16: ≤ 2× the error of the eager bf16 reference (same selection for all
three, so a bf16 near-tie cannot flip a block), dn/db 2× eager + 1.6e-2 x sum|terms|.
Each (dtype, head dim, transform) compiles the whole kernel set once, so the cases spread
the head dims over the two dtypes instead of crossing them. The dense reference needs
~15 GB at N=4088 (marker ``gpu_big``: scripts/device/gpu_session.py runs them alone, with one worker).

Run:  pytest -q -m gpu tests/ops/nsa/test_nsa_gpu.py      (skips without CUDA)
"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from nemo_ssa.ops.nsa import (  # noqa: E402
    NSAConfig,
    PhiParams,
    init_phi_params,
    nsa_attention,
    nsa_attention_naive,
    num_compressed_blocks,
    num_select_blocks,
    select_blocks,
    selection_importance,
)
from nemo_ssa.ops.nsa.naive import compressed_visibility, masked_attention, window_mask  # noqa: E402
from nemo_ssa.testing import (  # noqa: E402
    assert_scalar_grad_close,
    assert_within_2x_eager,
    nsa_scalar_grad_terms,
    rel_err,
)

PAPER = NSAConfig()  # 32 / 16 / 64 / 16 / 512, mlp, separate kv
HQ, HKV = 24, 8
DEV = "cuda"


def inputs(B, N, D, dtype, seed=0, transform="softmax"):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(DEV, dtype).requires_grad_()

    q = r(B, HQ, N, D)
    kv = [r(B, HKV, N, D) for _ in range(6)]
    gates = r(B, HQ, N, 3)
    phi = [init_phi_params(PAPER, D, dtype=dtype, device=DEV, generator=g, std=0.1, requires_grad=True)
           for _ in range(2)]
    kw = dict(k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5], phi_k=phi[0], phi_v=phi[1], transform=transform)
    leaves = dict(q=q, k=kv[0], v=kv[1], k_slc=kv[2], v_slc=kv[3], k_win=kv[4], v_win=kv[5], gate=gates)
    for w, p in (("phi_k", phi[0]), ("phi_v", phi[1])):
        leaves.update({f"{w}.{f}": t for f, t in zip(PhiParams._fields, p)})
    if transform == "ssa":  # n, b fp32 like the training modules keep them
        kw["n"] = leaves["n"] = torch.tensor([0.5 + 1.5 * torch.rand((), generator=g).item()], device=DEV,
                                             requires_grad=True)
        kw["b"] = leaves["b"] = torch.tensor([0.3 + 1.2 * torch.rand((), generator=g).item()], device=DEV,
                                             requires_grad=True)
    return (q, kv[0], kv[1], gates), kw, leaves


def grads(out, leaves, do):
    names = list(leaves)
    return dict(zip(names, torch.autograd.grad(out, [leaves[n] for n in names], do)))


def scalar_terms(q, gates, kw, do, aux):
    """{"n": sum|dn terms|, "b": sum|db terms|} over the three gated branches."""
    tn, tb = nsa_scalar_grad_terms(q, gates, PAPER, kw["n"], kw["b"], do, aux, k_slc=kw["k_slc"],
                                   v_slc=kw["v_slc"], k_win=kw["k_win"], v_win=kw["v_win"])
    return {"n": tn, "b": tb}


BIG = pytest.mark.gpu_big  # run alone (scripts/device/gpu_session.py full-2 runs them with one worker)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Hand cached blocks back before each test: the N=4088 cases peak near 15 GB each
    and run beside other xdist workers, and the allocator's cache from the previous
    big case left too little free (OOM on an 80 GB H100 with 4 workers)."""
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    yield
QUICK = pytest.mark.gpu_quick
# (B, N, D, transform, marks): head dims spread over the dtypes, both transforms each
FP32_CASES = [(2, 1000, 32, "softmax", (QUICK,)), (1, 4088, 32, "ssa", (BIG,)),
              (1, 4088, 128, "softmax", (BIG,)), (2, 1000, 64, "ssa", ())]
BF16_CASES = [(2, 1000, 32, "ssa", (QUICK,)), (1, 4088, 32, "softmax", (BIG,)),
              (1, 4088, 64, "ssa", (BIG,)), (2, 1000, 128, "softmax", ())]


def _params(cases, suffix=""):
    return [pytest.param(B, N, D, tr, id=f"B{B}-T{N}-HQ24-HKV8-D{D}-{tr}{suffix}", marks=m) for B, N, D, tr, m in cases]


@pytest.mark.parametrize("B, N, D, transform", _params(FP32_CASES))
def test_layer_fp32_paper_sizes(B, N, D, transform):
    (q, k, v, gates), kw, leaves = inputs(B, N, D, torch.float32, seed=N + D, transform=transform)
    ref, aux = nsa_attention_naive(q, k, v, gates, PAPER, **kw, return_aux=True)
    out, aux_k = nsa_attention(q, k, v, gates, PAPER, **kw, impl="triton", return_aux=True)
    # selections agree up to near-ties of fp32 scores; compare outputs on one selection
    same = (aux_k["block_idx"].long() == aux["block_idx"]).all(-1).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the rows chose the reference's blocks"
    out = nsa_attention(q, k, v, gates, PAPER, **kw, impl="triton", block_idx=aux["block_idx"])
    assert rel_err(out, ref) < 1e-3
    do = torch.randn_like(ref)
    g_ref, g_out = grads(ref, leaves, do), grads(out, leaves, do)
    terms = scalar_terms(q, gates, kw, do, aux) if transform == "ssa" else {}
    for name in leaves:
        if name == "phi_k.b2" and transform == "softmax":  # softmax-invariant shift: true gradient 0
            assert g_out[name].abs().max() <= 1e-4 * g_ref["phi_k.w2"].abs().max()
            continue
        if name in terms:  # cancelling scalar sums: bounded by sum|terms|
            assert_scalar_grad_close(f"d{name}", g_out[name], g_ref[name], terms[name], torch.float32)
            continue
        err = rel_err(g_out[name], g_ref[name])
        assert err < 1e-3, f"d{name}: {err:.3e}"


@pytest.mark.parametrize("B, N, D, transform", _params(BF16_CASES, "-bf16"))
def test_layer_bf16_within_2x_eager(B, N, D, transform):
    (q, k, v, gates), kw, leaves = inputs(B, N, D, torch.bfloat16, seed=7 * N + D, transform=transform)
    ref, aux = nsa_attention_naive(q, k, v, gates, PAPER, **kw, return_aux=True)
    idx = aux["block_idx"]
    eager = nsa_attention_naive(q, k, v, gates, PAPER, **kw, upcast=False, block_idx=idx)
    out = nsa_attention(q, k, v, gates, PAPER, **kw, impl="triton", block_idx=idx)
    assert_within_2x_eager(out, eager, ref, "o")
    do = torch.randn_like(ref)
    # d phi_k.b2 = sum over (batch, kv head, block) of d k_cmp: softmax-invariant (0) under
    # softmax and a strongly cancelling sum under SSA, so its relative error is no measure;
    # the rounding noise of a sum of bf16-rounded terms is ~eps * ||terms||_2 per component
    dk_cmp = torch.autograd.grad(ref, aux["k_cmp"], do, retain_graph=True)[0].double()
    b2_noise = dk_cmp.pow(2).flatten(0, -2).sum(0).sqrt()  # [D]
    g_ref, g_eager, g_out = grads(ref, leaves, do), grads(eager, leaves, do), grads(out, leaves, do)
    terms = scalar_terms(q, gates, kw, do, aux) if transform == "ssa" else {}
    for name in leaves:
        if name == "phi_k.b2" and transform == "softmax":
            continue
        if name == "phi_k.b2":
            err = (g_out[name].double() - g_ref[name].double()).norm().item()
            eager_err = (g_eager[name].double() - g_ref[name].double()).norm().item()
            bound = 2.0 * eager_err + 2.0 ** -8 * b2_noise.norm().item()
            assert err <= bound, (f"dphi_k.b2: ||got - ref|| {err:.3e} > 2 x eager {eager_err:.3e} + 2^-8 x "
                                  f"||d k_cmp||_2 {b2_noise.norm().item():.3e}")
            # negative control: the bound sees one of the ~B*Hkv*Nc summed terms missing
            rows = dk_cmp.flatten(0, -2)
            assert rows[rows.norm(dim=1).argmax()].norm().item() > bound, "dphi_k.b2 bound too loose"
            continue
        if name in terms:
            assert_scalar_grad_close(f"d{name}", g_out[name], g_ref[name], terms[name], torch.bfloat16,
                                     eager=g_eager[name])
            continue
        assert_within_2x_eager(g_out[name], g_eager[name], g_ref[name], f"d{name}", floor=1e-4)


@BIG
@pytest.mark.parametrize("heads", [(HQ, HKV), (32, 2)], ids=["gqa3", "gqa16"])  # GQA 16: the wide tiles
@pytest.mark.parametrize("D", [32, pytest.param(128, marks=())])
def test_selection_scores_and_topn_paper_sizes(D, heads):
    from nemo_ssa.ops.nsa.range_attn import compressed_attention
    from nemo_ssa.ops.nsa.select import importance_scores, select_blocks_triton, topn_blocks

    N = 4088
    HQ, HKV = heads
    g = torch.Generator(device="cpu").manual_seed(D)
    q = torch.randn(1, HQ, N, D, generator=g).to(DEV)
    kc = torch.randn(1, HKV, num_compressed_blocks(N, PAPER), D, generator=g).to(DEV)
    _, lse = compressed_attention(q, kc, kc, PAPER.block_len, PAPER.stride)
    _, p = masked_attention(q, kc, kc, compressed_visibility(N, PAPER, DEV))
    ref_imp = selection_importance(p, PAPER, HKV)
    imp = importance_scores(q, kc, lse, PAPER)
    assert rel_err(imp, ref_imp) < 1e-5
    raw = topn_blocks(ref_imp, PAPER)
    canon = torch.gather(raw, -1, torch.sort(torch.where(raw < 0, 10**6, raw), -1).indices)
    assert torch.equal(canon.long(), select_blocks(ref_imp, PAPER))
    idx = select_blocks_triton(q, kc, lse, PAPER, max_buffer_elems=HKV * num_select_blocks(N, PAPER) * 512)
    assert (idx.long() == select_blocks(ref_imp, PAPER)).all(-1).float().mean() > 0.99


@BIG
def test_window_kernel_int64_offsets():
    """B*H*N*D > 2^31 elements: offsets past int32 must be right (rows at the very end)."""
    from nemo_ssa.ops.nsa.range_attn import window_attention

    H, N, D, w = 8, 2 ** 21 + 3001, 128, 512
    assert H * N * D > 2 ** 31
    free = torch.cuda.mem_get_info()[0]
    if free < 24 * 2 ** 30:
        pytest.skip("needs ~20 GiB of free GPU memory")
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, H, N, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, H, N, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, H, N, D, device=DEV, dtype=torch.bfloat16, generator=g)
    out = window_attention(q, k, v, w)
    tail = 1000  # last rows of the last head: attend to keys N-tail-w+1 .. N-1
    lo = N - tail - w + 1
    qs, ks, vs = q[:, -1:, lo:], k[:, -1:, lo:], v[:, -1:, lo:]
    ref, _ = masked_attention(qs.float(), ks.float(), vs.float(), window_mask(qs.shape[2], w, DEV))
    got = out[:, -1:, lo:].float()
    assert rel_err(got[:, :, -tail:], ref[:, :, -tail:]) < 2e-2  # bf16 output rounding


@BIG
def test_window_and_compressed_kernels_fp32_at_4k():
    from nemo_ssa.ops.nsa.range_attn import compressed_attention, window_attention

    N, D = 4088, 32
    g = torch.Generator(device="cpu").manual_seed(3)
    q, k, v = (torch.randn(1, s, N, D, generator=g).to(DEV).requires_grad_() for s in (HQ, HKV, HKV))
    do = torch.randn(1, HQ, N, D, generator=g).to(DEV)
    out = window_attention(q, k, v, PAPER.window)
    ref, _ = masked_attention(q, k, v, window_mask(N, PAPER.window, DEV))
    assert rel_err(out, ref) < 1e-4
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        assert rel_err(a, b) < 1e-4
    nc = num_compressed_blocks(N, PAPER)
    kc, vc = (torch.randn(1, HKV, nc, D, generator=g).to(DEV).requires_grad_() for _ in range(2))
    out, lse = compressed_attention(q, kc, vc, PAPER.block_len, PAPER.stride)
    ref, _ = masked_attention(q, kc, vc, compressed_visibility(N, PAPER, DEV))
    assert rel_err(out, ref) < 1e-4
    assert torch.isinf(lse[..., : PAPER.block_len - 1]).all() and torch.isfinite(lse[..., PAPER.block_len - 1:]).all()
    for a, b in zip(torch.autograd.grad(out, (q, kc, vc), do), torch.autograd.grad(ref, (q, kc, vc), do)):
        assert rel_err(a, b) < 1e-4
    assert math.isfinite(out.float().sum().item())


def test_compressed_dkv_split_matches_unsplit_and_is_deterministic(monkeypatch):
    """The range backward's dK/dV query split where the heuristic picks SPLIT > 1 (the
    compressed branch at N = 4088: 4 key tiles x 8 kv heads): fp32 gradients equal the
    unsplit kernel's up to summation order, bf16 within a rounding of them, and two runs
    are bit-identical (no atomics, fixed-order reduction)."""
    from nemo_ssa.ops.nsa import range_attn as R

    N, D = 4088, 64
    nc = num_compressed_blocks(N, PAPER)
    bm, bn = R._blocks(D, "bwd")[:2]
    assert R._dkv_split(N, nc, 1, HKV, HQ // HKV, D, bm, bn, PAPER.stride, None) > 1
    g = torch.Generator(device="cpu").manual_seed(5)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q = torch.randn(1, HQ, N, D, generator=g).to(DEV, dt).requires_grad_()
        kc, vc = (torch.randn(1, HKV, nc, D, generator=g).to(DEV, dt).requires_grad_() for _ in range(2))
        do = torch.randn(1, HQ, N, D, generator=g).to(DEV, dt)

        def run(split):
            monkeypatch.setitem(R.TILE_OVERRIDE, "dkv_split", split)  # 0: automatic
            out, _ = R.compressed_attention(q, kc, vc, PAPER.block_len, PAPER.stride)
            return torch.autograd.grad(out, (q, kc, vc), do)

        auto, again, one = run(0), run(0), run(1)
        for name, a, b, c in zip(("q", "k", "v"), auto, again, one):
            assert torch.equal(a, b), f"{dt} d{name}: two runs differ"
            assert rel_err(a, c) < tol, f"{dt} d{name}: split vs unsplit {rel_err(a, c):.2e}"
        assert torch.equal(auto[0], one[0])  # the dQ kernel is not split


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("branch", ["compressed", "window"])
def test_range_kernels_tma_matches_pointers(monkeypatch, branch, D):
    """The Hopper path (tensor descriptors, the default on sm_90+) against the pointer
    kernels at N = 4088, bf16: output and gradients within bf16 rounding of each other and
    finite; skipped where the GPU cannot take the path. D128 runs the dQ kernel on pointers
    (``TMA_MAX_HEAD_DIM``) next to descriptor forward and dK/dV kernels."""
    from nemo_ssa.ops.common.tma import tma_capable
    from nemo_ssa.ops.nsa import range_attn as R

    if not tma_capable(torch.device(DEV)):
        pytest.skip("needs sm_90+ for tensor descriptors")
    N = 4088
    nk = num_compressed_blocks(N, PAPER) if branch == "compressed" else N
    g = torch.Generator(device="cpu").manual_seed(D)
    q = torch.randn(1, HQ, N, D, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, HKV, nk, D, generator=g).to(DEV, torch.bfloat16).requires_grad_() for _ in range(2))
    do = torch.randn(1, HQ, N, D, generator=g).to(DEV, torch.bfloat16)
    launched = []
    real = R.descriptor
    monkeypatch.setattr(R, "descriptor", lambda *a: launched.append(a[1]) or real(*a))

    def run(tma):
        monkeypatch.setitem(R.TILE_OVERRIDE, "tma", tma)
        if branch == "compressed":
            out, _ = R.compressed_attention(q, k, v, PAPER.block_len, PAPER.stride)
        else:
            out = R.window_attention(q, k, v, PAPER.window)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    ptr = run(0)
    assert not launched
    tma = run(1)
    assert len(launched) == (4 if D > 64 else 6)  # fwd k, v; (dQ k, v up to D64;) dK/dV q, dO
    for name, a, b in zip(("o", "dq", "dk", "dv"), tma, ptr):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 1e-2, f"{branch} D{D} {name}: descriptors vs pointers {rel_err(a, b):.2e}"


@pytest.mark.parametrize("schedule", ["default", "atomic-dq"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_selected_backward_gqa16_within_2x_eager(monkeypatch, transform, D, schedule):
    """The selected branch's backward at GQA 16 on its GPU tiles (N = 3001, bf16): dq
    query-major with dK/dV KV-major without dq (the default), and dq by atomics inside the
    KV-major kernel -- o, dq, dk, dv each within 2x eager bf16's error against fp32 from
    the same inputs, with a query that selects nothing (its dq row must be 0)."""
    from nemo_ssa.ops.nsa import selected_attn as A
    from nemo_ssa.ops.nsa.naive import selection_keep_mask

    N, hq, hkv, top_n = 3001, 32, 2, 16
    g = torch.Generator(device="cpu").manual_seed(7 * D + (transform == "ssa"))
    q, k, v = (torch.randn(1, h, N, D, generator=g).to(DEV, torch.bfloat16) for h in (hq, hkv, hkv))
    do = torch.randn(1, hq, N, D, generator=g).to(DEV, torch.bfloat16)
    cfg = NSAConfig(block_len=32, stride=16, select_block=PAPER.select_block, top_n=top_n, window=512)
    idx = select_blocks(torch.rand(1, hkv, N, -(-N // cfg.select_block), generator=g).to(DEV), cfg).int()
    idx[0, 1, 1700] = -1  # selects nothing
    ssa = dict(n=torch.tensor([1.5], device=DEV), b=torch.tensor([0.8], device=DEV)) if transform == "ssa" else {}
    causal = torch.ones(N, N, dtype=torch.bool, device=DEV).tril()
    keep = (selection_keep_mask(idx, N, cfg) & causal).repeat_interleave(hq // hkv, 1)
    if schedule == "atomic-dq":
        monkeypatch.setitem(A.TILE_OVERRIDE, "qmajor_dq", False)
    else:
        assert A.use_qmajor_dq(hq // hkv, D)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        return [o] + list(torch.autograd.grad(o, leaves, do.to(dtype)))

    ref = run(lambda a, b, c: masked_attention(a, b, c, keep, transform=transform, **ssa)[0], torch.float32)
    eager = run(lambda a, b, c: masked_attention(a, b, c, keep, transform=transform, upcast=False, **ssa)[0],
                torch.bfloat16)
    got = run(lambda a, b, c: A.selected_attention(a, b, c, idx, cfg.select_block, transform=transform, **ssa),
              torch.bfloat16)
    for name, x, e, r in zip(("o", "dq", "dk", "dv"), got, eager, ref):
        assert torch.isfinite(x).all(), name
        assert_within_2x_eager(x, e, r, f"{transform} D{D} {schedule} {name}", floor=1e-4)
    assert (got[1][0, 16:32, 1700] == 0).all()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("transform", ["softmax", "ssa"])
def test_selected_qmajor_tma_matches_pointers(monkeypatch, transform, D):
    """The query-major selected forward through tensor descriptors (the default on sm_90+
    up to D128) against its pointer kernel at GQA 16, N = 4099, bf16: the same ``o`` within
    bf16 rounding, the same ``lse``, the same empty rows (a query with no block, and the
    first block's queries that select only future-free slots); skipped without sm_90."""
    from nemo_ssa.ops.common.tma import tma_capable
    from nemo_ssa.ops.nsa import selected_attn as A

    if not tma_capable(torch.device(DEV)):
        pytest.skip("needs sm_90+ for tensor descriptors")
    N, hq, hkv, top_n = 4099, 32, 2, 16
    g = torch.Generator(device="cpu").manual_seed(D + (transform == "ssa"))
    q = torch.randn(1, hq, N, D, generator=g).to(DEV, torch.bfloat16)
    k, v = (torch.randn(1, hkv, N, D, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    ns = -(-N // PAPER.select_block)
    imp = torch.rand(1, hkv, N, ns, generator=g).to(DEV)
    idx = select_blocks(imp, NSAConfig(block_len=32, stride=16, select_block=PAPER.select_block, top_n=top_n,
                                       window=512)).int()
    idx[0, 1, 2000] = -1  # a query with no block at all
    ssa = dict(n=torch.tensor([1.5], device=DEV), b=torch.tensor([0.8], device=DEV)) if transform == "ssa" else {}
    launched = []
    real = A.descriptor
    monkeypatch.setattr(A, "descriptor", lambda *a: launched.append(a[1]) or real(*a))

    def run(tma):
        monkeypatch.setitem(A.TILE_OVERRIDE, "qmajor_tma", tma)
        return A.selected_attention(q, k, v, idx, PAPER.select_block, transform=transform, return_lse=True, **ssa)

    o_ptr, lse_ptr = run(0)
    assert not launched
    o_tma, lse_tma = run(1)
    assert len(launched) == 2  # k, v
    assert torch.isfinite(o_tma).all()
    assert rel_err(o_tma, o_ptr) < 1e-3, f"o: descriptors vs pointers {rel_err(o_tma, o_ptr):.2e}"
    assert torch.equal(torch.isinf(lse_tma), torch.isinf(lse_ptr))
    assert (o_tma[0, 16:32, 2000] == 0).all()
    fin = torch.isfinite(lse_ptr)
    assert (lse_tma[fin] - lse_ptr[fin]).abs().max().item() < 1e-4
