"""Property test ("fuzz") of the public attention ops: correct or refused, never anything else.

Every case calls one public function of ``nemo_ssa.ops`` -- the registry's attentions
(``ssa``/``softmax`` x ``triton``, ``triton_varlen``, ``flex``, ``elsa``, ``reference``,
``sdpa``) and NSA's ``nsa_attention`` (softmax and SSA) -- with inputs drawn from a seeded
generator: random shapes (head dims 1-300, GQA ratios valid and invalid, unequal and
empty sequences), dtypes (fp16/bf16/fp32, fp64, integers, bool, complex), layouts
(permuted Megatron ``[s, b, h, d]`` views, non-dense slices, expanded (stride-0) K/V),
devices (the kernels' device, ``cpu`` without the interpreter, ``meta``, mixed), bad
scalars (``softmax_scale``, ``dropout_p``, ``n``/``b``), masks, ``cu_seqlens`` and NSA
configs, and value ranges (normal, |s| up to 1e4, NaN). Each case ends in exactly one of:

* **correct** -- the op returned, and its output and every gradient match the float64
  reference by the 2x-eager rule (``nemo_ssa.testing``; 16-bit: twice the same-dtype
  eager error, dn/db and dq/dk/dv also bounded by their |terms|, which covers rows that
  extreme logits make one-hot);
* **refused** -- ``ValueError`` / ``NotImplementedError`` whose message names what is
  supported (it contains "supported", "must", "expected", "needs", "one of", "only",
  ...);
* **failed** -- any other exception (a crash), a refusal that does not say what is
  supported, a result that disagrees with the reference (silently wrong), an input the
  reference refuses but the op accepts, or a case that runs past its time limit (hang).

NaN contract (cases ``nan:*``; README "Bad input"): a NaN in ``q[b, h, i]`` makes output
row ``(b, h, i)`` non-finite; a NaN in ``k``/``v`` at ``(b, g, j)`` makes every row that
attends to key ``j`` non-finite (other rows of that batch and kv group may become NaN too:
``0 * NaN`` in ``p @ v``, as in any matmul attention), and in packed (varlen) inputs only
that sequence. Every other (batch, kv group) -- and every other packed sequence -- is
bit-identical to the run without the NaN, in the output and in dq, dk, dv. dn, db (sums
over everything) become non-finite. Never is a NaN silently turned into a finite value
in the affected row.

Not checked (documented caller contracts, checking them would need a device sync):
``cu_seqlens`` values (monotone, ending at T) and ``max_seqlen`` >= every length; ``b >= 0``.

CLI (``--cases`` on ``--device cpu`` runs the kernels in the Triton interpreter; ``cuda``
runs them on the GPU)::

    TRITON_INTERPRET=1 python -m nemo_ssa.testing.ops_fuzz --cases 600 --device cpu --out fuzz.md
    python -m nemo_ssa.testing.ops_fuzz --cases 3000 --device cuda --time-budget 90 --out fuzz-cuda.md
    python -m nemo_ssa.testing.ops_fuzz --device cpu --only 417        # re-run one case, full traceback

Case ``i`` of seed ``s`` draws from ``random.Random(s * 1_000_003 + i)``: a case id
reproduces alone.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["run_case", "run_fuzz", "summarize", "OPS", "CaseResult", "REFUSAL_WORDS"]

F64 = torch.float64
DENSE_OPS = ["ssa_triton", "softmax_triton", "ssa_flex", "elsa", "elsa_ssa", "ssa_reference", "softmax_reference",
             "softmax_sdpa"]
VARLEN_OPS = ["ssa_triton_varlen", "softmax_triton_varlen"]
NSA_OPS = ["nsa", "nsa_ssa"]
OPS = DENSE_OPS + VARLEN_OPS + NSA_OPS
SSA_OPS = {"ssa_triton", "ssa_flex", "elsa_ssa", "ssa_reference", "ssa_triton_varlen", "nsa_ssa"}
KERNEL_OPS = {"ssa_triton", "softmax_triton", "ssa_flex", "elsa", "elsa_ssa", "ssa_triton_varlen",
              "softmax_triton_varlen", "nsa", "nsa_ssa"}
REGISTRY = {"ssa_triton": ("ssa", "triton"), "softmax_triton": ("softmax", "triton"), "ssa_flex": ("ssa", "flex"),
            "elsa": ("softmax", "elsa"), "elsa_ssa": ("ssa", "elsa"), "ssa_reference": ("ssa", "reference"),
            "softmax_reference": ("softmax", "reference"), "softmax_sdpa": ("softmax", "sdpa"),
            "ssa_triton_varlen": ("ssa", "triton_varlen"), "softmax_triton_varlen": ("softmax", "triton_varlen")}
#: a refusal must say what is supported: one of these (case-insensitive) in its message
REFUSAL_WORDS = ("supported", "support", "must", "expected", "expects", "needs", "one of", "only", "use ",
                 "requires", "allowed", "at most", "at least", "<=", ">=")
# relative floors of the output check (the output's own rounding) and |terms| rtol of grads
O_FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
               torch.int32: "int32", torch.int64: "int64", torch.bool: "bool", torch.complex64: "complex64",
               torch.uint8: "uint8"}


@dataclass
class CaseResult:
    idx: int
    op: str
    kind: str
    outcome: str  # "correct" | "refused" | "failed"
    detail: str = ""
    desc: str = ""
    seconds: float = 0.0


class _Timeout(Exception):
    pass


class _BadCase(Exception):
    """The generator produced an impossible combination (not counted)."""


# ----------------------------------------------------------------------------- devices
def kernels_runnable_on(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_available()
    from nemo_ssa.ops.common.launch import is_interpreter

    return is_interpreter()


# ------------------------------------------------------------------------------ spec
@dataclass
class Spec:
    op: str
    kind: str  # "valid", "huge", "nan:q", "nan:k", "nan:v", "bad:<what>"
    B: int = 1
    Hq: int = 2
    Hkv: int = 1
    Sq: int = 8
    Sk: int = 8
    D: int = 16
    dtype: torch.dtype = torch.float32
    causal: bool = True
    layout: str = "contig"
    scale: Any = None
    n: float = 1.5
    b: float = 0.8
    param_form: str = "[1]"  # "[1]", "0d", "fp64"
    device: str = "cpu"
    value_scale: float = 1.0
    seqlens: Optional[List[int]] = None  # varlen: per-sequence (q_len, k_len)
    nsa_cfg: Optional[dict] = None
    bad: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def describe(self) -> str:
        dt = DTYPE_NAMES.get(self.dtype, str(self.dtype))
        core = (f"B{self.B} Hq{self.Hq} Hkv{self.Hkv} Sq{self.Sq} Sk{self.Sk} D{self.D} {dt} "
                f"{'causal' if self.causal else 'full'} {self.layout} dev={self.device}")
        if self.seqlens is not None:
            core += f" seqlens={self.seqlens}"
        if self.scale is not None:
            core += f" scale={self.scale!r}"
        if self.value_scale != 1.0:
            core += f" |s|max~{self.value_scale:g}"
        if self.nsa_cfg:
            core += f" nsa={self.nsa_cfg}"
        if self.bad:
            core += " bad=" + ",".join(f"{k}={v!r}" for k, v in self.bad.items())
        return core


def _valid_dtypes(device: str):
    if device == "cuda":
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16]  # the interpreter's bf16 dot is broken


BAD_COMMON = ["dtype_fp64", "dtype_int", "dtype_bool", "dtype_complex", "dtype_mixed", "head_dim_small",
              "head_dim_large", "gqa_ratio", "hkv_zero", "batch_mismatch", "kv_shape", "empty_q", "empty_k",
              "empty_batch", "ndim3", "ndim5", "device_meta", "device_mixed", "scale_zero", "scale_negative",
              "scale_nan", "scale_inf", "scale_tensor", "scale_str", "dropout_negative", "dropout_one",
              "dropout_nan", "dropout_pos", "keep_mask", "keep_mask_float", "keep_mask_shape", "n_missing",
              "n_float", "n_shape", "n_int", "n_device", "b_missing", "softmax_with_n", "not_tensor",
              "device_cpu_no_kernels", "flex_cpu_qkv_grad"]
BAD_VARLEN = ["cu_float", "cu_2d", "cu_len_mismatch", "cu_short", "cu_device", "max_seqlen_zero", "q_4d",
              "cu_not_tensor"]
BAD_NSA = ["gates_shape", "gates_dtype", "cfg_invalid", "phi_missing", "kslc_shape", "impl_unknown", "impl_stage",
           "transform_unknown", "nsa_fp64_triton", "nsa_kv_heads"]


def gen_spec(rng: random.Random, device: str, op: Optional[str] = None) -> Spec:
    """Draw one case (op, kind and inputs) from ``rng``."""
    op = op or rng.choice(OPS)
    u = rng.random()
    # ~70 % cheap refusal probes, ~20 % numeric, ~5 % extreme values, ~5 % NaN contract
    kind = "bad" if u < 0.70 else ("valid" if u < 0.90 else ("huge" if u < 0.95 else "nan"))
    s = Spec(op=op, kind=kind, device=device, seed=rng.randrange(2 ** 31))
    s.Hkv = rng.choice([1, 1, 2, 3])
    s.Hq = s.Hkv * rng.choice([1, 2, 3])
    s.B = rng.choice([1, 1, 2])
    s.Sq = rng.randint(1, 20)
    s.Sk = s.Sq if (rng.random() < 0.6 or op in NSA_OPS) else rng.randint(1, 20)
    s.D = rng.choice([16, 16, 24, 32, 48, 64])
    s.dtype = rng.choice(_valid_dtypes(device))
    s.causal = rng.random() < 0.65 or op in NSA_OPS
    s.layout = rng.choice(["contig", "contig", "sbhd", "bshd", "slice_d", "slice_s", "expand_kv"])
    s.scale = None if rng.random() < 0.6 else round(rng.uniform(0.05, 1.5), 3)
    s.n = round(rng.uniform(-1.0, 3.0), 3)
    s.b = round(rng.uniform(0.0, 2.0), 3)
    s.param_form = rng.choice(["[1]", "[1]", "0d", "fp64"])
    if op in VARLEN_OPS:
        nseq = rng.randint(1, 3)
        lens = []
        for _ in range(nseq):
            lq = rng.choice([0, rng.randint(1, 12), rng.randint(1, 12)]) if rng.random() < 0.15 else rng.randint(1, 12)
            lk = lq if rng.random() < 0.6 else rng.randint(0 if rng.random() < 0.1 else 1, 12)
            lens.append((lq, lk))
        if sum(lq for lq, _ in lens) == 0 or sum(lk for _, lk in lens) == 0:
            lens[0] = (max(1, lens[0][0]), max(1, lens[0][1]))
        s.seqlens = lens
        s.B = 1
        s.layout = rng.choice(["contig", "contig", "slice_d", "thd_perm"])
    if op in NSA_OPS:
        bl = rng.choice([2, 4])
        s.nsa_cfg = dict(block_len=bl, stride=rng.choice([1, 2]) if bl == 2 else rng.choice([2, 4]),
                         select_block=rng.choice([4, 8]), top_n=rng.choice([3, 4]), window=rng.choice([4, 8]),
                         compress=rng.choice(["mean", "mean", "mlp"]))
        s.Sq = s.Sk = rng.randint(1, 24)
        s.layout = rng.choice(["contig", "contig", "sbhd", "slice_d"])
        s.D = rng.choice([16, 32])
    if kind == "huge":
        s.value_scale = 10.0 ** rng.uniform(1.0, 4.0)
    elif kind == "nan":
        s.kind = "nan:" + rng.choice(["q", "k", "v"])
        if s.layout == "expand_kv":  # aliased kv heads: one NaN would be in every head
            s.layout = "contig"
        s.dtype = torch.float32 if device == "cpu" else rng.choice(_valid_dtypes(device))
    elif kind == "bad":
        pool = list(BAD_COMMON)
        if op in VARLEN_OPS:
            pool = [p for p in pool if p not in ("empty_batch", "ndim5", "batch_mismatch")] + BAD_VARLEN * 2
        if op in NSA_OPS:
            pool = [p for p in pool if p not in ("empty_k",)] + BAD_NSA * 2
        what = rng.choice(pool)
        s.kind = "bad:" + what
        s.bad = _bad_params(rng, what, s)
    return s


def _bad_params(rng, what, s: Spec) -> Dict[str, Any]:
    if what == "head_dim_small":
        s.D = rng.randint(1, 15)
        return {"D": s.D}
    if what == "head_dim_large":
        s.D = rng.randint(257, 300)
        s.Sq = min(s.Sq, 6)
        s.Sk = min(s.Sk, 6)
        return {"D": s.D}
    if what == "gqa_ratio":
        s.Hkv = rng.choice([2, 3])
        s.Hq = s.Hkv * rng.randint(1, 2) + rng.randint(1, s.Hkv - 1)
        return {"Hq": s.Hq, "Hkv": s.Hkv}
    if what == "scale_negative":
        return {"scale": -round(rng.uniform(0.1, 2.0), 3)}
    if what == "dropout_pos":  # ops without dropout must refuse it (the others draw masks: not comparable)
        if s.op not in ("elsa", "elsa_ssa", "ssa_flex"):
            return _bad_params(rng, "dropout_one", s)
        return {"dropout_p": round(rng.uniform(0.05, 0.5), 3)}
    if what == "dtype_int":
        return {"dtype": rng.choice([torch.int32, torch.int64, torch.uint8])}
    return {"what": what}


# -------------------------------------------------------------------------- builders
def _layout(t: torch.Tensor, layout: str, rng: random.Random) -> torch.Tensor:
    """Same values as the dense [B, H, S, D] ``t``, in another memory layout (a view)."""
    if layout == "sbhd":  # Megatron [s, b, h, d] permuted to [b, h, s, d]
        return t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    if layout == "bshd":
        return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    if layout == "slice_d":  # every other element of a twice-as-wide buffer (stride 2 on D)
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        big[..., ::2] = t
        return big[..., ::2]
    if layout == "slice_s":  # rows of a longer buffer
        big = torch.zeros(t.shape[0], t.shape[1], 2 * t.shape[2] + 1, t.shape[3], dtype=t.dtype, device=t.device)
        big[:, :, 1::2] = t
        return big[:, :, 1::2]
    return t


def _make(shape, dtype, device, gen, scale=1.0):
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(device=device, dtype=dtype)
    if dtype == torch.complex64:
        return torch.randn(*shape, generator=gen, dtype=F64).to(torch.complex64).to(device)
    if dtype == torch.bool:
        return (torch.randn(*shape, generator=gen) > 0).to(device)
    return torch.randint(0, 5, shape, generator=gen).to(device=device, dtype=dtype)


@dataclass
class Inputs:
    args: tuple
    kwargs: dict
    leaves: Dict[str, torch.Tensor]  # name -> tensor requiring grad (q, k, v, n, b, gates)
    ref: Optional[Callable[[Dict[str, torch.Tensor]], torch.Tensor]]  # fp64 reference from leaves
    eager: Optional[Callable[[Dict[str, torch.Tensor]], torch.Tensor]]  # same-dtype eager from leaves
    terms: Optional[Callable[[Dict[str, torch.Tensor], torch.Tensor], Dict[str, float]]]
    nan_where: Optional[Tuple[str, tuple]] = None  # (tensor name, index) of an injected NaN
    isolation: Optional[Callable[[torch.Tensor], Any]] = None


def build(s: Spec) -> Inputs:
    """Turn a spec into call arguments, leaves and reference closures."""
    if s.op in VARLEN_OPS:
        return _build_varlen(s)
    if s.op in NSA_OPS:
        return _build_nsa(s)
    return _build_dense(s)


def _bad_scale(what, scale):
    return {"scale_zero": 0.0, "scale_nan": float("nan"), "scale_inf": float("inf"),
            "scale_tensor": torch.tensor(0.5), "scale_str": "0.5"}.get(what, scale)


def _scalar_params(s: Spec, device):
    pd = torch.float64 if s.param_form == "fp64" else torch.float32
    shape = () if s.param_form == "0d" else (1,)
    n = torch.full(shape, s.n, dtype=pd, device=device).requires_grad_()
    b = torch.full(shape, s.b, dtype=pd, device=device).requires_grad_()
    return n, b


def what_is(s: Spec) -> Optional[str]:
    return s.bad.get("what")


def _dense_tensors(s: Spec, gen, rng):
    dtype = s.bad.get("dtype", s.dtype)
    what = s.bad.get("what")
    if what == "dtype_fp64":
        dtype = torch.float64
    elif what == "dtype_bool":
        dtype = torch.bool
    elif what == "dtype_complex":
        dtype = torch.complex64
    dev = s.device
    if what == "device_meta":
        dev = "meta"
    elif what == "device_cpu_no_kernels" and s.device == "cuda":
        dev = "cpu"
    B, Hq, Hkv, Sq, Sk, D = s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D
    if what == "hkv_zero":
        Hkv = 0
    if what == "empty_q":
        Sq = 0
    if what == "empty_k":
        Sk = 0
    if what == "empty_batch":
        B = 0
    qs, ks = (B, Hq, Sq, D), (B, Hkv, Sk, D)
    if what == "batch_mismatch":
        ks = (B + 1, Hkv, Sk, D)
    alpha = 1.0
    if s.value_scale != 1.0:  # scale q, k so that max |scale q.k| ~ value_scale
        sc = s.scale if isinstance(s.scale, float) else 1.0 / math.sqrt(D)
        alpha = math.sqrt(s.value_scale / (sc * 3.0 * math.sqrt(D)))
    mk = (lambda shp, a=1.0: _make(shp, dtype, dev, gen, a)) if dev != "meta" else \
        (lambda shp, a=1.0: torch.empty(shp, dtype=dtype if dtype.is_floating_point else torch.float32, device="meta"))
    q, k, v = mk(qs, alpha), mk(ks, alpha), mk(ks)
    if what == "kv_shape":
        v = mk((B, Hkv, Sk + 1, D))
    if what == "dtype_mixed":
        other = torch.float16 if q.dtype == torch.float32 else torch.float32
        k = k.to(other)
    if what == "device_mixed":
        k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    if what == "ndim3":
        q = q[0]
    if what == "ndim5":
        q = q[None]
    layout = s.layout if q.dim() == 4 and q.numel() > 0 and dev != "meta" else "contig"
    if layout == "expand_kv":  # one kv head broadcast to all (stride 0 on the head dim)
        if k.dim() == 4 and k.shape[1] > 0 and k.shape == v.shape:
            k, v = k[:, :1].expand(k.shape), v[:, :1].expand(v.shape)
        layout = "contig"
    q, k, v = (_layout(t, layout, rng) if t.dim() == 4 and t.numel() > 0 and t.device.type != "meta" else t
               for t in (q, k, v))
    return tuple(t.requires_grad_() if t.is_floating_point() and t.device.type != "meta" else t for t in (q, k, v))


def _build_dense(s: Spec) -> Inputs:
    gen = torch.Generator().manual_seed(s.seed)
    rng = random.Random(s.seed)
    q, k, v = _dense_tensors(s, gen, rng)
    if s.op == "ssa_flex" and s.device == "cpu" and what_is(s) != "flex_cpu_qkv_grad":
        # FlexAttention has no CPU backward for q/k/v (refused with NotImplementedError, a
        # bad case of its own); n, b gradients are what a CPU run can check. Keyed on the
        # run's device, as _leaves_for_grad is: on a CUDA run, CPU tensors
        # (device_cpu_no_kernels) keep requires_grad and must be refused (issue 47).
        q, k, v = (t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    what = s.bad.get("what")
    ssa = s.op in SSA_OPS
    dev = q.device
    n, b = _scalar_params(s, dev if dev.type != "meta" else "cpu")
    kw: Dict[str, Any] = dict(causal=s.causal)
    scale = _bad_scale(what, s.bad.get("scale", s.scale))
    if scale is not None:
        kw["softmax_scale"] = scale
    dp = s.bad.get("dropout_p")
    if what == "dropout_negative":
        dp = -0.1
    elif what == "dropout_one":
        dp = 1.0
    elif what == "dropout_nan":
        dp = float("nan")
    if dp is not None:
        kw["dropout_p"] = dp
    keep = None
    if what in ("keep_mask", "keep_mask_float", "keep_mask_shape") and q.dim() == 4 and k.dim() == 4:
        shp = (q.shape[0], 1, q.shape[2], k.shape[2])
        if what == "keep_mask_shape":
            shp = (q.shape[0], 1, q.shape[2] + 1, k.shape[2])
        keep = torch.rand(shp, generator=gen).to(dev if dev.type != "meta" else "cpu") > 0.3
        if what == "keep_mask_float":
            keep = keep.float()
        kw["keep_mask"] = keep
    if what == "n_missing":
        n = None
    elif what == "b_missing":
        b = None
    elif what == "n_float":
        n = 1.5
    elif what == "n_shape":
        n = torch.tensor([1.5, 2.0], requires_grad=True, device=n.device)
    elif what == "n_int":
        n = torch.tensor([1], device=n.device)
    elif what == "n_device":
        n = torch.tensor([1.5], device="meta")
    if what == "not_tensor":
        q = q.tolist() if q.device.type != "meta" and q.numel() < 5000 else "q"
    if ssa:
        args = (q, k, v, n, b)
    else:
        args = (q, k, v)
        if what == "softmax_with_n":
            kw["n"] = n
    leaves = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
            leaves[name] = t
    if ssa:
        for name, t in (("n", n), ("b", b)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                leaves[name] = t
    causal = s.causal

    def reference(L):
        from nemo_ssa.ops.attention.naive import attention_naive

        extra = dict(transform="ssa", n=L["n"], b=L["b"]) if ssa else dict(transform="softmax")
        sc = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
        return attention_naive(L["q"], L["k"], L["v"], causal=causal, softmax_scale=sc, keep_mask=keep, **extra)

    def eager(L):
        from nemo_ssa.ops.attention.naive import attention_naive

        extra = dict(transform="ssa", n=L["n"], b=L["b"]) if ssa else dict(transform="softmax")
        sc = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
        return attention_naive(L["q"], L["k"], L["v"], causal=causal, softmax_scale=sc, keep_mask=keep,
                               upcast=False, **extra)

    def terms(L64, go):
        from nemo_ssa.testing import attention_grad_terms

        sc = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
        extra = dict(transform="ssa", n=L64["n"], b=L64["b"]) if ssa else dict(transform="softmax")
        return attention_grad_terms(L64["q"], L64["k"], L64["v"], go, causal=causal, softmax_scale=sc,
                                    mask=keep, **extra)

    inp = Inputs(args=args, kwargs=kw, leaves=leaves, ref=reference, eager=eager, terms=terms)
    if s.kind.startswith("nan:") and isinstance(q, torch.Tensor):
        inp.nan_where = _nan_site(s, q, k, rng)
    return inp


def _nan_site(s: Spec, q, k, rng) -> Tuple[str, tuple]:
    which = s.kind.split(":")[1]
    if which == "q":  # a row that sees at least one key (causal rows i < Sq - Sk see none: output 0)
        lo = max(0, q.shape[2] - k.shape[2]) if s.causal else 0
        return "q", (rng.randrange(q.shape[0]), rng.randrange(q.shape[1]), rng.randrange(lo, q.shape[2]),
                     rng.randrange(q.shape[3]))
    # the last key: the last query row attends to it whatever the mask (causal: bottom-right)
    return which, (rng.randrange(k.shape[0]), rng.randrange(k.shape[1]), k.shape[2] - 1, rng.randrange(k.shape[3]))


def _build_varlen(s: Spec) -> Inputs:
    gen = torch.Generator().manual_seed(s.seed)
    rng = random.Random(s.seed)
    what = s.bad.get("what")
    dev = s.device
    if what == "device_meta":
        dev = "meta"
    elif what == "device_cpu_no_kernels" and s.device == "cuda":
        dev = "cpu"
    dtype = s.bad.get("dtype", s.dtype)
    if what == "dtype_fp64":
        dtype = torch.float64
    elif what == "dtype_bool":
        dtype = torch.bool
    elif what == "dtype_complex":
        dtype = torch.complex64
    lens = s.seqlens
    Tq, Tk = sum(a for a, _ in lens), sum(c for _, c in lens)
    Hq, Hkv, D = s.Hq, s.Hkv, s.D
    if what == "hkv_zero":
        Hkv = 0
    if what == "empty_q":
        Tq, lens = 0, [(0, c) for _, c in lens]
    if what == "empty_k":
        Tk, lens = 0, [(a, 0) for a, _ in lens]
    mk = (lambda shp: _make(shp, dtype, dev, gen)) if dev != "meta" else \
        (lambda shp: torch.empty(shp, dtype=dtype if dtype.is_floating_point else torch.float32, device="meta"))
    q, k, v = mk((Tq, Hq, D)), mk((Tk, Hkv, D)), mk((Tk, Hkv, D))
    if what == "kv_shape":
        v = mk((Tk + 1, Hkv, D))
    if q.is_floating_point() and dev != "meta":
        q, k, v = (t.requires_grad_() if t.is_floating_point() else t for t in (q, k, v))
    if what == "dtype_mixed":
        k = k.to(torch.float16 if q.dtype == torch.float32 else torch.float32)
    if what == "device_mixed":
        k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    if what == "q_4d" or what == "ndim5":
        q = q[None]
    if what == "ndim3":
        q = q[0]
    if s.layout == "slice_d" and dev != "meta" and q.dim() == 3 and q.numel():
        q, k, v = (_layout(t.detach()[None], "slice_d", rng)[0].requires_grad_(t.requires_grad) for t in (q, k, v))
    elif s.layout == "thd_perm" and dev != "meta" and q.dim() == 3 and q.numel():  # [H, T, D] storage
        q, k, v = (t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(t.requires_grad)
                   for t in (q, k, v))
    cdev = dev if dev != "meta" else "cpu"
    cu_q = torch.tensor([0] + [sum(a for a, _ in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32,
                        device=cdev)
    cu_k = torch.tensor([0] + [sum(c for _, c in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32,
                        device=cdev)
    max_q, max_k = max(a for a, _ in lens), max(c for _, c in lens)
    if what == "cu_float":
        cu_q = cu_q.float()
    elif what == "cu_2d":
        cu_q = cu_q[None]
    elif what == "cu_len_mismatch":
        cu_k = torch.cat([cu_k, cu_k[-1:]])
    elif what == "cu_short":
        cu_q, cu_k = cu_q[:1], cu_k[:1]
    elif what == "cu_device":
        cu_q = cu_q.to("meta")
    elif what == "cu_not_tensor":
        cu_q = cu_q.tolist()
    if what == "max_seqlen_zero":
        max_q = 0
    ssa = s.op in SSA_OPS
    n, b = _scalar_params(s, cdev)
    if what == "n_missing":
        n = None
    elif what == "n_shape":
        n = torch.tensor([1.5, 2.0], requires_grad=True)
    elif what == "n_float":
        n = 1.5
    kw: Dict[str, Any] = dict(causal=s.causal)
    scale = _bad_scale(what, s.bad.get("scale", s.scale))
    if scale is not None:
        kw["softmax_scale"] = scale
    if what == "dropout_one":
        kw["dropout_p"] = 1.0
    elif what == "dropout_negative":
        kw["dropout_p"] = -0.1
    if what in ("keep_mask", "keep_mask_float", "keep_mask_shape"):
        kw["keep_mask"] = torch.ones(1, dtype=torch.bool)
    args = (q, k, v) + ((n, b) if ssa else ()) + (cu_q, cu_k, max_q, max_k)
    leaves = {nm: t for nm, t in (("q", q), ("k", k), ("v", v))
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta"}
    if ssa:
        leaves.update({nm: t for nm, t in (("n", n), ("b", b)) if isinstance(t, torch.Tensor) and t.requires_grad})
    causal = s.causal
    sc = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None

    def per_seq(fn, L, **extra_kw):
        from nemo_ssa.ops.attention.naive import attention_naive

        outs = []
        extra = dict(transform="ssa", n=L["n"], b=L["b"]) if ssa else dict(transform="softmax")
        for i, (lq, lk) in enumerate(lens):
            sq_ = slice(int(cu_q[i]), int(cu_q[i]) + lq)
            sk_ = slice(int(cu_k[i]), int(cu_k[i]) + lk)
            if lq == 0:
                continue
            if lk == 0:  # rows that see no key: 0 (the kernels' contract)
                outs.append(L["q"][sq_] * 0)
                continue
            one = lambda t, sl: t[sl].transpose(0, 1)[None]  # noqa: E731
            o = attention_naive(one(L["q"], sq_), one(L["k"], sk_), one(L["v"], sk_), causal=causal, softmax_scale=sc,
                                **extra, **extra_kw)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs) if outs else L["q"][:0]

    def terms(L64, go):  # noqa: F811 - varlen: per-sequence terms, summed (norms in quadrature)
        from nemo_ssa.testing import attention_grad_terms

        tot: Dict[str, float] = {}
        sq2: Dict[str, float] = {}
        for i, (lq, lk) in enumerate(lens):
            if lq == 0 or lk == 0:
                continue
            sq_ = slice(int(cu_q[i]), int(cu_q[i]) + lq)
            sk_ = slice(int(cu_k[i]), int(cu_k[i]) + lk)
            one = lambda t, sl: t[sl].transpose(0, 1)[None]  # noqa: E731
            extra = dict(transform="ssa", n=L64["n"], b=L64["b"]) if ssa else dict(transform="softmax")
            t = attention_grad_terms(one(L64["q"], sq_), one(L64["k"], sk_), one(L64["v"], sk_), one(go, sq_),
                                     causal=causal, softmax_scale=sc, **extra)
            for key, val in t.items():
                if key in ("dq", "dk", "dv"):
                    sq2[key] = sq2.get(key, 0.0) + val ** 2
                else:
                    tot[key] = tot.get(key, 0.0) + val
        tot.update({key: math.sqrt(val) for key, val in sq2.items()})
        return tot

    inp = Inputs(args=args, kwargs=kw, leaves=leaves, ref=lambda L: per_seq(None, L),
                 eager=lambda L: per_seq(None, L, upcast=False), terms=terms)
    if s.kind.startswith("nan:") and isinstance(q, torch.Tensor) and q.dim() == 3:
        which = s.kind.split(":")[1]
        live = [i for i, (lq, lk) in enumerate(lens) if lq > 0 and lk > 0]
        i = rng.choice(live)
        if which == "q":
            row = int(cu_q[i]) + rng.randrange(lens[i][0])
            inp.nan_where = ("q", (row, rng.randrange(Hq), rng.randrange(D)))
        else:
            inp.nan_where = (which, (int(cu_k[i]) + lens[i][1] - 1, rng.randrange(Hkv), rng.randrange(D)))
        inp.isolation = ("varlen", i, cu_q, cu_k, lens)
    return inp


def _build_nsa(s: Spec) -> Inputs:
    from nemo_ssa.ops.nsa import NSAConfig, init_phi_params

    gen = torch.Generator().manual_seed(s.seed)
    rng = random.Random(s.seed)
    what = s.bad.get("what")
    cfg_kw = dict(s.nsa_cfg)
    if what == "cfg_invalid":
        cfg_kw.update(rng.choice([dict(stride=cfg_kw["block_len"] + 1), dict(top_n=2), dict(compress="max"),
                                  dict(window=0), dict(select_block=1.5), dict(separate_kv="yes")]))
    cfg = NSAConfig(**cfg_kw)  # may raise ValueError: that is the refusal under test
    q, k, v = _dense_tensors(s, gen, rng)
    dev = q.device
    dtype = q.dtype
    N = q.shape[2] if q.dim() == 4 else 1
    gshape = (q.shape[0], q.shape[1], N, 3) if q.dim() == 4 else (1, 1, 1, 3)
    if what == "gates_shape":
        gshape = gshape[:-1] + (2,)
    gates = (torch.randn(*gshape, generator=gen) * 2).to(
        device=dev if dev.type != "meta" else "cpu",
        dtype=dtype if dtype.is_floating_point else torch.float32)
    if what == "gates_dtype":
        gates = gates.to(torch.float16 if dtype == torch.float32 else torch.float32)
    gates.requires_grad_()
    D = q.shape[-1] if q.dim() >= 1 else 16
    kw: Dict[str, Any] = dict(impl="triton")
    phi = None
    if cfg.compress == "mlp" and what != "phi_missing" and dev.type != "meta" and dtype.is_floating_point:
        phi = [init_phi_params(cfg, D, dtype=dtype, device=dev, generator=gen, std=0.3, requires_grad=True)
               for _ in range(2)]
        kw.update(phi_k=phi[0], phi_v=phi[1])
    if what == "kslc_shape" and q.dim() == 4:
        kw["k_slc"] = k[:, :, :-1] if k.shape[2] > 1 else k[:, :, :0]
    if what == "nsa_kv_heads" and q.dim() == 4:
        kw["k_slc"] = torch.cat([k, k], 1)
        kw["v_slc"] = torch.cat([v, v], 1)
    if what == "impl_unknown":
        kw["impl"] = "cuda"
    elif what == "impl_stage":
        kw["impl"] = {"gates": "torch"}
    if what == "nsa_fp64_triton":
        q, k, v, gates = (t.detach().double().requires_grad_() if t.device.type != "meta" else t
                          for t in (q, k, v, gates))
    ssa = s.op in SSA_OPS
    transform = "ssa" if ssa else "softmax"
    if what == "transform_unknown":
        transform = "relu"
    kw["transform"] = transform
    n, b = _scalar_params(s, dev if dev.type != "meta" else "cpu")
    if ssa and what not in ("n_missing",):
        kw.update(n=n, b=b)
    scale = _bad_scale(what, s.bad.get("scale", s.scale))
    if scale is not None:
        kw["softmax_scale"] = scale
    args = (q, k, v, gates, cfg)
    leaves = {nm: t for nm, t in (("q", q), ("k", k), ("v", v), ("gates", gates))
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta"}
    if ssa and "n" in kw:
        leaves.update(n=n, b=b)
    if phi is not None:
        for w, p in zip(("phi_k", "phi_v"), phi):
            for fname, t in zip(p._fields, p):
                leaves[f"{w}.{fname}"] = t
    sc = scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None

    def _phis(L):
        if phi is None:
            return {}
        from nemo_ssa.ops.nsa import PhiParams

        return {w: PhiParams(*(L[f"{w}.{f}"] for f in PhiParams._fields)) for w in ("phi_k", "phi_v")}

    holder: Dict[str, Any] = {}

    def ref(L, upcast=True):
        from nemo_ssa.ops.nsa import nsa_attention_naive

        extra = dict(transform=transform, n=L.get("n"), b=L.get("b")) if ssa else dict(transform=transform)
        out, aux = nsa_attention_naive(L["q"], L["k"], L["v"], L["gates"], cfg, softmax_scale=sc, upcast=upcast,
                                       block_idx=holder.get("idx"), return_aux=True, **extra, **_phis(L))
        holder.setdefault("idx", aux["block_idx"])
        holder.setdefault("aux", aux)
        return out

    def terms(L64, go):
        from nemo_ssa.testing import nsa_grad_terms

        extra = dict(transform=transform, n=L64.get("n"), b=L64.get("b")) if ssa else dict(transform=transform)
        return nsa_grad_terms(L64["q"], L64["gates"], cfg, go, holder["aux"], k=L64["k"], v=L64["v"], k_slc=L64["k"],
                              v_slc=L64["v"], k_win=L64["k"], v_win=L64["v"], softmax_scale=sc, **extra)

    def extra_terms(L64, go, t):
        """|terms| scale of the φ and gate gradients: φ receives the compressed keys' and
        values' gradients, whose rounding (|terms| arrays ``t``, independent signs) it maps
        linearly -- propagated with random signs, x3; gates: sigmoid' x sum_d |do| |o_c|."""
        from nemo_ssa.ops.nsa import PhiParams, compress_kv

        out: Dict[str, float] = {}
        g = torch.Generator().manual_seed(s.seed + 7)
        if phi is not None and "k_cmp_terms" in t:
            for w, src, key in (("phi_k", "k", "k_cmp_terms"), ("phi_v", "v", "v_cmp_terms")):
                p64 = PhiParams(*(L64[f"{w}.{f}"] for f in PhiParams._fields))
                kc = compress_kv(L64[src].to(F64), cfg, p64)
                sign = torch.randint(0, 2, kc.shape, generator=g).to(kc) * 2 - 1
                gs = torch.autograd.grad(kc, list(p64), t[key] * sign, allow_unused=True)
                for f, gg in zip(PhiParams._fields, gs):
                    out[f"{w}.{f}"] = 3.0 * (gg.norm().item() if gg is not None else 0.0)
        aux = holder["aux"]
        sg = torch.sigmoid(L64["gates"].detach())
        parts = [aux[f"o_{c}"].detach().abs() for c in ("cmp", "slc", "win")]
        tg = torch.stack([(go.abs() * o).sum(-1) for o in parts], -1) * sg * (1 - sg)
        out["gates"] = tg.norm().item()
        return out

    inp = Inputs(args=args, kwargs=kw, leaves=leaves, ref=lambda L: ref(L), eager=lambda L: ref(L, upcast=False),
                 terms=terms)
    inp.extra_terms = extra_terms  # type: ignore[attr-defined]
    inp.nsa_holder = holder  # type: ignore[attr-defined]
    if s.kind.startswith("nan:") and q.dim() == 4:
        inp.nan_where = _nan_site(s, q, k, rng)
    return inp


