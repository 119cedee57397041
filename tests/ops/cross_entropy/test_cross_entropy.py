"""The LM cross-entropy (nemo_ssa.ops.cross_entropy) against fp64, and in the GPT model.

- ``lm_cross_entropy`` (compiled on CUDA, eager elsewhere) and the reference agree with
  an fp64 computation within 2x the eager fp32/bf16 error, loss and logits gradient, on
  odd sizes and with the per-token weights a loss mask gives.
- Installed in a tiny megatron GPT (TP 1): the same per-token loss and parameter
  gradients as megatron's own vocab-parallel loss; TP > 1 and ``false`` keep megatron's.
"""

import pytest
import torch

from nemo_ssa.ops.cross_entropy import lm_cross_entropy, lm_cross_entropy_naive
from nemo_ssa.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(s, b, V, dtype):
    logits = (torch.randn(s, b, V, dtype=torch.float64) * 3).to(DEV)
    labels = torch.randint(0, V, (b, s), device=DEV)
    w = (torch.rand(b, s, dtype=torch.float64, device=DEV) > 0.3).double()  # a loss mask
    return logits, labels, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,b,V", [(7, 3, 101), (33, 2, 1000)])
def test_loss_and_grad_within_2x_eager(s, b, V, dtype):
    logits64, labels, w = _case(s, b, V, dtype)
    ref_in = logits64.clone().requires_grad_()
    ref = lm_cross_entropy_naive(ref_in, labels)
    (gref,) = torch.autograd.grad((ref * w).sum(), ref_in)
    # eager same-dtype: the error scale the fused path must stay within 2x of
    x = logits64.to(dtype).requires_grad_()
    eager = torch.nn.functional.cross_entropy(x.float().reshape(-1, V), labels.t().reshape(-1),
                                              reduction="none").reshape(s, b).t()
    (geager,) = torch.autograd.grad((eager * w.float()).sum(), x)
    y = logits64.to(dtype).requires_grad_()
    got = lm_cross_entropy(y, labels)
    assert got.shape == (b, s) and got.dtype == torch.float32
    assert got.is_contiguous()  # NeMo's masked_token_loss calls .view(-1) on it
    (ggot,) = torch.autograd.grad((got * w.float()).sum(), y)
    floor = 1e-7
    assert rel_err(got, ref) <= 2 * rel_err(eager, ref) + floor
    assert rel_err(ggot, gref) <= 2 * rel_err(geager, gref) + floor
    # negative control: a wrong label is far off
    wrong = lm_cross_entropy(y.detach(), (labels + 1) % V)
    assert rel_err(wrong, ref) > 10 * (rel_err(eager, ref) + floor)


def test_bad_shapes_refused():
    with pytest.raises(ValueError, match=r"logits \[s, b, V\] and labels \[b, s\]"):
        lm_cross_entropy(torch.randn(4, 2, 9), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        lm_cross_entropy(torch.randn(4, 2, 9), torch.zeros(2, 4))


def _tiny_gpt(tmp_path):
    fdl = pytest.importorskip("fiddle")
    from recipes.nemotron_114m import pretrain_recipe

    from nemo_ssa.megatron.cpu import cpu_device_shims
    from nemo_ssa.train.cpu_recipe import shrink_for_cpu

    recipe = pretrain_recipe(dir=str(tmp_path), attention="softmax", max_steps=2)
    shrink_for_cpu(recipe)
    recipe.model.config.vocab_size = 97
    recipe.model.config.bf16 = False
    with cpu_device_shims():
        cfg = fdl.build(recipe.model.config)
        torch.manual_seed(3)
        model = cfg.configure_model(None)
    return model.float()


def _loss_and_grads(model, tokens, labels, mask, pass_mask=True):
    from nemo_ssa.megatron.cpu import cpu_device_shims

    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    kw = {"loss_mask": mask} if pass_mask else {}
    with cpu_device_shims():
        loss = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels, **kw)
    total = (loss * mask).sum() / mask.sum()
    grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), grads


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="builds the model on the CPU path (megatron_cpu); "
                              "the NeMo GPU run exercises the installed loss")


