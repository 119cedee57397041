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
    from nemo_ssa.nemo.cpu_loop import shrink_for_cpu

    recipe = pretrain_recipe(dir=str(tmp_path), attention="softmax", max_steps=2)
    shrink_for_cpu(recipe)
    recipe.model.config.vocab_size = 97
    recipe.model.config.bf16 = False
    with cpu_device_shims():
        cfg = fdl.build(recipe.model.config)
        torch.manual_seed(3)
        model = cfg.configure_model(None)
    return model.float()


def _loss_and_grads(model, tokens, labels, mask):
    from nemo_ssa.megatron.cpu import cpu_device_shims

    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with cpu_device_shims():
        loss = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels)
    total = (loss * mask).sum() / mask.sum()
    grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), grads


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="builds the model on the CPU path (megatron_cpu); "
                              "the NeMo GPU run exercises the installed loss")


@CPU_ONLY
def test_installed_in_the_gpt_model_gives_megatrons_loss_and_grads(megatron_cpu, tmp_path):
    from nemo_ssa.megatron.output_layer import ensure_installed, install_fused_cross_entropy

    model = _tiny_gpt(tmp_path)
    tokens = torch.randint(0, 97, (2, 9))
    labels = torch.randint(0, 97, (2, 9))
    mask = (torch.rand(2, 9) > 0.2).float()
    ref_loss, ref_grads = _loss_and_grads(model, tokens, labels, mask)
    assert install_fused_cross_entropy(model, "false") == 0
    assert install_fused_cross_entropy(model, "true") == 1
    assert "_fused_loss" in model.compute_language_model_loss.__func__.__name__
    loss, grads = _loss_and_grads(model, tokens, labels, mask)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    # once per model object; a bad value is refused with the supported set
    ensure_installed(model, "true")
    assert model._nemo_ssa_ce_checked
    with pytest.raises(ValueError, match="supported: auto, true, false"):
        install_fused_cross_entropy(model, "yes")


@CPU_ONLY
def test_tensor_parallel_keeps_megatrons_loss(megatron_cpu, tmp_path):
    from nemo_ssa.megatron.output_layer import install_fused_cross_entropy

    model = _tiny_gpt(tmp_path)
    model.config.tensor_model_parallel_size = 2
    assert install_fused_cross_entropy(model, "true") == 0
    assert "compute_language_model_loss" not in vars(model)
