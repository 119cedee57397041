"""nemo_ssa.megatron.sync_free: megatron's clipping and gradient NaN check without host reads.

CPU: the stand-ins give megatron's numbers bit for bit, the guard skips a bad step on the
device and raises megatron's error after it, and it stays off where it cannot stand in. The
GPU test at the end runs megatron's real DDP + optimizer with the host-sync detector on."""

import math
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_ssa.megatron import fast_paths, sync_free  # noqa: E402


@pytest.fixture
def installed(monkeypatch):
    """megatron's own functions bound (whatever an earlier test installed; monkeypatch puts
    the module globals back after the test), then the stand-ins installed over them."""
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.optimizer.optimizer as mo
    from megatron.core.distributed import param_and_grad_buffer as pgb

    cls = pgb._ParamAndGradBucketGroup
    monkeypatch.setattr(mo, "get_grad_norm_fp32", cg.get_grad_norm_fp32)
    monkeypatch.setattr(mo, "clip_grad_by_total_norm_fp32", cg.clip_grad_by_total_norm_fp32)
    monkeypatch.setattr(cls, "check_grads", sync_free._ORIGINAL.get("check_grads", cls.check_grads))
    # megatron's no-apex norm moves its result to "cuda"; the plugin's stand-in stays on the device
    monkeypatch.setattr(cg, "l2_norm_impl", fast_paths.l2_norm)
    monkeypatch.setattr(sync_free, "_ORIGINAL", {})
    sync_free.GUARD.reset()
    done = sync_free.install()
    yield types.SimpleNamespace(mo=mo, cls=cls, done=done)
    sync_free.GUARD.reset()


def _grads(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in [(7, 5), (3,), (11, 2, 3), (1,), (64,)]]


def test_install_binds_the_stand_ins_where_megatrons_are(installed):
    mo, cls = installed.mo, installed.cls
    assert mo.get_grad_norm_fp32 is sync_free.grad_norm_fp32
    assert mo.clip_grad_by_total_norm_fp32 is sync_free.clip_grad_by_total_norm
    assert cls.check_grads is sync_free.check_grads and len(installed.done) == 3
    assert len(sync_free.install()) == 3 and sync_free._ORIGINAL["check_grads"] is not sync_free.check_grads


def test_install_leaves_a_megatron_it_does_not_know(installed, monkeypatch):
    sync_free.uninstall()
    monkeypatch.setattr(installed.mo, "get_grad_norm_fp32", lambda grads, kind=2: 0.0)  # other names
    assert sync_free.install() == []
    assert installed.cls.check_grads is not sync_free.check_grads  # all or nothing


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4])
def test_norm_is_megatrons_double_on_the_device(installed, scale):
    grads = _grads(scale=scale)
    got = sync_free.grad_norm_fp32(grads)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64 and got.shape == ()
    # megatron: the multi-tensor norm, squared in fp32, read to the host, ** 0.5 in Python
    want = float(fast_paths.l2_norm(0, None, [grads], False)[0] ** 2) ** 0.5
    assert math.isclose(float(got), want, rel_tol=2 ** -52, abs_tol=0), (float(got), want)
    flat = torch.cat([t.flatten() for t in grads]).double()
    assert math.isclose(float(got), float(flat.norm()), rel_tol=1e-6)  # and it is the norm


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_norm_carries_a_bad_gradient(installed, bad):
    grads = _grads()
    grads[2][3, 1, 0] = bad
    got = float(sync_free.grad_norm_fp32(grads))
    assert (math.isnan(got) and math.isnan(bad)) or got == bad


def test_other_norms_and_float_norms_are_megatrons(installed, monkeypatch):
    calls = []
    monkeypatch.setitem(sync_free._ORIGINAL, "get_grad_norm_fp32", lambda *a: calls.append(("norm", a[1])) or 3.0)
    monkeypatch.setitem(sync_free._ORIGINAL, "clip_grad_by_total_norm_fp32", lambda *a: calls.append(("clip", a[2])))
    assert sync_free.grad_norm_fp32(_grads(), float("inf")) == 3.0
    sync_free.clip_grad_by_total_norm([], 1.0, 2.5)
    assert calls == [("norm", float("inf")), ("clip", 2.5)]


