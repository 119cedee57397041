"""One table of op benchmarks: what is timed, at which shapes, against what.

Each op (``attention``, ``nsa``, ``nsa-ssa``, ``elsa``, ``layernorm``, ``rope``) declares once

* its entries: a name, a role (``kernel`` under test, ``baseline`` it is timed against in
  the same process, ``reference`` = the unfused/eager path), the baseline each is divided
  by, and whether it needs CUDA (SDPA's flash/cuDNN backends, fla's kernels);
* its shape sets: ``recipe`` (the training recipe's D=32 attention: micro batch 8 and 32,
  seq 1024, 24 heads / 8 KV groups), ``wide`` (D64/D128), ``long`` (long sequences) and
  ``tiny`` (CPU dry run under the Triton interpreter);
* ``build(shape, dtype, device)``: the inputs and one callable per entry, plus the torch
  reference each kernel must agree with (the dry run's check). The builders are the
  speed scripts' own (``bench_attention.make_inputs``/``row_fn``,
  ``bench_nsa.build_case``): a row means the same thing here and there.

``benchmarks/run.py`` times these with ``benchmarks/timing.py``. Unknown names raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Shape:
    label: str
    B: int
    Hq: int
    Hkv: int
    N: int
    D: int

    def __str__(self) -> str:
        return f"{self.label} (B{self.B}-N{self.N}-HQ{self.Hq}-HKV{self.Hkv}-D{self.D})"


@dataclass(frozen=True)
class Entry:
    name: str
    role: str  # "kernel" | "baseline" | "reference"
    baseline: Optional[str]  # the entry its time is divided by (None: baselines themselves)
    needs_cuda: bool = False  # no CPU path at all: skipped by the dry run, with the reason
    modes: Tuple[str, ...] = ("fwd", "fwd+bwd")


@dataclass
class Built:
    """One shape's inputs and callables: ``fns[name]() -> output``; ``leaves[name]`` are
    what its backward differentiates; ``refs[name]() -> reference output`` on the same
    inputs (absent: nothing to compare); ``skipped[name]``: why there is no callable."""

    fns: Dict[str, Callable[[], torch.Tensor]]
    leaves: Dict[str, List[torch.Tensor]]
    grad_out: torch.Tensor
    refs: Dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OpBench:
    op: str
    doc: str
    entries: Tuple[Entry, ...]
    shapes: Dict[str, Tuple[Shape, ...]]
    build: Callable[..., Built]  # (shape, dtype, device, names) -> Built
    tiny_rtol: float = 2e-3  # dry run: rel_err(fn, ref) bound at fp32, tiny shapes

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"op {self.op!r} has no entry {name!r}; entries: {[e.name for e in self.entries]}")


# ----------------------------------------------------------------------------- attention
RECIPE = (Shape("recipe", 8, 24, 8, 1024, 32), Shape("recipe-B32", 32, 24, 8, 1024, 32))


def _build_attention(shape: Shape, dtype, device, names) -> Built:
    from benchmarks import bench_attention as ba

    causal = True
    q, k, v, go, n, b = ba.make_inputs(shape.B, shape.Hq, shape.Hkv, shape.N, shape.D, dtype, device)
    built = Built(fns={}, leaves={}, grad_out=go)
    for name in names:
        try:
            fn, extra, note = ba.row_fn(name, causal, q, k, v, n, b)
        except Exception as e:  # a backend missing here (SDPA flash/cuDNN on a CPU)
            built.skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            continue
        built.fns[name] = (lambda fn=fn: fn(q, k, v))
        built.leaves[name] = [q, k, v, *extra]
        if note:
            built.notes[name] = "K/V expanded outside the timed region"

    ssa_ref, softmax_ref = _references(q, k, v, n, b, causal)
    built.refs.update(softmax_triton=softmax_ref, ssa_triton=ssa_ref, ssa_reference=ssa_ref,
                      sdpa_flash=softmax_ref, sdpa_cudnn=softmax_ref)
    return built


def _references(q, k, v, n, b, causal: bool):
    """``(ssa_ref, softmax_ref)``: the fp32 torch references of one shape's inputs (GQA native)."""

    def ssa_ref():
        from nemo_ssa.ops.attention.naive import attention_naive

        return attention_naive(q, k, v, n=n, b=b, causal=causal, upcast=True)

    def softmax_ref():
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    return ssa_ref, softmax_ref


