"""ops/common/launch.py: the one interpreter check, the cached launch, host integer helpers.

The cache's hit path needs a compiled CUDA kernel; on CPU it is exercised with a stand-in
kernel (``_FakeKernel``) whose normal path records calls, with the interpreter flag and the
stream patched. A real kernel under the interpreter checks that ``launch`` computes what a
direct ``kernel[grid](...)`` call does.
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nemo_ssa.ops.common import launch as launcher  # noqa: E402
from nemo_ssa.ops.common.launch import cdiv, is_interpreter, launch, next_pow2  # noqa: E402

DEVICE = "cpu" if is_interpreter() else "cuda"


def _env_says_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_is_interpreter_agrees_with_triton_interpret():
    assert is_interpreter() == _env_says_interpret()


@pytest.mark.parametrize("value,want", [("1", True), ("0", False)])
def test_is_interpreter_follows_the_env_var_at_import(value, want):
    env = dict(os.environ, TRITON_INTERPRET=value)
    code = "from nemo_ssa.ops.common.launch import is_interpreter; print(is_interpreter())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(want)


def test_no_other_interpreter_check_in_ops():
    """One copy: nothing else under nemo_ssa/ops reads TRITON_INTERPRET or inspects a
    kernel's class to find out (ops/attention/flex.py's check of its optional kernel excepted)."""
    ops = os.path.join(os.path.dirname(launcher.__file__), os.pardir)
    found = []
    for root, _, files in os.walk(os.path.normpath(ops)):
        for f in files:
            path = os.path.join(root, f)
            if not f.endswith(".py") or path == launcher.__file__ or f == "flex.py":
                continue
            src = open(path).read()
            if 'environ.get("TRITON_INTERPRET"' in src or "InterpretedFunction" in src:
                found.append(path)
    assert found == []


@pytest.mark.parametrize("a,b", [(0, 16), (1, 16), (16, 16), (17, 16), (1000, 64), (2 ** 40 + 1, 128)])
def test_cdiv_matches_triton(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


@pytest.mark.parametrize("x", [1, 2, 3, 16, 17, 48, 64, 255, 256, 257])
def test_next_pow2_matches_triton(x):
    assert next_pow2(x) == triton.next_power_of_2(x)


@triton.jit
def _axpb_kernel(X, Y, n, a, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    y = x * a
    if ADD_ONE:
        y = y + 1.0
    tl.store(Y + offs, y, mask=offs < n)


@pytest.mark.skipif(not (is_interpreter() or torch.cuda.is_available()), reason="needs the interpreter or CUDA")
@pytest.mark.parametrize("add_one", [False, True])
def test_launch_equals_direct_kernel_call(add_one):
    x = torch.randn(100, device=DEVICE)
    direct, via = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    grid = (cdiv(x.numel(), 32),)
    _axpb_kernel[grid](x, direct, x.numel(), 2.5, BLOCK=32, ADD_ONE=add_one)
    for _ in range(2):  # the second call takes the cache's hit path on the GPU
        via.fill_(float("nan"))
        launch(_axpb_kernel, grid, (x, via, x.numel(), 2.5), dict(BLOCK=32, ADD_ONE=add_one), 2)
        assert torch.equal(via, direct)
    assert torch.equal(direct, x * 2.5 + (1.0 if add_one else 0.0))


# ---- cached launch: CPU tests use a stand-in kernel -------------------------------------


def test_launch_key_separates_every_specialization():
    base = torch.empty(64, dtype=torch.float32)
    k0 = launcher.launch_key("kern", 0, (base, 16, 1.5, None), {"BLOCK_M": 64, "num_warps": 4})
    same = launcher.launch_key("kern", 0, (torch.empty(64, dtype=torch.float32), 16, 2.5, None),
                               {"num_warps": 4, "BLOCK_M": 64})
    if base.data_ptr() % 16 == torch.empty(64).data_ptr() % 16:
        assert k0 == same  # floats by type, dict order irrelevant
    variants = [
        ("kern", 1, (base, 16, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),          # device
        ("other", 0, (base, 16, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),         # kernel
        ("kern", 0, (base.half(), 16, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),   # dtype
        ("kern", 0, (base[1:], 16, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),      # alignment
        ("kern", 0, (base, 17, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),          # int %16
        ("kern", 0, (base, 1, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),           # int == 1
        ("kern", 0, (base, 2 ** 40, 1.5, None), {"BLOCK_M": 64, "num_warps": 4}),     # int64
        ("kern", 0, (base, 16, 1.5, base), {"BLOCK_M": 64, "num_warps": 4}),          # None vs ptr
        ("kern", 0, (base, 16, 1.5, None), {"BLOCK_M": 32, "num_warps": 4}),          # constexpr
        ("kern", 0, (base, 16, 1.5, None), {"BLOCK_M": 64, "num_warps": 8}),          # option
    ]
    keys = {launcher.launch_key(*v) for v in variants}
    assert len(keys) == len(variants) and k0 not in keys
    with pytest.raises(TypeError, match="unsupported"):
        launcher.launch_key("kern", 0, ("str",), {})


class _Param:
    def __init__(self, name, default):
        self.name, self.default = name, default


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"  # handles loaded (a real launch happened)

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class _FakeKernel:
    """JITFunction stand-in: params (X, n, BLOCK, FLAG=True); records normal-path calls."""

    def __init__(self):
        import inspect
        self.params = [_Param("X", inspect.Parameter.empty), _Param("n", inspect.Parameter.empty),
                       _Param("BLOCK", inspect.Parameter.empty), _Param("FLAG", True)]
        self.arg_names = [p.name for p in self.params]
        self.slow = []

    def __getitem__(self, grid):
        def call(*args, **meta):
            self.slow.append((grid, args, meta))
            return _FakeCompiled()
        return call


def test_cached_launch_reuses_compiled_kernel_with_all_args(monkeypatch):
    monkeypatch.setattr(launcher, "_INTERPRETED", False)
    monkeypatch.setattr(launcher, "_LAUNCH_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda dev: 1234)
    kern = _FakeKernel()
    x = torch.empty(32)
    c1 = launcher.launch(kern, (3, 2), (x, 16), {"BLOCK": 64, "num_warps": 4})
    assert len(kern.slow) == 1 and c1.runs == []              # miss: normal path compiles+launches
    c2 = launcher.launch(kern, (5, 7), (x, 16), {"BLOCK": 64, "num_warps": 4})
    assert c2 is c1 and len(kern.slow) == 1                   # hit: launcher called directly
    (run,) = c1.runs
    assert run[:7] == (5, 7, 1, 1234, "fn", "meta", None) and run[7:9] == (None, None)
    assert run[9] is x and run[10:] == (16, 64, True)         # constexprs + defaults in order
    launcher.launch(kern, (5, 7), (x, 17), {"BLOCK": 64, "num_warps": 4})
    assert len(kern.slow) == 2                                # new int value: new key
    monkeypatch.setattr(launcher, "FAST_LAUNCH", False)       # kill switch
    launcher.launch(kern, (5, 7), (x, 16), {"BLOCK": 64, "num_warps": 4})
    assert len(kern.slow) == 3 and len(c1.runs) == 1
    monkeypatch.setattr(launcher, "FAST_LAUNCH", True)
    monkeypatch.setattr(launcher, "_INTERPRETED", True)       # interpreter: always normal path
    launcher.launch(kern, (5, 7), (x, 16), {"BLOCK": 64, "num_warps": 4})
    assert len(kern.slow) == 4 and len(c1.runs) == 1


class _FakeLauncher:
    """CudaLauncher stand-in: the C ``launch`` plus the scratch sizes and flags."""

    def __init__(self, scratch=0):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.direct, self.calls = [], []

        def launch(*a):
            self.direct.append(a)
        self.launch = launch

    def __call__(self, *a):
        self.calls.append(a)


class _FakeCompiledDirect:
    function, packed_metadata = "fn", "meta"

    def __init__(self, scratch=0):
        self.run = _FakeLauncher(scratch)


class _FakeKernelDirect(_FakeKernel):
    def __init__(self, scratch=0):
        super().__init__()
        self.scratch = scratch

    def __getitem__(self, grid):
        def call(*args, **meta):
            self.slow.append((grid, args, meta))
            return _FakeCompiledDirect(self.scratch)
        return call


def _fast_env(monkeypatch):
    monkeypatch.setattr(launcher, "_INTERPRETED", False)
    monkeypatch.setattr(launcher, "FAST_LAUNCH", True)
    monkeypatch.setattr(launcher, "_LAUNCH_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda dev: 99)


def test_fast_key_hits_only_identical_specializations(monkeypatch):
    """launch(..., ntensors=k): tensors' dtype and 16-byte alignment, the scalar tail by
    value, meta, kernel and device each make a new entry; identical ones hit."""
    _fast_env(monkeypatch)
    kern, other = _FakeKernelDirect(), _FakeKernelDirect()
    x = torch.empty(64)
    meta = {"BLOCK": 64, "num_warps": 4}
    launcher.launch(kern, (1, 1), (x, 16, 0.5), meta, 1)
    launcher.launch(kern, (2, 3), (torch.empty(64), 16, 0.5), dict(meta), 1)  # other buffer, same spec
    aligned = torch.empty(64).data_ptr() % 16 == x.data_ptr() % 16
    assert len(kern.slow) == (1 if aligned else 2)
    seen = len(kern.slow)
    for args, m in [((x.half(), 16, 0.5), meta),            # dtype
                    ((x[1:], 16, 0.5), meta),               # alignment
                    ((x, 17, 0.5), meta),                   # int value
                    ((x, 16, 0.25), meta),                  # float value (a new entry, never a wrong one)
                    ((x, 16, 0.5), {"BLOCK": 32, "num_warps": 4})]:  # constexpr
        launcher.launch(kern, (1, 1), args, m, 1)
        seen += 1
        assert len(kern.slow) == seen, args
    launcher.launch(other, (1, 1), (x, 16, 0.5), meta, 1)  # kernel
    assert len(other.slow) == 1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # device
    launcher.launch(kern, (1, 1), (x, 16, 0.5), meta, 1)
    assert len(kern.slow) == seen + 1


def test_fast_key_calls_the_c_launcher_directly(monkeypatch):
    """A hit calls the driver's C launcher with what CudaLauncher.__call__ would pass (no
    scratch, its cooperative-grid and PDL flags); a kernel that needs scratch memory keeps
    CompiledKernel.run."""
    _fast_env(monkeypatch)
    kern, x = _FakeKernelDirect(), torch.empty(32)
    c = launcher.launch(kern, (3, 2), (x, 16), {"BLOCK": 64}, 1)
    assert launcher.launch(kern, (5, 7), (x, 16), {"BLOCK": 64}, 1) is c
    (a,) = c.run.direct
    assert a[:13] == (5, 7, 1, 99, "fn", False, True, None, None, "meta", None, None, None)
    assert a[13] is x and a[14:] == (16, 64, True) and c.run.calls == []
    kern2 = _FakeKernelDirect(scratch=128)
    c2 = launcher.launch(kern2, (1, 1), (x, 16), {"BLOCK": 64}, 1)
    launcher.launch(kern2, (4, 1), (x, 16), {"BLOCK": 64}, 1)
    assert c2.run.direct == [] and len(c2.run.calls) == 1
    assert c2.run.calls[0][:9] == (4, 1, 1, 99, "fn", "meta", None, None, None)


@pytest.mark.parametrize("interpreted", [True, False])
def test_fast_key_checks_the_tensor_scalar_split(monkeypatch, interpreted):
    _fast_env(monkeypatch)
    monkeypatch.setattr(launcher, "_INTERPRETED", interpreted)
    kern, x = _FakeKernelDirect(), torch.empty(32)
    with pytest.raises(TypeError, match="must be a tensor"):
        launcher.launch(kern, (1, 1), (x, 16), {"BLOCK": 64}, 2)
    with pytest.raises(TypeError, match="after the 1 tensors"):
        launcher.launch(kern, (1, 1), (x, x), {"BLOCK": 64}, 1)
    with pytest.raises(TypeError, match="after the 1 tensors"):
        launcher.launch(kern, (1, 1), (x, "str"), {"BLOCK": 64}, 1)
    assert kern.slow == []


def test_cached_launch_steps_aside_for_launch_hooks(monkeypatch):
    import triton
    monkeypatch.setattr(launcher, "_INTERPRETED", False)
    monkeypatch.setattr(launcher, "_LAUNCH_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda dev: 0)
    kern, x = _FakeKernel(), torch.empty(32)
    launcher.launch(kern, (1, 1), (x, 16), {"BLOCK": 64})
    hook = lambda meta: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launcher._launch_hooks_active()
        launcher.launch(kern, (1, 1), (x, 16), {"BLOCK": 64})
        assert len(kern.slow) == 2
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert not launcher._launch_hooks_active()


def test_for_lengths_takes_a_length_generic_twin_only_for_length_one(monkeypatch):
    """A length of 1 launches the kernel's twin with the sequence lengths unspecialised
    (the ptxas crash at N=1); every other length launches the kernel itself."""
    import triton

    from nemo_ssa.ops.common import launch as L
    from nemo_ssa.ops.common.bwd_kernels import attn_bwd_kernel_dq

    monkeypatch.setattr(L, "_INTERPRETED", False)
    monkeypatch.setattr(L, "_LENGTH_GENERIC", {})
    assert L.for_lengths(attn_bwd_kernel_dq, 16, 17) is attn_bwd_kernel_dq
    assert L.for_lengths(attn_bwd_kernel_dq, 1024, 1024) is attn_bwd_kernel_dq
    twin = L.for_lengths(attn_bwd_kernel_dq, 1, 17)
    assert isinstance(twin, triton.runtime.jit.JITFunction) and twin is not attn_bwd_kernel_dq
    assert twin.fn is attn_bwd_kernel_dq.fn and L.for_lengths(attn_bwd_kernel_dq, 3, 1) is twin  # built once
    flags = {p.name: p.do_not_specialize for p in twin.params}
    assert flags["SEQ_Q"] and flags["SEQ_K"] and set(L.LENGTH_ARGS) <= set(flags)
    assert not any(v for k, v in flags.items() if k not in L.LENGTH_ARGS)  # nothing else changes
    monkeypatch.setattr(L, "_INTERPRETED", True)  # the interpreter never specialises: the kernel itself
    assert L.for_lengths(attn_bwd_kernel_dq, 1, 1) is attn_bwd_kernel_dq


def _calls(fn, attr: str):
    """``ast.unparse`` of every call to ``*.{attr}(...)`` in the source of ``fn``."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return [ast.unparse(n) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def test_the_installed_triton_launches_the_way_the_cached_launch_replays():
    """The cached launch's hit path (``launch._cache_entry``) replays, argument for argument,
    what the installed Triton's ``JITFunction.run`` passes to ``CompiledKernel.run`` and what
    the NVIDIA driver's ``CudaLauncher.__call__`` passes to its C ``launch`` -- Triton
    internals. Read here from the installed Triton's source, so a Triton version that moves
    them fails this CPU test before a GPU run launches a kernel with misplaced arguments
    (update ``_cache_entry`` and the stand-ins above together, then this test)."""
    from triton.backends.nvidia import driver
    from triton.runtime import jit

    run_calls = _calls(jit.JITFunction.run, "run")
    assert run_calls == [
        "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
        "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())"], run_calls
    launch_calls = _calls(driver.CudaLauncher.__call__, "launch")
    assert launch_calls == [
        "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
        "global_scratch, profile_scratch, *args)"], launch_calls
    import inspect

    src = inspect.getsource(driver.CudaLauncher.__init__)
    for attr in ("self.launch =", "self.global_scratch_size =", "self.profile_scratch_size =",
                 "self.launch_cooperative_grid =", "self.launch_pdl ="):
        assert attr in src, f"CudaLauncher no longer sets {attr.split()[0]}: launch._cache_entry reads it"