def _params(grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


@pytest.mark.parametrize("norm", [0.25, 0.999999, 1.0, 7.3, float("nan"), float("inf")])
def test_clip_is_megatrons_bit_for_bit(installed, norm):
    grads = _grads(seed=3)
    params = _params(grads)
    sync_free.clip_grad_by_total_norm(params, 1.0, torch.tensor(norm, dtype=torch.float64))
    # megatron: clip_coeff = max_norm / (total_norm + 1e-6) in Python; scale only where < 1.0
    want = [g.clone() for g in grads]
    coeff = 1.0 / (norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(want, coeff)
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w), norm


def test_clip_refuses_half_gradients(installed):
    params = _params([g.bfloat16() for g in _grads()])
    with pytest.raises(TypeError, match="fp32 main gradients"):
        sync_free.clip_grad_by_total_norm(params, 1.0, torch.tensor(2.0, dtype=torch.float64))


class _Leaf:
    """megatron's MixedPrecisionOptimizer.step in short: norm, clip, the torch step."""

    def __init__(self, params, fused=True, clip_grad=1.0):
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=0.1, fused=fused)
        self.config = types.SimpleNamespace(clip_grad=clip_grad)

    def step(self):
        import megatron.core.optimizer.optimizer as mo

        norm = mo.get_grad_norm_fp32([p.grad for p in self.params])
        mo.clip_grad_by_total_norm_fp32(self.params, self.config.clip_grad, norm)
        self.optimizer.step()
        return True, norm, None


def _bucket_group(params):
    return types.SimpleNamespace(buckets=[types.SimpleNamespace(grad_data=torch.cat([p.grad.flatten() for p in params]))])


def _run(leaf, installed, grads_per_step, checked=True):
    for i, grads in enumerate(grads_per_step):
        for p, g in zip(leaf.params, grads):
            p.grad = g.clone()
        if checked:  # megatron's DDP: finish_grad_sync -> check_grads(check_for_nan_in_grad, check_for_large)
            installed.cls.check_grads(_bucket_group(leaf.params), True, False)
        leaf.step()


def test_guard_leaves_good_steps_as_megatron_makes_them(installed):
    steps = [_grads(seed=s, scale=0.3 * (s + 1)) for s in range(4)]
    ref = _Leaf(_params(steps[0]))
    sync_free.uninstall()  # megatron's path: the norm as a float, its clip
    import megatron.core.optimizer.clip_grads as cg

    for grads in steps:
        for p, g in zip(ref.params, grads):
            p.grad = g.clone()
        norm = float(fast_paths.l2_norm(0, None, [[p.grad for p in ref.params]], False)[0] ** 2) ** 0.5
        coeff = 1.0 / (norm + 1e-6)
        if coeff < 1.0:
            torch._foreach_mul_([p.grad for p in ref.params], coeff)
        ref.optimizer.step()
    assert cg  # megatron's module is what the reference stands for
    sync_free.install()
    leaf = _Leaf(_params(steps[0]))
    assert sync_free.activate(leaf) is None and sync_free.GUARD.active
    _run(leaf, installed, steps)
    sync_free.GUARD.check(wait=True)
    for a, b in zip(leaf.params, ref.params):
        assert torch.equal(a.detach(), b.detach())
    # the last step's norm (before clipping) is kept as the device tensor megatron returned, for
    # MetricsCallback's grad_norm column
    last = torch.cat([g.flatten() for g in steps[-1]]).double().norm()
    assert isinstance(sync_free.GUARD.grad_norm, torch.Tensor)
    torch.testing.assert_close(sync_free.GUARD.grad_norm.double(), last, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad, says", [(float("nan"), "found NaN in local grad norm for bucket #0"),
                                       (float("inf"), "found Inf in local grad norm for bucket #0")])