def _count_calls(monkeypatch):
    import nemo_ssa.ops.cross_entropy as ce

    calls = []
    real = ce.linear_cross_entropy

    def spy(*a, **k):
        calls.append(k.get("chunk_size"))
        return real(*a, **k)

    monkeypatch.setattr(ce, "linear_cross_entropy", spy)
    return calls


@CPU_ONLY
def test_installed_in_the_gpt_model_gives_megatrons_loss_and_grads(megatron_cpu, tmp_path, monkeypatch):
    from nemo_ssa.megatron.output_layer import ensure_installed, install_fused_cross_entropy, set_loss_mask

    monkeypatch.setenv("NEMO_SSA_CE_CHUNK", "5")  # 18 tokens: 4 chunks, the last one short
    calls = _count_calls(monkeypatch)
    model = _tiny_gpt(tmp_path)
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None  # tied
    tokens = torch.randint(0, 97, (2, 9))
    labels = torch.randint(0, 97, (2, 9))
    mask = (torch.rand(2, 9) > 0.2).float()
    mask[0, 0] = 0.0
    ref_loss, ref_grads = _loss_and_grads(model, tokens, labels, mask)
    with torch.no_grad():
        ref_logits = model(input_ids=tokens, position_ids=torch.arange(9)[None].expand(2, 9), attention_mask=None)
    assert install_fused_cross_entropy(model, "false") == 0
    assert install_fused_cross_entropy(model, "true") == 1
    assert "_fused_postprocess" in model._postprocess.__func__.__name__
    loss, grads = _loss_and_grads(model, tokens, labels, mask)
    assert calls == [5], "the fused output layer + loss did not run"
    assert loss.shape == (2, 9) and loss.dtype == torch.float32 and loss.is_contiguous()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert "embedding.word_embeddings.weight" in names
    for n, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=n)
    # negative control: the same check fails when the loss mask is not honoured (weight grads of
    # an unmasked sum)
    _, wrong = _loss_and_grads(model, tokens, labels, torch.ones_like(mask))
    emb = names.index("embedding.word_embeddings.weight")
    assert not torch.allclose(wrong[emb] * mask.numel() / mask.sum(), ref_grads[emb], rtol=1e-3, atol=1e-6)
    # the mask handed over by forward_step (NeMo's forward does not pass loss_mask)
    ensure_installed(model, "true")
    assert model._nemo_ssa_ce_checked and model._nemo_ssa_ce_models == (model,)
    set_loss_mask(model, mask)
    loss2, grads2 = _loss_and_grads(model, tokens, labels, mask, pass_mask=False)
    assert "_nemo_ssa_loss_mask" not in vars(model)  # consumed
    for g, r in zip(grads2, grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    # no mask at all under a masked reduction: refused loudly, not a wrong gradient
    with pytest.raises(RuntimeError, match="not c \\* row_weight"):
        _loss_and_grads(model, tokens, labels, mask, pass_mask=False)
    # inference (no labels) keeps megatron's logits path
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=torch.arange(9)[None].expand(2, 9), attention_mask=None)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="supported: auto, true, false"):
        install_fused_cross_entropy(model, "yes")


@CPU_ONLY
def test_profiler_ranges_keep_the_fused_loss_and_name_its_time(megatron_cpu, tmp_path, monkeypatch):
    """step_profile.module_ranges hooks the output layer to name its time; the fused loss never
    calls that layer's forward and used to fall back to megatron's whole-vocabulary fp32 loss
    on seeing any pre-hook -- so every profile measured another step than the one trained, and
    megatron's casts were read as layout copies. A range hook keeps the fused path and the
    fused loss's time lands on the output layer; any other pre-hook still keeps megatron's."""
    from torch.profiler import ProfilerActivity, profile

    from nemo_ssa.megatron.output_layer import install_fused_cross_entropy
    from nemo_ssa.tools import step_profile as sp

    calls = _count_calls(monkeypatch)
    model = _tiny_gpt(tmp_path)
    assert install_fused_cross_entropy(model, "true") == 1
    tokens, labels = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 9))
    mask = torch.ones(2, 9)
    ref_loss, _ = _loss_and_grads(model, tokens, labels, mask)
    assert len(calls) == 1
    with sp.module_ranges(model):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss, _ = _loss_and_grads(model, tokens, labels, mask)
    assert len(calls) == 2, "the range hook switched the fused loss off"
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    times = sp.by_module(prof.events(), device=False)
    assert times.get("output_layer fwd", 0) > 0, sorted(times)
    # the module's range is opened once per forward (no nesting of the same range)
    opened = [e for e in prof.events() if e.name == sp.MODULE_RANGE + "output_layer"]
    assert len(opened) == 1
    # negative control: a hook of another kind still keeps megatron's path
    handle = model.output_layer.register_forward_pre_hook(lambda mod, args: None)
    try:
        _loss_and_grads(model, tokens, labels, mask)
    finally:
        handle.remove()
    assert len(calls) == 2


