"""benchmarks/bench_model.py's step mode builds the optimizer as the recipe's optimizer module
(nemo_ssa.nemo.optim) does: with fast paths, megatron's no-apex clipping fallbacks are replaced
and AdamW is built fused; without, megatron's own. A step timed without them is not the step
NeMo trains (megatron's fallback clipping reads every parameter's norm to the host)."""

import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.fixture
def fake_optimizer(monkeypatch):
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.clip_grads as clip
    import megatron.core.optimizer.optimizer as moptimizer
    import megatron.core.utils as mutils

    # megatron without apex/TE, whatever an earlier test installed; install() rebinds these
    # module globals process-wide, and monkeypatch puts them back after the test
    monkeypatch.setattr(clip, "l2_norm_impl", mutils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)
    monkeypatch.setattr(moptimizer, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)
    # and the slots nemo_ssa.megatron.sync_free binds
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from nemo_ssa.megatron import sync_free

    monkeypatch.setattr(moptimizer, "get_grad_norm_fp32", clip.get_grad_norm_fp32)
    monkeypatch.setattr(moptimizer, "clip_grad_by_total_norm_fp32", clip.clip_grad_by_total_norm_fp32)
    monkeypatch.setattr(pgb._ParamAndGradBucketGroup, "check_grads",
                        sync_free._ORIGINAL.get("check_grads", pgb._ParamAndGradBucketGroup.check_grads))
    monkeypatch.setattr(sync_free, "_ORIGINAL", {})
    seen = {}

    def get_megatron_optimizer(cfg, chunks, no_weight_decay_cond=None):
        seen.update(adamw=torch.optim.AdamW, l2=clip.l2_norm_impl, chunks=chunks, cond=no_weight_decay_cond,
                norm=moptimizer.get_grad_norm_fp32)
        return "opt"

    monkeypatch.setattr(mopt, "get_megatron_optimizer", get_megatron_optimizer)
    return seen


def test_step_optimizer_takes_the_recipes_fast_paths(fake_optimizer):
    from benchmarks.bench_model import make_optimizer
    from nemo_ssa.megatron import fast_paths, sync_free

    ddp = object()
    assert make_optimizer(None, ddp, fast_paths=True) == "opt"
    assert fake_optimizer["adamw"] is fast_paths._FusedAdamW
    assert fake_optimizer["l2"] is fast_paths.l2_norm
    assert fake_optimizer["norm"] is sync_free.grad_norm_fp32  # the recipe's module installs it too
    assert fake_optimizer["chunks"] == [ddp] and fake_optimizer["cond"] is not None
    assert torch.optim.AdamW is not fast_paths._FusedAdamW  # only while the optimizer is built


def test_step_optimizer_without_fast_paths_is_megatrons(fake_optimizer):
    import megatron.core.utils as mutils

    from benchmarks.bench_model import make_optimizer
    from nemo_ssa.megatron import fast_paths

    import megatron.core.optimizer.clip_grads as clip

    make_optimizer(None, object(), fast_paths=False)
    assert fake_optimizer["adamw"] is not fast_paths._FusedAdamW
    assert fake_optimizer["l2"] is mutils.local_multi_tensor_l2_norm
    assert fake_optimizer["norm"] is clip.get_grad_norm_fp32


@pytest.mark.parametrize("argv, says", [
    (["--cuda-graph", "nope"], "supported: none, local"),
    (["--cuda-graph", "none,local", "--micro-batches", "8,32"], "one micro batch"),
    (["--cuda-graph", "local", "--micro-batches", "8,max"], "one micro batch"),
    (["--cuda-graph", "local", "--micro-batches", "8", "--profile", "p.txt"], "--profile"),
])
def test_cuda_graph_requests_it_cannot_time_are_refused_before_anything_runs(argv, says, capsys):
    """Local CUDA graphs are captured for one input shape per model: more micro batches, the
    probe or the profiles in one process would replay or re-capture the wrong graph."""
    from benchmarks.bench_model import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_after_fwd_bwd_captures_only_with_local_graphs(monkeypatch):
    """The step calls megatron's create_cudagraphs after each fwd+bwd only where the model
    was built with cuda_graph_impl='local' (the schedule's rule)."""
    import types

    import megatron.core.transformer.cuda_graphs as cg
    from benchmarks.bench_model import _after_fwd_bwd

    calls = []
    monkeypatch.setattr(cg, "create_cudagraphs", lambda: calls.append(1))
    _after_fwd_bwd(types.SimpleNamespace(config=types.SimpleNamespace(cuda_graph_impl="none")))
    assert calls == []
    _after_fwd_bwd(types.SimpleNamespace(config=types.SimpleNamespace(cuda_graph_impl="local")))
    assert calls == [1]