def test_guard_skips_the_bad_step_and_raises_at_the_next(installed, bad, says):
    leaf = _Leaf(_params(_grads()))
    assert sync_free.activate(leaf) is None
    sync_free.GUARD.iteration = 40
    _run(leaf, installed, [_grads(seed=1)])
    before = [p.detach().clone() for p in leaf.params]
    state_step = float(leaf.optimizer.state[leaf.params[0]]["step"])
    grads = _grads(seed=2)
    grads[4][9] = bad
    _run(leaf, installed, [grads])  # iteration 41: skipped on the device, nothing read yet
    for p, b in zip(leaf.params, before):
        assert torch.equal(p.detach(), b)
    assert float(leaf.optimizer.state[leaf.params[0]]["step"]) == state_step  # Adam's count too
    assert float(sync_free.GUARD.flag) == 0.0  # cleared for the next step
    with pytest.raises(RuntimeError, match=rf"iteration 41: Unexpected result .*{says}.*skipped"):
        _run(leaf, installed, [_grads(seed=3)])


def test_a_checkpoint_waits_for_the_checks_in_flight(installed):
    leaf = _Leaf(_params(_grads()))
    sync_free.activate(leaf)
    grads = _grads()
    grads[0][0, 0] = float("nan")
    _run(leaf, installed, [grads])
    with pytest.raises(RuntimeError, match="iteration 0: .*found NaN"):
        sync_free.GUARD.check(wait=True)
    sync_free.GUARD.check(wait=True)  # read once: a later check does not raise it again


def test_the_total_norm_carries_a_bad_step_to_every_rank(installed):
    """A rank whose own buckets are clean still skips when the reduced norm is not finite (the
    NaN of another rank arrives through the all-reduce)."""
    leaf = _Leaf(_params(_grads()))
    sync_free.activate(leaf)
    installed.cls.check_grads(_bucket_group(leaf.params), True, False)  # this rank's buckets: clean
    before = [p.detach().clone() for p in leaf.params]
    leaf.params[1].grad[0] = float("nan")  # as after the reduction
    leaf.step()
    sync_free.GUARD.end_step()
    for p, b in zip(leaf.params, before):
        assert torch.equal(p.detach(), b)
    with pytest.raises(RuntimeError, match="total gradient norm"):
        sync_free.GUARD.check(wait=True)


def test_checks_captured_in_a_graph_are_read_on_every_replay(installed, monkeypatch):
    """model.cuda_graphs=full: megatron's bucket checks run inside the whole-iteration graph, so
    after the capture a step runs none of the Python that records them -- the replay rewrites
    the captured code tensors and the flag. Simulated: step 0 eager, step 1 recorded under a
    "capture", steps 2-3 replays (the captured kernels redone in place); a NaN at step 2 is
    skipped, raised at step 3 with the bucket's message, and the flag is cleared after each."""
    leaf = _Leaf(_params(_grads()))
    assert sync_free.activate(leaf) is None
    guard = sync_free.GUARD
    _run(leaf, installed, [_grads(seed=1)])  # step 0: eager, nothing captured
    assert guard._captured_codes == []
    # step 1: the bucket checks recorded under the capture (finish_grad_sync is inside the graph),
    # the optimizer step after it eager, as FullCudaGraphWrapper runs it
    for p, g in zip(leaf.params, _grads(seed=2)):
        p.grad = g.clone()
    monkeypatch.setattr(sync_free, "_capturing", lambda t: True)
    installed.cls.check_grads(_bucket_group(leaf.params), True, False)
    monkeypatch.setattr(sync_free, "_capturing", lambda t: False)
    leaf.step()
    (codes,) = guard._captured_codes
    assert len(guard._captured_labels) == 1 and "bucket #0" in guard._captured_labels[0]
    guard.check(wait=True)  # steps 0-1 clean

    def replay(grads):  # what the graph redoes: the bucket norm's code into the captured tensor
        for p, g in zip(leaf.params, grads):
            p.grad = g.clone()
        norm = _bucket_group(leaf.params).buckets[0].grad_data.norm(p=2).reshape(1)
        new = torch.isnan(norm).to(torch.int8) * sync_free._NAN + torch.isinf(norm).to(torch.int8) * sync_free._INF
        codes.copy_(new)
        torch.maximum(guard.flag, (codes > 0).any().to(guard.flag.dtype), out=guard.flag)
        leaf.step()

    before = [p.detach().clone() for p in leaf.params]
    bad = _grads(seed=3)
    bad[2][1] = float("nan")
    replay(bad)  # step 2: a NaN, recorded by the replay alone
    for p, b in zip(leaf.params, before):
        assert torch.equal(p.detach(), b)  # skipped on the device
    assert float(guard.flag) == 0.0
    with pytest.raises(RuntimeError, match="iteration 2: Unexpected result nan .*bucket #0"):
        replay(_grads(seed=4))  # step 3 reads step 2's checks first
    replay(_grads(seed=5))
    guard.check(wait=True)  # clean again: the same captured tensors, read every step