# ---------------------------------------------------------------------------- calling
def call_op(op: str, inp: Inputs, block_idx=None):
    if op in NSA_OPS:
        from nemo_ssa.ops.nsa import nsa_attention

        kw = dict(inp.kwargs)
        if block_idx is not None:
            kw["block_idx"] = block_idx
        return nsa_attention(*inp.args, **kw)
    from nemo_ssa.ops.registry import get_attention_fn

    fn = get_attention_fn(*REGISTRY[op])
    kw = dict(inp.kwargs)
    if op == "ssa_flex":
        kw.setdefault("compile", "auto")
    return fn(*inp.args, **kw)


def _refusal_ok(e: BaseException) -> bool:
    msg = str(e).lower()
    return any(w in msg for w in REFUSAL_WORDS)


def _leaves_for_grad(op: str, inp: Inputs, device: str):
    leaves = dict(inp.leaves)
    if op == "ssa_flex" and device == "cpu":  # flex: no q/k/v backward on CPU (n, b only)
        leaves = {k: v for k, v in leaves.items() if k in ("n", "b")}
    return leaves


def _numeric_check(s: Spec, inp: Inputs, out: torch.Tensor, grads: Dict[str, torch.Tensor], go) -> str:
    """'' when out/grads match the float64 reference by the 2x-eager rule, else a reason."""
    from nemo_ssa.testing import SCALAR_GRAD_RTOL, rel_err

    dt = out.dtype
    L64 = {k: v.detach().to(F64).requires_grad_() for k, v in inp.leaves.items()}
    Le = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inp.leaves.items()}
    ref = inp.ref(L64)
    eag = inp.eager(Le)
    if ref.shape != out.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if not torch.isfinite(ref).all():
        return "" if not torch.isfinite(out).all() else "reference non-finite, op finite"
    if not torch.isfinite(out).all():
        return "non-finite output (reference finite)"
    e_err = rel_err(eag, ref) if torch.isfinite(eag).all() else math.inf
    if not math.isfinite(e_err):  # 16-bit eager overflowed: compare with fp32 eager instead
        Lf = {k: v.detach().float().requires_grad_(v.requires_grad) for k, v in inp.leaves.items()}
        eag = inp.eager(Lf)
        e_err = rel_err(eag, ref)
        Le = Lf
    # the kernels keep transformed logits z2 (log2 units) in fp32 and recompute p in the
    # backward from a differently ordered dot: p carries ~ulp(max |z2|) relative error,
    # 1e-4 at |s| = 1.4e3 (eager rounds s once and gets p = 1 exactly on one-hot rows)
    kappa = 4.0 * 2.0 ** -24 * _z2_max(s, L64)
    o_err = rel_err(out, ref)
    if not o_err <= 2 * e_err + O_FLOOR.get(dt, 1e-5) + kappa:
        return f"o rel err {o_err:.2e} > 2 x eager {e_err:.2e} + {O_FLOOR.get(dt, 1e-5):g} + {kappa:.1e}"
    if not grads:
        return ""
    names = list(grads)
    r_g = torch.autograd.grad(ref, [L64[k] for k in names], go.to(F64), allow_unused=True)
    e_leaves = [Le[k] for k in names]
    e_g = torch.autograd.grad(eag, e_leaves, go.to(eag.dtype), allow_unused=True)
    terms = inp.terms(L64, go.to(F64)) if inp.terms is not None else {}
    if getattr(inp, "extra_terms", None) is not None:
        terms = dict(terms, **inp.extra_terms(L64, go.to(F64), terms))
    rtol = SCALAR_GRAD_RTOL.get(dt, 2e-5)
    for name, r, e in zip(names, r_g, e_g):
        g = grads[name]
        if r is None:
            r = torch.zeros_like(g, dtype=F64)
        if e is None:
            e = torch.zeros_like(g)
        if g.shape != r.shape:
            return f"d{name} shape {tuple(g.shape)} != {tuple(r.shape)}"
        if not torch.isfinite(g).all():
            return f"non-finite d{name}"
        err = torch.linalg.vector_norm(g.double() - r).item()
        e_abs = torch.linalg.vector_norm(e.double() - r).item() if torch.isfinite(e).all() else 0.0
        t = terms.get(f"d{name}_split", 0.0) if name in ("n", "b") else terms.get(name, terms.get("d" + name, 0.0))
        if name == "phi_k.b2" and s.op == "nsa":
            continue  # a shift of every compressed key: softmax-invariant, true gradient 0 (test_nsa.py)
        bound = 2 * e_abs + O_FLOOR.get(dt, 1e-5) * torch.linalg.vector_norm(r).item() + (rtol + kappa) * t + 1e-12
        if not err <= bound:
            return f"d{name} err {err:.3e} > bound {bound:.3e} (eager {e_abs:.2e}, |terms| {t:.2e})"
    return ""