ATTENTION = OpBench(
    op="attention",
    doc="causal attention kernels (bench_attention.py's rows) vs SDPA cuDNN / flash",
    entries=(
        Entry("softmax_triton", "kernel", "sdpa_cudnn"),
        Entry("ssa_triton", "kernel", "sdpa_cudnn"),
        Entry("ssa_reference", "reference", "sdpa_cudnn"),
        Entry("sdpa_flash", "baseline", "sdpa_cudnn", needs_cuda=True),
        Entry("sdpa_cudnn", "baseline", None, needs_cuda=True),
    ),
    shapes={
        "recipe": RECIPE,
        "wide": (Shape("D64", 2, 16, 16, 8192, 64), Shape("D128", 2, 8, 8, 8192, 128),
                 Shape("D64-B8", 8, 16, 16, 4096, 64), Shape("D128-B8", 8, 8, 8, 4096, 128)),
        "long": (Shape("N4096", 2, 24, 8, 4096, 32), Shape("N16384", 1, 24, 8, 16384, 32),
                 Shape("N32768", 1, 24, 8, 32768, 32)),
        "tiny": (Shape("tiny", 1, 4, 2, 40, 32),),
    },
    build=_build_attention,
)


# ----------------------------------------------------------------------------------- NSA
def _nsa_builder(transform: str):
    def build(shape: Shape, dtype, device, names) -> Built:
        from benchmarks import bench_nsa as bn

        case = bn.build_case(shape.D, shape.N, batch=shape.B, hq=shape.Hq, hkv=shape.Hkv, dtype=dtype,
                             device=device, transform=transform, small_blocks=shape.label == "tiny")
        built = Built(fns={}, leaves={}, grad_out=case["do"])
        for name in names:
            if case["fns"].get(name) is None:
                built.skipped[name] = case["skipped"].get(name, "no callable")
                continue
            built.fns[name] = case["fns"][name]
            built.leaves[name] = case["leaves"].get(name, [])
            if name in case["refs"]:
                built.refs[name] = case["refs"][name]
        return built

    return build


_NSA_ENTRIES = (
    Entry("nsa_layer", "kernel", "sdpa_flash"),
    Entry("compressed", "kernel", "sdpa_flash"),
    Entry("selection", "kernel", "sdpa_flash", modes=("fwd",)),
    Entry("selected", "kernel", "sdpa_flash"),
    Entry("window", "kernel", "sdpa_flash"),
    Entry("sdpa_flash", "baseline", None),  # on a CPU: SDPA's math path (the dry run checks it)
    Entry("fla_nsa", "baseline", "sdpa_flash", needs_cuda=True),
)
_NSA_SHAPES = {
    "recipe": (Shape("recipe", 8, 24, 8, 1024, 32),),
    "long": tuple(Shape(f"N{n}", 1, 24, 8, n, 32) for n in (4096, 16384, 32768, 65536)),
    "wide": tuple(Shape(f"D128-N{n}", 1, 24, 8, n, 128) for n in (4096, 16384, 32768, 65536)),
    "tiny": (Shape("tiny", 1, 6, 2, 128, 32),),
}
NSA = OpBench("nsa", "NSA layer and branches (bench_nsa.py's rows), softmax transform, vs SDPA flash",
              _NSA_ENTRIES, _NSA_SHAPES, _nsa_builder("softmax"))
NSA_SSA = OpBench("nsa-ssa", "the same NSA rows with the SSA transform", _NSA_ENTRIES, _NSA_SHAPES,
                  _nsa_builder("ssa"))

# ---------------------------------------------------------------------------------- ELSA
def _build_elsa(shape: Shape, dtype, device, names) -> Built:
    from benchmarks import bench_attention as ba, bench_elsa as be

    causal = True
    q, k, v, go, n, b = ba.make_inputs(shape.B, shape.Hq, shape.Hkv, shape.N, shape.D, dtype, device)
    built = Built(fns={}, leaves={}, grad_out=go)
    for name in names:
        if name.startswith("elsa_"):
            fn, extra = be._elsa_fn(name[len("elsa_"):], causal, n, b), [n] if name == "elsa_ssa" else []
        elif name == "sdpa_flash" and device.type == "cuda":
            fn, extra = be._sdpa_fn("flash", causal), []
        else:
            built.skipped[name] = "SDPA's flash backend needs CUDA"
            continue
        built.fns[name] = (lambda fn=fn: fn(q, k, v))
        built.leaves[name] = [q, k, v, *extra]

    ssa_ref, softmax_ref = _references(q, k, v, n, b, causal)
    built.refs.update(elsa_softmax=softmax_ref, elsa_ssa=ssa_ref)
    return built