@pytest.mark.parametrize("leaf_kw, why", [(dict(fused=False), "fused"), (dict(clip_grad=0.0), "clip_grad is 0")])
def test_guard_stays_off_where_it_cannot_skip_and_megatron_checks(installed, monkeypatch, leaf_kw, why):
    leaf = _Leaf(_params(_grads()), **leaf_kw)
    assert why in sync_free.activate(leaf) and not sync_free.GUARD.active
    calls = []
    monkeypatch.setitem(sync_free._ORIGINAL, "check_grads", lambda self, a, b: calls.append((a, b)))
    installed.cls.check_grads(_bucket_group(leaf.params), True, False)
    assert calls == [(True, False)]


def test_megatrons_check_where_it_asks_for_more(installed, monkeypatch):
    leaf = _Leaf(_params(_grads()))
    sync_free.activate(leaf)
    calls = []
    monkeypatch.setitem(sync_free._ORIGINAL, "check_grads", lambda self, a, b: calls.append((a, b)))
    installed.cls.check_grads(_bucket_group(leaf.params), True, True)  # check_for_large_grads
    monkeypatch.setattr(sync_free, "_rerun_disabled", lambda: False)  # a rerun mode re-runs from the value
    installed.cls.check_grads(_bucket_group(leaf.params), True, False)
    assert calls == [(True, True), (True, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatrons_step_reads_nothing_and_a_nan_is_caught_on_cuda():
    """The recipe's model (2 layers) under megatron's DDP with check_for_nan_in_grad (as NeMo's
    recipe) and the optimizer built as the optimizer module builds it: (1) gradient sync and
    optimizer step run with torch's sync detector set to error; (2) the clipped gradients and
    the returned norm are megatron's (its own norm function on the same gradients, its clip
    rule), bit for bit; (3) a NaN in one gradient: the step is skipped, the next one raises."""
    import megatron.core.optimizer.clip_grads as cg

    from benchmarks import bench_model as bm

    bm.init_megatron(1234)
    cfg, model = bm.build("softmax", 128, overrides={"num_layers": 2})
    bm.wrap_for_step(cfg, model, fast_paths=True, sync_free=True)
    ddp, opt = model._bench_step_state
    assert sync_free.GUARD.active
    tokens, pos, labels, mask = bm.batch(2, 128)
    params = [p for p in model.parameters() if p.requires_grad]

    def strict(fn):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def fwd_bwd(nan=False):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        bm.loss_fn(ddp(tokens, pos, None, labels=labels, loss_mask=mask), mask).backward()
        if nan:
            params[0].main_grad.view(-1)[3] = float("nan")

    for _ in range(3):
        fwd_bwd()
        strict(ddp.finish_grad_sync)
        # megatron's reference on the same gradients: its norm (the float it returns) and clip rule
        # (in the optimizer's order: the norm of the norms is an fp32 sum, its order counts)
        for leaf in getattr(opt, "chained_optimizers", [opt]):
            leaf.prepare_grads()  # main_param.grad = main_grad, as the step does first
        for_norm = [g for leaf in getattr(opt, "chained_optimizers", [opt]) for g in leaf.get_main_grads_for_grad_norm()]
        ref_norm = cg.get_grad_norm_fp32(for_norm)
        # the fp32 gradients the optimizer clips and steps on (its main parameters'), clipped by megatron's rule
        leaves = getattr(opt, "chained_optimizers", [opt])
        want = [q.grad.clone() for leaf in leaves for q in leaf.get_parameters() if q.grad is not None]
        coeff = 1.0 / (ref_norm + 1.0e-6)
        if coeff < 1.0:
            torch._foreach_mul_(want, coeff)
        _, grad_norm, _ = strict(opt.step)
        assert isinstance(grad_norm, torch.Tensor) and grad_norm.is_cuda
        assert sync_free.GUARD.grad_norm is grad_norm  # kept for MetricsCallback's grad_norm column
        assert math.isclose(float(grad_norm), ref_norm, rel_tol=2 ** -52), (float(grad_norm), ref_norm)
        got = [q.grad for leaf in leaves for q in leaf.get_parameters() if q.grad is not None]
        assert len(got) == len(want) and all(g.dtype == torch.float32 for g in got)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    sync_free.GUARD.check(wait=True)
    before = [p.detach().clone() for p in params]
    fwd_bwd(nan=True)
    strict(ddp.finish_grad_sync)
    strict(opt.step)
    torch.cuda.synchronize()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    fwd_bwd()
    ddp.finish_grad_sync()
    with pytest.raises(RuntimeError, match="found NaN in local grad norm for bucket"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_nan_inside_a_captured_iteration_is_caught_on_replay_on_cuda():
    """model.cuda_graphs=full in small: megatron's gradient finalisation (the bucket checks)
    captured in one CUDA graph with the forward and backward, as FullCudaGraphWrapper captures
    them, the optimizer step outside. Replays run none of the guard's Python: a NaN that only a
    replay produces (a captured add of a poison value) is skipped on the device and raised at the
    next step with megatron's bucket message; a clean replay before and after steps as usual."""
    from benchmarks import bench_model as bm

    bm.init_megatron(1234)
    cfg, model = bm.build("softmax_triton", 128, overrides={"num_layers": 2})
    # DDP built on a side stream, as NeMo's MegatronParallel builds it for the full-iteration
    # graph: DDP keeps each parameter's AccumulateGrad node, which remembers the stream it was
    # made on; made on the legacy default stream, the captured backward makes that stream wait
    # on the capture ("operation would make the legacy stream depend on a capturing blocking
    # stream", H200 2026-12-02)
    with torch.cuda.stream(torch.cuda.Stream()):
        bm.wrap_for_step(cfg, model, fast_paths=True, sync_free=True)
    torch.cuda.synchronize()
    ddp, opt = model._bench_step_state
    guard = sync_free.GUARD
    assert guard.active
    tokens, pos, labels, mask = bm.batch(2, 128)
    params = [p for p in model.parameters() if p.requires_grad]
    poison = torch.zeros((), device="cuda")

    def body():  # what the whole-iteration graph holds: fwd, bwd, the gradient finalisation
        bm.loss_fn(ddp(tokens, pos, None, labels=labels, loss_mask=mask), mask).backward()
        params[0].main_grad.view(-1)[3].add_(poison)
        ddp.finish_grad_sync()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up steps, as the wrapper runs one before capturing
        for _ in range(2):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            body()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    guard.check(wait=True)
    graph = torch.cuda.CUDAGraph()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    torch.cuda.synchronize()  # the capture stream does not wait on the default one (the wrapper syncs too)
    try:
        # as FullCudaGraphWrapper captures: its own stream and thread-local capture errors
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
            body()
        _replays_catch_the_poison(graph, ddp, opt, params, poison, guard)
    finally:  # the captured checks belong to this graph: a later test in this process starts clean
        guard._captured_codes.clear()
        guard._captured_labels.clear()


def _replays_catch_the_poison(graph, ddp, opt, params, poison, guard):
    assert guard._captured_codes, "the bucket checks were not recorded under the capture"

    def step():
        ddp.zero_grad_buffer()
        graph.replay()
        opt.step()

    graph.replay()  # the capture's own step, as the wrapper replays right after capturing
    opt.step()
    before = [p.detach().clone() for p in params]
    step()  # clean replay: the update lands
    torch.cuda.synchronize()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    guard.check(wait=True)
    poison.fill_(float("nan"))
    before = [p.detach().clone() for p in params]
    step()  # the NaN exists only in this replay
    torch.cuda.synchronize()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    poison.zero_()
    with pytest.raises(RuntimeError, match="found NaN in local grad norm for bucket"):
        step()
    step()
    guard.check(wait=True)  # clean again from the same captured tensors