# ---- keyword launches ---------------------------------------------------------------------


@launcher.presence_flags(HAS_Y=("Y", "Z"))
@triton.jit
def _kw_kernel(X, Y, Z, s_xz, s_xh, s_xs, s_xd, n, RNG_SZ, RNG_SH, scale,
               BLOCK: tl.constexpr, HAS_Y: tl.constexpr, FLAG: tl.constexpr = True):
    pass


def test_bind_kw_gives_the_positional_call_in_any_keyword_order():
    """Keywords (any order, tensors and scalars apart) bind to the tuple a positional call
    passes: strides spread from one tuple per tensor, the presence flag derived, absent
    tensors replaced by the placeholder."""
    x, y, z, ph = (torch.empty(4) for _ in range(4))
    positional = (x, y, z, 1, 2, 3, 4, 7, 5, 6, 0.5)
    tensors, scalars = dict(X=x, Y=y, Z=z), dict(s_x=(1, 2, 3, 4), n=7, RNG_S=(5, 6), scale=0.5)
    for t, s in [(tensors, scalars), (dict(reversed(tensors.items())), dict(reversed(scalars.items())))]:
        args, meta = launcher.bind_kw(_kw_kernel, t, s, {"BLOCK": 16}, absent=ph)
        assert args == positional and all(a is b for a, b in zip(args[:3], positional[:3]))
        assert meta == {"BLOCK": 16, "HAS_Y": True}
    args, meta = launcher.bind_kw(_kw_kernel, dict(X=x, Y=None, Z=None), scalars, {"BLOCK": 16}, absent=ph)
    assert args[1] is ph and args[2] is ph and meta["HAS_Y"] is False