def _z2_max(s: Spec, L64: Dict[str, torch.Tensor]) -> float:
    """max |transformed logit| in log2 units over all (query, key) pairs (an upper bound)."""
    q, k = L64["q"].detach(), L64["k"].detach()
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    if s.op in VARLEN_OPS:
        qn, kn = q.norm(dim=-1).max().item(), k.norm(dim=-1).max().item()
        smax = qn * kn
    else:
        group = max(1, q.shape[1] // max(1, k.shape[1]))
        smax = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)).abs().max().item()
    sc = s.scale if isinstance(s.scale, float) else 1.0 / math.sqrt(q.shape[-1])
    smax *= sc
    if s.op in SSA_OPS:
        return abs(s.n) * math.log2(1.0 + abs(s.b) * smax)
    return smax / math.log(2.0)


def _nan_check(s: Spec, inp: Inputs, device: str) -> str:
    """The NaN contract (module docstring): isolation and detection. '' if it holds."""
    name, idx = inp.nan_where
    leaves = _leaves_for_grad(s.op, inp, device)
    block_idx = None
    if s.op in NSA_OPS:  # one selection for both runs (a NaN changes the selection scores)
        with torch.no_grad():
            _, aux = call_op(s.op, Inputs(inp.args, dict(inp.kwargs, return_aux=True), {}, None, None, None))
        block_idx = aux["block_idx"]
    clean = call_op(s.op, inp, block_idx)
    go = torch.ones_like(clean)
    g_clean = torch.autograd.grad(clean, list(leaves.values()), go, allow_unused=True) if leaves else ()
    pos = {"q": 0, "k": 1, "v": 2}[name]
    poisoned = inp.args[pos].detach().clone()
    poisoned[idx] = float("nan")
    if inp.args[pos].requires_grad:
        poisoned.requires_grad_()
    args = list(inp.args)
    args[pos] = poisoned
    inp2 = Inputs(tuple(args), inp.kwargs, dict(inp.leaves), None, None, None)
    if name in inp2.leaves:
        inp2.leaves[name] = poisoned
    leaves2 = _leaves_for_grad(s.op, inp2, device)
    dirty = call_op(s.op, inp2, block_idx)
    g_dirty = torch.autograd.grad(dirty, list(leaves2.values()), go, allow_unused=True) if leaves2 else ()
    varlen = s.op in VARLEN_OPS
    # which (batch, head) / rows are allowed to change
    if varlen:
        _, i, cu_q, cu_k, lens = inp.isolation
        q0, q1 = int(cu_q[i]), int(cu_q[i]) + lens[i][0]
        k0, k1 = int(cu_k[i]), int(cu_k[i]) + lens[i][1]
        keep_q = torch.ones(clean.shape[0], dtype=torch.bool)
        keep_q[q0:q1] = False
        keep_k = torch.ones(inp.args[1].shape[0], dtype=torch.bool)
        keep_k[k0:k1] = False
        sel = {"o": (keep_q,), "q": (keep_q,), "k": (keep_k,), "v": (keep_k,)}
        row_check = (idx[0], idx[1]) if name == "q" else (q1 - 1, None)
    else:
        bq, hq = clean.shape[0], clean.shape[1]
        hkv = inp.args[1].shape[1]
        group = hq // hkv
        b0, h0 = idx[0], idx[1]
        g0 = h0 // group if name == "q" else h0
        keep_bh_q = torch.ones(bq, hq, dtype=torch.bool)
        keep_bh_q[b0, g0 * group:(g0 + 1) * group] = False
        keep_bh_k = torch.ones(bq, hkv, dtype=torch.bool)
        keep_bh_k[b0, g0] = False
        sel = {"o": (keep_bh_q,), "q": (keep_bh_q,), "k": (keep_bh_k,), "v": (keep_bh_k,)}
        row_check = (b0, h0, idx[2]) if name == "q" else (b0, g0 * group, clean.shape[2] - 1)
    exact = s.op not in NSA_OPS or device == "cpu"  # NSA's GPU kernels accumulate with atomics

    def same(a, b_):
        if exact:
            return torch.equal(a, b_)
        return torch.allclose(a, b_, rtol=1e-5, atol=1e-6)

    m = sel["o"][0]
    if not (torch.isfinite(dirty[m]).all() and same(dirty[m], clean[m])):
        return "NaN leaked into another (batch, kv group) / sequence of the output"
    for nm, gc, gd in zip(leaves, g_clean, g_dirty):
        if nm not in sel or gc is None or gd is None:
            continue
        mm = sel[nm][0]
        if not (torch.isfinite(gd[mm]).all() and same(gd[mm], gc[mm])):
            return f"NaN leaked into d{nm} of another (batch, kv group) / sequence"
    if varlen:
        r_, h_ = row_check
        rowv = dirty[r_] if h_ is None else dirty[r_, h_]
    else:
        rowv = dirty[row_check]
    if torch.isfinite(rowv).all():
        return f"NaN in {name} vanished: row {row_check} is finite"
    return ""