@CPU_ONLY
def test_tensor_parallel_keeps_megatrons_loss_or_is_refused(megatron_cpu, tmp_path):
    from nemo_ssa.megatron.output_layer import check_fused_cross_entropy, install_fused_cross_entropy

    model = _tiny_gpt(tmp_path)
    model.config.tensor_model_parallel_size = 2
    assert install_fused_cross_entropy(model, "auto") == 0 or not torch.cuda.is_available()
    assert "compute_language_model_loss" not in vars(model) and "_postprocess" not in vars(model)
    with pytest.raises(ValueError, match="fused_cross_entropy=true needs tensor_parallel=1"):
        install_fused_cross_entropy(model, "true")
    with pytest.raises(ValueError, match="fused_cross_entropy=true needs tensor_parallel=1"):
        check_fused_cross_entropy("true", tensor_parallel=2)
    check_fused_cross_entropy("auto", tensor_parallel=2)
    check_fused_cross_entropy(False, tensor_parallel=2)


# ----------------------------------------------------------------------------- chunked linear + CE
from nemo_ssa.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_naive  # noqa: E402


def _linear_case(N, H, V, out_of_range=True):
    h = torch.randn(N, H, dtype=torch.float64, device=DEV)
    w = torch.randn(V, H, dtype=torch.float64, device=DEV) * (2.0 / H ** 0.5)
    labels = torch.randint(0, V, (N,), device=DEV)
    if out_of_range and N > 4:
        labels[1], labels[3] = -100, V + 5  # megatron: picks 0, the loss mask removes them
    mask = (torch.rand(N, dtype=torch.float64, device=DEV) > 0.3).double()
    if out_of_range and N > 4:
        mask[1] = mask[3] = 0.0
    return h, w, labels, mask


def _eager_same_dtype(h, w, labels, mask, c):
    """megatron's path in the test dtype: a GEMM in that dtype, fp32 loss on its logits."""
    logits = (h @ w.t()).float()
    V = logits.shape[-1]
    valid = (labels >= 0) & (labels < V)
    picked = logits.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    loss = torch.logsumexp(logits, -1) - torch.where(valid, picked, 0.0)
    return loss, torch.autograd.grad((loss * mask.float()).sum() * c, [h, w])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,H,V,chunk", [(37, 24, 101, 8), (130, 48, 509, 64), (9, 16, 33, 4096)],
                         ids=["N37-H24-V101-c8", "N130-H48-V509-c64", "N9-H16-V33-one-chunk"])