ELSA = OpBench(
    op="elsa",
    doc="ELSA's two-pass scan (bench_elsa.py's rows), softmax and SSA transforms, vs SDPA flash",
    entries=(
        Entry("elsa_softmax", "kernel", "sdpa_flash"),
        Entry("elsa_ssa", "kernel", "sdpa_flash"),
        Entry("sdpa_flash", "baseline", None, needs_cuda=True),
    ),
    shapes={
        "recipe": (Shape("recipe", 8, 24, 8, 1024, 32),),
        "wide": (Shape("D64-N4096", 1, 16, 16, 4096, 64), Shape("D64-N16384", 1, 16, 16, 16384, 64)),
        "long": (Shape("N4096", 1, 24, 8, 4096, 32), Shape("N16384", 1, 24, 8, 16384, 32)),
        "tiny": (Shape("tiny", 1, 4, 2, 40, 32),),
    },
    build=_build_elsa,
)

# ----------------------------------------------------------------------------- layernorm
def _build_layernorm(shape: Shape, dtype, device, names) -> Built:
    """The model's LayerNorm1P (zero-centred gamma: ``1 + w``) on megatron's ``[s, b, h]``
    activations (``shape.D`` is the hidden size; Hq/Hkv are unused): torch's kernels (the
    baseline), ours (nemo_ssa.ops.norm) and the libraries that could replace them, inductor's
    generated kernel and fla's Triton LayerNorm."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from nemo_ssa.megatron.layernorm import LayerNorm1P

    h, eps = shape.D, 1e-5
    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(normalization="LayerNorm", layernorm_zero_centered_gamma=True, params_dtype=dtype,
                          sequence_parallel=False)
    norm = LayerNorm1P(cfg, h, eps=eps).to(device)
    with torch.no_grad():  # trained-looking parameters, not the zero / zero initialisation
        norm.weight.copy_(0.1 * torch.randn(h, generator=g))
        norm.bias.copy_(0.1 * torch.randn(h, generator=g))
    x = torch.randn(shape.N, shape.B, h, generator=g).to(device, dtype).requires_grad_()
    go = torch.randn(shape.N, shape.B, h, generator=g).to(device, dtype)
    built = Built(fns={}, leaves={}, grad_out=go)
    leaves = [x, norm.weight, norm.bias]
    for name in names:
        if name == "layernorm1p":
            fn = norm
        elif name == "nemo_ssa_layernorm":  # FusedLayerNorm1P: what model.fused_layernorm=auto runs on a GPU
            from nemo_ssa.ops.norm import layer_norm_1p

            fn = (lambda t: layer_norm_1p(t, norm.weight, norm.bias, eps, True, impl="triton"))
        elif name == "torch_compile":
            if device.type != "cuda":  # inductor's CPU code is not what would run, and compiles slowly
                built.skipped[name] = "inductor's GPU kernel needs CUDA"
                continue
            fn = torch.compile(norm.forward, dynamic=False)
        elif name == "fla_layernorm":
            try:  # fla-core 0.6 (the GPU bundle's pin); absent from the CPU lock
                from fla.modules.norm.layernorm import layer_norm
            except Exception as e:
                built.skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                continue
            fn = (lambda t, f=layer_norm: f(t, norm.weight + 1, norm.bias, eps=eps))
        else:
            raise KeyError(name)
        built.fns[name] = (lambda fn=fn: fn(x))
        built.leaves[name] = leaves

    def ref():
        return F.layer_norm(x.float(), (h,), norm.weight.float() + 1, norm.bias.float(), eps)

    built.refs.update({n: ref for n in ("layernorm1p", "nemo_ssa_layernorm", "torch_compile", "fla_layernorm")})
    return built


LAYERNORM = OpBench(
    op="layernorm",
    doc="the model's LayerNorm1P: eager F.layer_norm of 1 + w (model.fused_layernorm=false), our Triton "
        "kernels (nemo_ssa.ops.norm, fused_layernorm=auto on a GPU), inductor's kernel and fla's Triton LayerNorm",
    entries=(
        Entry("layernorm1p", "baseline", None),
        Entry("nemo_ssa_layernorm", "kernel", "layernorm1p"),
        Entry("torch_compile", "baseline", "layernorm1p", needs_cuda=True),
        Entry("fla_layernorm", "baseline", "layernorm1p", needs_cuda=True),
    ),
    shapes={
        "recipe": (Shape("recipe", 8, 1, 1, 1024, 768), Shape("recipe-B32", 32, 1, 1, 1024, 768)),
        "wide": (Shape("h2048-B8", 8, 1, 1, 1024, 2048), Shape("h4096-B4", 4, 1, 1, 1024, 4096)),
        "long": (Shape("N8192-B4", 4, 1, 1, 8192, 768),),
        "tiny": (Shape("tiny", 2, 1, 1, 7, 40),),
    },
    build=_build_layernorm,
)

# ----------------------------------------------------------------------------- rope
def _build_rope(shape: Shape, dtype, device, names) -> Built:
    """RoPE + layout from megatron's QKV buffer [s, b, ng, (p + 2) * d] to contiguous
    [b, h, s, d] q, k, v, rotary_percent 0.5 (the recipe's): our one-pass kernel
    (``rope_layout_qkv_triton``, what FusedRopeSelfAttention runs) against the unfused torch
    path (megatron's split, the rotate-half RoPE and the copies: ``rope_layout_qkv_naive``).
    The output is the (q, k, v) tuple; fwd+bwd differentiates the QKV buffer."""
    from nemo_ssa.ops.rope import rope_layout_qkv_naive, rope_layout_qkv_triton

    p, d, rot = shape.Hq // shape.Hkv, shape.D, shape.D // 2
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(shape.N, shape.B, shape.Hkv, (p + 2) * d, generator=g).to(device, dtype).requires_grad_()
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(shape.N, dtype=torch.float32), inv)
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :].to(device)  # megatron's rotary tensor
    go = tuple(torch.randn(shape.B, h, shape.N, d, generator=g).to(device, dtype)
               for h in (shape.Hq, shape.Hkv, shape.Hkv))
    built = Built(fns={}, leaves={}, grad_out=go)
    for name in names:
        if name == "rope_torch":
            built.fns[name] = lambda: rope_layout_qkv_naive(mixed, p, freqs, freqs)
        elif name == "rope_qkv_triton":
            built.fns[name] = lambda: rope_layout_qkv_triton(mixed, p, freqs, freqs)
        else:
            raise KeyError(name)
        built.leaves[name] = [mixed]

    def ref():
        return rope_layout_qkv_naive(mixed.detach().double(), p, freqs.double(), freqs.double())

    built.refs.update({n: ref for n in ("rope_torch", "rope_qkv_triton")})
    return built


ROPE = OpBench(
    op="rope",
    doc="RoPE + [s, b, h, d] -> [b, h, s, d] layout from the QKV buffer: our one pass (FusedRopeSelfAttention's) "
        "against the unfused torch split + rotate-half + copies",
    entries=(
        Entry("rope_torch", "baseline", None),
        Entry("rope_qkv_triton", "kernel", "rope_torch"),
    ),
    shapes={
        "recipe": tuple(Shape(s.label, s.B, s.Hq, s.Hkv, s.N, s.D) for s in RECIPE),
        "wide": (Shape("D64-B8", 8, 16, 4, 1024, 64), Shape("D128-B4", 4, 32, 8, 2048, 128)),
        "long": (Shape("N8192-B2", 2, 24, 8, 8192, 32),),
        "tiny": (Shape("tiny", 2, 6, 2, 7, 16),),
    },
    build=_build_rope,
)

REGISTRY: Dict[str, OpBench] = {o.op: o for o in (ATTENTION, NSA, NSA_SSA, ELSA, LAYERNORM, ROPE)}


def get(op: str) -> OpBench:
    """The registered op called ``op`` (KeyError naming the known ops otherwise)."""
    if op not in REGISTRY:
        raise KeyError(f"unknown benchmark op {op!r}; registered: {sorted(REGISTRY)}")
    return REGISTRY[op]


def shapes(op: str, sets: str) -> List[Shape]:
    """Shapes of ``op`` for a comma list of set names (``recipe,long``; ``all``: every set but tiny)."""
    bench = get(op)
    names = [s for s in sets.split(",") if s]
    if names == ["all"]:
        names = [s for s in bench.shapes if s != "tiny"]
    out = []
    for s in names:
        if s not in bench.shapes:
            raise KeyError(f"op {op!r} has no shape set {s!r}; sets: {sorted(bench.shapes)}")
        out += bench.shapes[s]
    return out