#: print a crashing case's traceback (``--only IDX``: one case re-run to be looked at)
_PRINT_TRACEBACKS = False


def run_case(s: Spec, time_limit: float = 60.0) -> CaseResult:
    """Build and run one case; classify it as correct / refused / failed."""
    t0 = time.time()
    res = CaseResult(idx=-1, op=s.op, kind=s.kind, outcome="failed", desc=s.describe())
    old = None
    use_alarm = hasattr(signal, "SIGALRM") and time_limit > 0
    if use_alarm:
        def _alarm(signum, frame):
            raise _Timeout()
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        try:
            inp = build(s)
        except (ValueError, NotImplementedError) as e:  # e.g. NSAConfig refusing its arguments
            res.outcome, res.detail = ("refused", _short(e)) if _refusal_ok(e) else \
                ("failed", "refusal names no supported set: " + _short(e))
            return res
        try:
            if s.kind.startswith("nan:") and inp.nan_where is not None:
                why = _nan_check(s, inp, s.device)
                res.outcome, res.detail = ("correct", "NaN contract") if not why else ("failed", why)
                return res
            leaves = _leaves_for_grad(s.op, inp, s.device)
            out = call_op(s.op, inp)
            if s.op in NSA_OPS and isinstance(out, torch.Tensor) and not s.bad:
                # compare on the reference's selection (fp near-ties may pick other blocks)
                inp.ref({k: v.detach().to(F64).requires_grad_() for k, v in inp.leaves.items()})
                out = call_op(s.op, inp, block_idx=inp.nsa_holder["idx"])  # type: ignore[attr-defined]
        except (ValueError, NotImplementedError) as e:
            res.outcome, res.detail = ("refused", _short(e)) if _refusal_ok(e) else \
                ("failed", "refusal names no supported set: " + _short(e))
            return res
        # the op returned: it must agree with the reference (which must accept the input too)
        if not isinstance(out, torch.Tensor):
            res.detail = f"returned {type(out).__name__}"
            return res
        if out.device.type == "meta":
            res.outcome, res.detail = ("correct", "meta in, meta out") if s.op not in KERNEL_OPS else \
                ("failed", "kernel accepted meta tensors")
            return res
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(s.seed + 1)).to(out.device, out.dtype) \
            if out.is_floating_point() else None
        grads = {}
        if leaves and go is not None and out.requires_grad:
            gs = torch.autograd.grad(out, list(leaves.values()), go, allow_unused=True)
            grads = {k: g for k, g in zip(leaves, gs) if g is not None}
        try:
            why = _numeric_check(s, inp, out, grads, go)
        except (ValueError, NotImplementedError) as e:
            res.detail = f"accepted an input the reference refuses ({_short(e)})"
            return res
        res.outcome, res.detail = ("correct", "") if not why else ("failed", why)
        return res
    except _Timeout:
        res.outcome, res.detail = "failed", f"hang: over {time_limit:.0f} s"
        return res
    except _BadCase:
        res.outcome, res.detail = "skipped", "impossible combination"
        return res
    except Exception as e:  # noqa: BLE001 - the point: any other exception is a failure
        res.outcome = "failed"
        res.detail = f"crash {type(e).__name__}: {_short(e)}"
        if _PRINT_TRACEBACKS:
            traceback.print_exc()
        return res
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        res.seconds = time.time() - t0