def test_linear_ce_loss_and_grads_within_2x_eager(N, H, V, chunk, dtype):
    h64, w64, labels, mask = _linear_case(N, H, V)
    c = 1.0 / float(mask.sum())  # NeMo: sum(loss * mask) / num_valid
    hr, wr = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref = linear_cross_entropy_naive(hr, wr, labels)
    gref = torch.autograd.grad((ref * mask).sum() * c, [hr, wr])
    he, we = h64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
    eager, geager = _eager_same_dtype(he, we, labels, mask, c)
    hx, wx = h64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
    got = linear_cross_entropy(hx, wx, labels, row_weight=mask.float(), chunk_size=chunk)
    assert got.shape == (N,) and got.dtype == torch.float32 and torch.isfinite(got).all()
    ggot = torch.autograd.grad((got * mask.float()).sum() * c, [hx, wx])
    floor = 1e-7
    for name, x, e, r in [("loss", got, eager, ref), ("dhidden", ggot[0], geager[0], gref[0]),
                          ("dweight", ggot[1], geager[1], gref[1])]:
        assert x.dtype == e.dtype, name
        assert rel_err(x, r) <= 2 * rel_err(e, r) + floor, (name, rel_err(x, r), rel_err(e, r))
    # negative control: the check above separates a wrong gradient (the weight grad of an
    # unmasked reduction) from a right one
    wrong = torch.autograd.grad(linear_cross_entropy(hx, wx, labels, chunk_size=chunk).sum() * c, wx)[0]
    assert rel_err(wrong, gref[1]) > 10 * (rel_err(geager[1], gref[1]) + floor)


def test_linear_ce_fp64_matches_reference_and_no_grad_path():
    h, w, labels, mask = _linear_case(41, 8, 57)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_cross_entropy_naive(hr, wr, labels)
    gref = torch.autograd.grad((ref * mask).sum() * 0.3, [hr, wr])
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = linear_cross_entropy(hx, wx, labels, row_weight=mask, chunk_size=10)
    ggot = torch.autograd.grad((got * mask).sum() * 0.3, [hx, wx])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(ggot, gref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # validation: loss only, the same values
        torch.testing.assert_close(linear_cross_entropy(hx, wx, labels, chunk_size=10), ref.detach())
    # a frozen weight: only the hidden gradient, no contract needed
    (gh,) = torch.autograd.grad((linear_cross_entropy(hx, w, labels, chunk_size=7) * mask).sum() * 0.3, [hx])
    torch.testing.assert_close(gh, gref[0], rtol=1e-12, atol=1e-12)


_VIOLATION = """
import torch
from nemo_ssa.ops.cross_entropy import linear_cross_entropy
h = torch.randn(20, 8, dtype=torch.float64, device="cuda", requires_grad=True)
w = torch.randn(31, 8, dtype=torch.float64, device="cuda", requires_grad=True)
labels = torch.randint(0, 31, (20,), device="cuda")
mask = torch.ones(20, dtype=torch.float64, device="cuda"); mask[0] = 0.0
loss = linear_cross_entropy(h, w, labels, row_weight=None, chunk_size=6)
torch.autograd.grad((loss * mask).sum(), [h, w])
torch.cuda.synchronize()
print("NO ASSERT")
"""


def test_linear_ce_contract_violation_fails_loudly():
    if DEV == "cuda":
        # a device-side assert poisons the CUDA context of the process: run it in its own
        import os
        import subprocess
        import sys

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", _VIOLATION], capture_output=True, text=True, timeout=300,
                              env=env)
        assert proc.returncode != 0 and "NO ASSERT" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert "not c * row_weight" in proc.stderr, proc.stderr[-2000:]
        return
    h, w, labels, mask = _linear_case(20, 8, 31, out_of_range=False)
    mask[0] = 0.0
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hx, wx, labels, row_weight=None, chunk_size=6)  # weights: all ones
    with pytest.raises(RuntimeError, match="not c \\* row_weight"):
        torch.autograd.grad((loss * mask).sum(), [hx, wx])
    # a plain mean with no row_weight is within the contract
    loss = linear_cross_entropy(hx, wx, labels, chunk_size=6)
    torch.autograd.grad(loss.mean(), [hx, wx])


def test_linear_ce_bad_inputs_refused():
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    lab = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden \[N, H\] and weight \[V, H\]"):
        linear_cross_entropy(h, torch.randn(11, 7), lab)
    with pytest.raises(ValueError, match="one float dtype"):
        linear_cross_entropy(h, w.double(), lab)
    with pytest.raises(ValueError, match="integer"):
        linear_cross_entropy(h, w, lab.float())
    with pytest.raises(ValueError, match=r"labels \[N=4\]"):
        linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="row_weight"):
        linear_cross_entropy(h, w, lab, row_weight=torch.ones(3))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, lab, chunk_size=0)