@pytest.mark.parametrize("tensors,scalars,meta,absent,match", [
    (dict(X=1, Y=1, Z=1, W=1), dict(s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: unknown parameter\(s\) \['W'\] in tensors"),
    (dict(X=1, Y=1, Z=1), dict(s_x=(1, 2, 3, 4), RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: missing parameter\(s\) \['n'\] in scalars"),
    (dict(X=1, Y=1, Z=1), dict(s_xz=1, s_xh=1, s_xs=1, s_xd=1, n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"unknown parameter\(s\) \['s_xd', 's_xh', 's_xs', 's_xz'\] in scalars; missing parameter\(s\) \['s_x'\]"),
    (dict(X=1, Y=1, Z=1), dict(s_x=(1, 2, 3), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: s_x must be a tuple of 4 \(s_xz, s_xh, s_xs, s_xd\)"),
    (dict(X=1, Y=1, Z=1), dict(X=1, s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: unknown parameter\(s\) \['X'\] in scalars"),
    (dict(X=1, Z=1), dict(Y=1, s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: unknown parameter\(s\) \['Z'\] in tensors; missing parameter\(s\) \['Y'\] in tensors"),
    (dict(X=1, Y=1, Z=1), dict(s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {"HAS_Y": True}, None,
     r"_kw_kernel: \['HAS_Y'\] derived from"),
    (dict(X=1, Y=1, Z=None), dict(s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {}, 0,
     r"_kw_kernel: \['Y', 'Z'\] must all be given or all be None"),
    (dict(X=1, Y=None, Z=None), dict(s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: \['Y', 'Z'\] None \(HAS_Y=False\) needs absent="),
])
def test_bind_kw_names_the_kernel_and_parameter_of_a_bad_call(tensors, scalars, meta, absent, match):
    with pytest.raises(TypeError, match=match):
        launcher.bind_kw(_kw_kernel, tensors, scalars, meta, absent=absent)


@pytest.mark.parametrize("tensors,scalars,meta,absent,match", [
    (dict(X=1, Y=1, Z=1, W=1), dict(s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: unknown parameter\(s\) \['W'\] in tensors"),
    (dict(X=1, Y=1, Z=1), dict(s_x=(1, 2, 3), n=1, RNG_S=(1, 1), scale=1.0), {}, None,
     r"_kw_kernel: s_x must be a tuple of 4"),
    (dict(X=1, Y=1, Z=1), dict(s_x=(1, 2, 3, 4), n=1, RNG_S=(1, 1), scale=1.0), {"HAS_Y": True}, None,
     r"_kw_kernel: \['HAS_Y'\] derived from"),
])
def test_launch_kw_names_a_bad_call_when_the_binder_is_cached(monkeypatch, tensors, scalars, meta, absent, match):
    """``launch_kw`` binds with the cached binder directly; a call it cannot bind still raises
    ``bind_kw``'s TypeError, and nothing is launched."""
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: launched.append(a))
    x = torch.empty(4)
    launcher.launch_kw(_kw_kernel, (1,), dict(X=x, Y=x, Z=x), dict(s_x=(1, 2, 3, 4), n=7, RNG_S=(5, 6), scale=0.5),
                       {"BLOCK": 16})
    assert len(launched) == 1 and (_kw_kernel.fn, 3) in launcher._BINDERS
    with pytest.raises(TypeError, match=match):
        launcher.launch_kw(_kw_kernel, (1,), tensors, scalars, meta, absent=absent)
    assert len(launched) == 1


def test_presence_flags_must_name_the_kernels_parameters():
    @triton.jit
    def k(X, N, F: tl.constexpr):
        pass
    for flags, match in [(dict(G="X"), "'G' is not a constexpr"), (dict(F="Y"), "names 'Y'"),
                         (dict(F="N"), None)]:
        launcher.presence_flags(**flags)(k)
        if match is None:
            assert launcher.bind_kw(k, dict(X=1), dict(N=None), {}, absent=0) == ((1, 0), {"F": False})
        else:
            with pytest.raises(TypeError, match=match):
                launcher.bind_kw(k, dict(X=1), dict(N=1), {})


def test_bind_kw_builds_the_binder_once_per_kernel(monkeypatch):
    """The signature is read once per kernel (``kernel.fn``: a ``for_lengths`` twin shares
    it) and tensor count, not per launch."""
    built = []
    real = launcher._build_binder
    monkeypatch.setattr(launcher, "_BINDERS", {})
    monkeypatch.setattr(launcher, "_build_binder", lambda k, n: built.append(k.fn) or real(k, n))
    x = torch.empty(4)
    kw = (dict(X=x, Y=x, Z=x), dict(s_x=(1, 2, 3, 4), n=7, RNG_S=(5, 6), scale=0.5), {"BLOCK": 16})
    for _ in range(3):
        launcher.bind_kw(_kw_kernel, *kw)
    twin = triton.runtime.jit.JITFunction(_kw_kernel.fn) if not is_interpreter() else _kw_kernel
    launcher.bind_kw(twin, *kw)
    assert built == [_kw_kernel.fn]


def test_launch_kw_takes_the_cached_path_with_the_positional_tuple(monkeypatch):
    """``launch_kw`` ends in ``launch`` with the bound tuple, ``ntensors=len(tensors)``; on
    the stand-in kernel the second call is a cache hit with the same arguments."""
    _fast_env(monkeypatch)
    kern, x = _FakeKernelDirect(), torch.empty(32)

    def f(X, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
        pass
    kern.fn = f
    c = launcher.launch_kw(kern, (3, 2), dict(X=x), dict(n=16), {"BLOCK": 64})
    assert kern.slow == [((3, 2), (x, 16), {"BLOCK": 64})]
    assert launcher.launch_kw(kern, (5, 7), dict(X=x), dict(n=16), {"BLOCK": 64}) is c
    (a,) = c.run.direct
    assert a[13] is x and a[14:] == (16, 64, True)
    with pytest.raises(TypeError, match="must be a tensor"):  # the tensors/scalars split is launch's
        launcher.launch_kw(kern, (1, 1), dict(X=3), dict(n=16), {"BLOCK": 64})


@pytest.mark.skipif(not (is_interpreter() or torch.cuda.is_available()), reason="needs the interpreter or CUDA")
def test_launch_kw_equals_direct_kernel_call():
    x = torch.randn(100, device=DEVICE)
    direct, via = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    grid = (cdiv(x.numel(), 32),)
    _axpb_kernel[grid](x, direct, x.numel(), 2.5, BLOCK=32, ADD_ONE=True)
    for _ in range(2):
        via.fill_(float("nan"))
        launcher.launch_kw(_axpb_kernel, grid, dict(Y=via, X=x), dict(a=2.5, n=x.numel()),
                           dict(BLOCK=32, ADD_ONE=True))
        assert torch.equal(via, direct)


def test_attention_kernels_stride_groups():
    """The keywords of the attention kernels: one stride tuple per tensor (and the dropout
    counter strides), everything else by its own name."""
    from nemo_ssa.ops.attention.flash import _attn_fwd_kernel
    from nemo_ssa.ops.common.bwd_kernels import attn_bwd_kernel_dkv

    fwd = launcher._binder(_attn_fwd_kernel, 11).keywords
    assert list(fwd) == ["Q", "K", "V", "O", "M", "CS", "NP", "BP", "RNG", "CU_Q", "CU_K", "s_q", "s_k", "s_v",
                         "s_o", "s_m", "HQ", "GROUP", "SEQ_Q", "SEQ_K", "scale", "dropout_p", "RNG_S"]
    assert fwd["s_m"] == ("s_mz", "s_mh", "s_ms") and fwd["RNG_S"] == ("RNG_SZ", "RNG_SH", "RNG_SS")
    dkv = launcher._binder(attn_bwd_kernel_dkv, 16)
    assert dkv.keywords["s_n"] == ("s_nz", "s_nh", "s_ns")
    assert set(dkv.flags) == {"VARLEN", "HAS_DROPOUT", "ATOMIC_DQ", "DN_KV"}


def test_block_d_and_d_bucket_are_the_padded_head_dim_every_time():
    """Both keep their answers per head dim (asked on every launch): the first and any later
    answer are the formula's, for every head dim the ops accept and a few beyond."""
    from nemo_ssa.ops.common.bwd_config import d_bucket

    for _ in range(2):
        for d in range(1, 300):
            assert launcher.block_d(d) == max(16, 1 << (d - 1).bit_length())
            assert d_bucket(d) == max(32, 1 << (d - 1).bit_length())