def _short(e: BaseException, n: int = 240) -> str:
    return " ".join(str(e).split())[:n]


def case_rng(seed: int, i: int) -> random.Random:
    return random.Random(seed * 1_000_003 + i)


def run_fuzz(cases: int, device: str = "cpu", seed: int = 0, time_budget: Optional[float] = None,
             time_limit: float = 60.0, ops: Optional[List[str]] = None, progress: bool = False,
             first: int = 0, on_result=None) -> List[CaseResult]:
    """Run cases ``first .. first+cases-1`` (or until ``time_budget`` seconds); returns their
    results. ``on_result(results)`` after each case (the CLI rewrites its report there, so a
    command killed at a device limit still leaves what ran)."""
    torch_state = torch.random.get_rng_state()
    out: List[CaseResult] = []
    t0 = time.time()
    try:
        for i in range(first, first + cases):
            if time_budget is not None and time.time() - t0 > time_budget:
                break
            rng = case_rng(seed, i)
            s = gen_spec(rng, device, op=rng.choice(ops) if ops else None)
            r = run_case(s, time_limit)
            if r.outcome == "failed" and r.detail.startswith("hang") and device != "cpu":
                # On a GPU the first case of a kernel variant includes its Triton compiles
                # (an NSA case compiles about ten kernels): run it once more with the
                # compiles now cached and a longer limit. A real hang still fails.
                first = r.seconds
                r = run_case(s, 4 * time_limit)
                if not r.detail.startswith("hang"):
                    r.detail = (r.detail + "; " if r.detail else "") + \
                        f"first attempt over {first:.0f} s (compiling), re-run took {r.seconds:.0f} s"
            r.idx = i
            out.append(r)
            if on_result is not None:
                on_result(out)
            if progress and (i + 1) % 50 == 0:
                c = summarize(out)["total"]
                print(f"[fuzz] {i + 1} cases, {time.time() - t0:.0f} s: {c}", flush=True)
    finally:
        torch.random.set_rng_state(torch_state)
    return out


def summarize(results: List[CaseResult]) -> Dict[str, Dict[str, int]]:
    """Counts per op and in total: tried, correct, refused, failed."""
    table: Dict[str, Dict[str, int]] = {}
    for r in results:
        if r.outcome == "skipped":
            continue
        for key in (r.op, "total"):
            row = table.setdefault(key, dict(tried=0, correct=0, refused=0, failed=0))
            row["tried"] += 1
            row[r.outcome] += 1
    return table


def markdown(results: List[CaseResult], device: str, seed: int, cmd: str, seconds: float) -> str:
    table = summarize(results)
    kinds: Dict[str, Dict[str, int]] = {}
    for r in results:
        k = r.kind.split(":")[0]
        row = kinds.setdefault(k, dict(tried=0, correct=0, refused=0, failed=0))
        row["tried"] += 1
        row[r.outcome] = row.get(r.outcome, 0) + 1
    dev = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else \
        "CPU (Triton interpreter)"
    lines = [f"# Ops fuzz ({dev}, {time.strftime('%Y-%m-%d')})", "",
             f"`{cmd}` -- torch {torch.__version__}, seed {seed}, {len(results)} cases"
             + (f" ({results[0].idx}..{results[-1].idx})" if results else "") + f" in {seconds:.0f} s", "",
             "| op | tried | correct | refused | failed |", "|---|---|---|---|---|"]
    for op in OPS + ["total"]:
        if op in table:
            t = table[op]
            name = f"**{op}**" if op == "total" else op
            lines.append(f"| {name} | {t['tried']} | {t['correct']} | {t['refused']} | {t['failed']} |")
    lines += ["", "| case kind | tried | correct | refused | failed |", "|---|---|---|---|---|"]
    for k in sorted(kinds):
        t = kinds[k]
        lines.append(f"| {k} | {t['tried']} | {t.get('correct', 0)} | {t.get('refused', 0)} | {t.get('failed', 0)} |")
    fails = [r for r in results if r.outcome == "failed"]
    if fails:
        lines += ["", "## Failures (re-run one: `python -m nemo_ssa.testing.ops_fuzz --device DEV --seed S --only IDX`)", ""]
        lines += [f"- case {r.idx} `{r.op}` {r.kind}: {r.detail} -- {r.desc}" for r in fails[:100]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=600)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-case", type=int, default=0,
                    help="start at case K of the seed's sequence (continue an earlier, time-limited call)")
    ap.add_argument("--time-budget", type=float, default=None, help="stop starting new cases after this many s")
    ap.add_argument("--time-limit", type=float, default=60.0, help="per-case limit (a case past it is a hang)")
    ap.add_argument("--ops", default=None, help="comma-separated subset of " + ",".join(OPS))
    ap.add_argument("--only", type=int, default=None, help="run case IDX alone, with its traceback")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.device == "cpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("[fuzz] --device cpu on a CUDA machine: the kernels must refuse CPU tensors (set "
              "TRITON_INTERPRET=1 to run them in the interpreter instead)", file=sys.stderr)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    ops = args.ops.split(",") if args.ops else None
    if args.only is not None:
        global _PRINT_TRACEBACKS
        _PRINT_TRACEBACKS = True  # one case re-run: its crash in full
        rng = case_rng(args.seed, args.only)
        s = gen_spec(rng, args.device, op=rng.choice(ops) if ops else None)
        print(f"[fuzz] case {args.only}: {s.op} {s.kind} -- {s.describe()}")
        r = run_case(s, args.time_limit)
        print(f"[fuzz] {r.outcome}: {r.detail} ({r.seconds:.2f} s)")
        return 0 if r.outcome != "failed" else 1
    t0 = time.time()
    cmd = "python -m nemo_ssa.testing.ops_fuzz " + " ".join(argv if argv is not None else sys.argv[1:])

    def write(results) -> str:
        md = markdown(results, args.device, args.seed, cmd, time.time() - t0)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".tmp", "w") as f:
                f.write(md)
            os.replace(args.out + ".tmp", args.out)
        return md

    results = run_fuzz(args.cases, args.device, args.seed, args.time_budget, args.time_limit, ops, progress=True,
                       first=args.first_case, on_result=write if args.out else None)
    print(write(results))
    return 0 if summarize(results).get("total", {}).get("failed", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
