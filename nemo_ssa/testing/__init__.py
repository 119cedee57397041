"""Tolerance helpers and input factories shared by tests and benchmarks (torch only).

The tolerance rule (flash-attention's): a kernel's error against an fp32/fp64 reference
may be at most twice the error of the *eager same-dtype* implementation against that same
reference (``attention_naive(..., upcast=False)``), plus a small absolute floor for the
case where eager happens to be exact. Errors are relative Frobenius norms in float64.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

__all__ = [
    "rel_err",
    "make_qkv",
    "case_id",
    "poison_",
    "assert_within_2x_eager",
    "attention_grad_terms",
    "assert_grad_close_to_terms",
    "ssa_scalar_grad_terms",
    "ssa_scalar_grad_terms_varlen",
    "nsa_grad_terms",
    "nsa_scalar_grad_terms",
    "assert_scalar_grad_close",
    "SCALAR_GRAD_RTOL",
    "DTYPE_NAMES",
]

DTYPE_NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` computed in float64.

    When ``ref`` is exactly zero the absolute error ``||x||`` is returned instead (so
    two zero tensors give 0.0, and anything else is measured as-is). NaN/Inf anywhere in
    ``x`` gives NaN/Inf, which fails every ``<=`` comparison.
    """
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs ref {tuple(ref.shape)}")
    x64 = x.detach().to(torch.float64)
    r64 = ref.detach().to(torch.float64)
    num = torch.linalg.vector_norm(x64 - r64).item()
    den = torch.linalg.vector_norm(r64).item()
    return num if den == 0.0 else num / den


def make_qkv(
    B: int,
    Hq: int,
    Hkv: int,
    Sq: int,
    Sk: int,
    D: int,
    dtype: torch.dtype,
    device="cpu",
    seed: Optional[int] = None,
    requires_grad: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh standard-normal ``q [B,Hq,Sq,D]``, ``k, v [B,Hkv,Sk,D]`` (leaf tensors).

    ``seed=None`` draws from the default RNG (fresh inputs per call); an int uses a private
    generator so the global RNG is untouched. Sampled in fp32, then cast to ``dtype``.
    """
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(int(seed))

    def one(h: int, s: int) -> torch.Tensor:
        t = torch.randn(B, h, s, D, generator=gen, dtype=torch.float32)
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    return one(Hq, Sq), one(Hkv, Sk), one(Hkv, Sk)


def case_id(B, Sq, Hq, Hkv, D, causal, dtype, Sk: Optional[int] = None) -> str:
    """Readable pytest id, e.g. ``B2-T63-HQ6-HKV2-D32-causal-fp32``.

    ``Sk`` (optional) is shown as ``-TK{Sk}`` after ``T{Sq}`` when it differs from ``Sq``.
    """
    t = f"T{Sq}" if Sk is None or Sk == Sq else f"T{Sq}-TK{Sk}"
    dname = DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    return f"B{B}-{t}-HQ{Hq}-HKV{Hkv}-D{D}-{'causal' if causal else 'full'}-{dname}"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a floating tensor with NaN in place (catches outputs a kernel never writes)."""
    if not t.is_floating_point():
        raise ValueError(f"poison_ needs a floating tensor, got {t.dtype}")
    with torch.no_grad():
        t.fill_(math.nan)
    return t


def assert_within_2x_eager(
    out: torch.Tensor,
    eager: torch.Tensor,
    ref: torch.Tensor,
    name: str = "out",
    floor: float = 1e-5,
    factor: float = 2.0,
) -> Dict[str, float]:
    """Assert ``rel_err(out, ref) <= factor * rel_err(eager, ref) + floor``.

    Args:
        out: the implementation under test (e.g. a fused kernel's output or a gradient).
        eager: the eager same-dtype implementation's result for the same inputs.
        ref: the fp32/fp64 anchor.
        name: what is compared (shows up in the failure message).
        floor: absolute slack on the relative error (eager can be exact by luck).
        factor: 2.0 is the rule; benchmarks may report with other factors.

    Returns:
        ``{"err": ..., "eager_err": ..., "bound": ...}`` for logging.
    """
    err = rel_err(out, ref)
    eager_err = rel_err(eager, ref)
    bound = factor * eager_err + floor
    ok = math.isfinite(err) and err <= bound
    if not ok:
        raise AssertionError(
            f"{name}: rel err {err:.3e} > {factor:g} x eager rel err {eager_err:.3e} "
            f"+ floor {floor:.1e} (= {bound:.3e})"
        )
    return {"err": err, "eager_err": eager_err, "bound": bound}


# Scalar gradients (dn, db) are sums over every score of terms of both signs. Their value
# may cancel to near zero while each term is O(1), so a bound relative to the value tests
# the draw, not the kernel (a correct db of -0.0014 fails a 1e-4 relative bound on an
# unlucky draw). The bound below scales with the sum of |terms| instead -- the quantity
# every term's rounding error is proportional to -- so it is as tight on every draw and
# still fails a wrong formula (a dropped sign or factor moves the sum by a fraction of
# sum|terms|, orders of magnitude above these tolerances; see the negative controls in
# tests/ops/attention/test_flash.py).
#: relative tolerance on ``|got - ref| / sum|terms|`` by input dtype (the floor; 16-bit
#: inputs also pass when within 2x of the eager same-dtype error)
SCALAR_GRAD_RTOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def attention_grad_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    go: torch.Tensor,
    *,
    transform: str = "ssa",
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    mask: Optional[torch.Tensor] = None,
    arrays: bool = False,
) -> Dict[str, object]:
    """The |terms| scale of every gradient of (SSA or softmax) attention, in float64.

    ``dz = p (dp - delta)`` is a difference of two terms per score (``p dp`` and
    ``p delta``, ``delta = sum_j p dp``); every gradient is a sum over scores of ``dz``
    times a factor, so its rounding error (and that of any implementation) scales with
    the same sum taken over absolute values. Returns ``{"dn", "db"}`` (SSA: sums of
    |terms|, ``"dn_sum"``, ``"db_sum"`` the signed sums, ``"dn_split"``, ``"db_split"`` the
    sums with ``dz`` split into its two terms, ``|g| (p |dp| + p |delta|)``: the rounding
    scale even where ``dz`` vanishes exactly, e.g. a row with one visible key) and
    ``{"dq", "dk", "dv"}``:
    Frobenius norms of the |terms| arrays ``scale |dz/ds| (p |dp| + p |delta|) @ |k|``
    (dq), the transpose with ``|q|`` (dk, summed over each GQA group) and ``p^T |go|``
    (dv) -- the natural size of the gradient even where the true one vanishes (a one-hot
    row has dz = 0 exactly, but rounding of p leaves ~eps of those terms). ``arrays=True``
    returns the |terms| arrays instead of their norms. ``keep`` is a dropout keep-mask,
    ``mask`` an attention mask (True = may attend, broadcastable to ``[B, Hq, Sq, Sk]``,
    AND-ed with ``causal``).
    """
    dev = q.device  # fp64 on the inputs' device (a GPU test's model shape stays there)
    f = lambda t: t.detach().to(device=dev, dtype=torch.float64)  # noqa: E731
    q, k, v, go = f(q), f(k), f(v), f(go)
    ssa = transform == "ssa"
    n_, b_ = (float(f(n).reshape(-1)[0]), float(f(b).reshape(-1)[0])) if ssa else (1.0, 0.0)
    bsz, hq, sq, _ = q.shape
    sk = k.shape[2]
    group = hq // k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    vis = torch.ones(sq, sk, dtype=torch.bool, device=dev)
    if causal:
        vis = vis.tril(sk - sq)
    if mask is not None:
        vis = vis & mask.detach().to(device=dev, dtype=torch.bool)
    vis = vis.expand(bsz, hq, sq, sk)
    if keep is not None:
        keep = f(keep).expand(bsz, hq, sq, sk)
    acc = torch.zeros(6, dtype=torch.float64, device=dev)
    tq, tk, tv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # one (batch, head chunk) at a time: <= ~2^25 scores per temporary
    hc = max(1, min(hq, (1 << 25) // max(1, sq * sk)))
    for z0 in range(bsz):
        for h0 in range(0, hq, hc):
            h1 = min(hq, h0 + hc)
            heads = torch.arange(h0, h1, device=dev) // group
            kk, vv = k[z0, heads], v[z0, heads]
            s = (q[z0, h0:h1] @ kk.transpose(-1, -2)) * scale
            mag = torch.log1p(b_ * s.abs())
            smag = torch.where(s >= 0, mag, -mag)
            vc = vis[z0, h0:h1]
            row_any = vc.any(-1, keepdim=True)
            z = (n_ * smag if ssa else s).masked_fill(~vc, float("-inf")).masked_fill(~row_any, 0.0)
            p = torch.softmax(z, -1) * row_any
            dp = go[z0, h0:h1] @ vv.transpose(-1, -2)
            pd = p
            if keep is not None:
                dp = dp * keep[z0, h0:h1] / (1.0 - dropout_p)
                pd = p * keep[z0, h0:h1] / (1.0 - dropout_p)
            delta = (p * dp).sum(-1, keepdim=True)
            dz = p * (dp - delta)
            adz = p * (dp.abs() + delta.abs())  # |p dp| + |p delta| >= |dz|
            if ssa:
                hb = n_ * s / (1.0 + b_ * s.abs())
                gn = dz * smag
                gb = dz * hb
                acc += torch.stack([gn.abs().sum(), gb.abs().sum(), gn.sum(), gb.sum(),
                                    (adz * smag.abs()).sum(), (adz * hb.abs()).sum()])
            ads = adz * (n_ * b_ / (1.0 + b_ * s.abs()) if ssa else 1.0) * scale
            tq[z0, h0:h1] = ads @ kk.abs()
            tk[z0].index_add_(0, heads, ads.transpose(-1, -2) @ q[z0, h0:h1].abs())
            tv[z0].index_add_(0, heads, pd.transpose(-1, -2) @ go[z0, h0:h1].abs())
    out: Dict[str, object] = {}
    if ssa:
        out.update(zip(("dn", "db", "dn_sum", "db_sum", "dn_split", "db_split"), acc.tolist()))
    if arrays:
        out.update(dq=tq, dk=tk, dv=tv)
    else:
        out.update(dq=tq.norm().item(), dk=tk.norm().item(), dv=tv.norm().item())
    return out


def ssa_scalar_grad_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n: torch.Tensor,
    b: torch.Tensor,
    go: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    mask: Optional[torch.Tensor] = None,
    return_sums: bool = False,
) -> Tuple[float, ...]:
    """``(sum |dn terms|, sum |db terms|)`` of SSA attention, in float64.

    With ``s = scale q k^T``, ``z = n sgn(s) ln(1 + b|s|)``, ``p = softmax(z)`` (causal
    bottom-right, rows without a visible key contribute nothing), ``dp = go v^T``
    (times ``keep / (1 - dropout_p)`` with dropout) and ``dz = p (dp - sum_j p dp)``:
    ``dn = sum dz sgn(s) ln(1 + b|s|)`` and ``db = sum dz n s / (1 + b|s|)``. Returns the
    sums of the absolute values of those terms: the scale of the rounding error of any
    implementation of dn / db. The sums are taken with ``dz`` split into its two terms
    (``p |dp| + p |delta|``, ``attention_grad_terms``'s ``*_split``): a row with one
    visible key has ``dz = 0`` exactly in fp64, yet an fp32 kernel computes ``dp - delta``
    with an ~eps residue (an H100 run gave dn = 1e-15 against a bound of 0 at T=1).
    Dense ``[B, H, S, D]`` inputs (GQA as in the kernels).
    ``keep`` is a dropout keep-mask; ``mask`` an attention mask (bool, True = may attend,
    broadcastable to ``[B, Hq, Sq, Sk]``, AND-ed with ``causal``: documents, NSA branches).
    ``return_sums=True`` appends the signed sums ``(dn, db)`` themselves (tests of this
    helper compare them with autograd, so the terms are the right ones).
    """
    t = attention_grad_terms(q, k, v, go, transform="ssa", n=n, b=b, causal=causal, softmax_scale=softmax_scale,
                             keep=keep, dropout_p=dropout_p, mask=mask)
    out = (t["dn_split"], t["db_split"])
    return out + (t["dn_sum"], t["db_sum"]) if return_sums else out


def ssa_scalar_grad_terms_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n: torch.Tensor,
    b: torch.Tensor,
    go: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    keep: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    return_sums: bool = False,
) -> Tuple[float, ...]:
    """``ssa_scalar_grad_terms`` of a packed (THD) batch: the sum over its sequences.

    ``q, go [T_q, Hq, D]``, ``k, v [T_k, Hkv, D]``, ``cu_seqlens_*`` cumulative lengths;
    ``keep`` (dropout keep-mask) ``[T_q, Hq, >= max_k]``.
    """
    acc = [0.0] * 4
    cq, ck = [int(x) for x in cu_seqlens_q.cpu()], [int(x) for x in cu_seqlens_k.cpu()]
    for i in range(len(cq) - 1):
        sq, sk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        one = lambda t, sl: t[sl].transpose(0, 1)[None]  # noqa: E731
        keep_s = None if keep is None else keep[sq, :, : sk.stop - sk.start].transpose(0, 1)[None]
        part = ssa_scalar_grad_terms(one(q, sq), one(k, sk), one(v, sk), n, b, one(go, sq), causal=causal,
                                     softmax_scale=softmax_scale, keep=keep_s, dropout_p=dropout_p,
                                     return_sums=True)
        acc = [x + y for x, y in zip(acc, part)]
    return tuple(acc) if return_sums else tuple(acc[:2])


def nsa_grad_terms(
    q: torch.Tensor,
    gate_logits: torch.Tensor,
    config,
    do: torch.Tensor,
    aux: Dict[str, torch.Tensor],
    *,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    transform: str = "ssa",
    n: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> Dict[str, float]:
    """``attention_grad_terms`` of NSA (three gated branches), in float64.

    ``o = sum_c sigmoid(gate_c) o_c``, so branch ``c`` sees ``go_c = sigmoid(gate_c) do``;
    every branch is masked attention (compressed: ``aux["k_cmp"]``, ``aux["v_cmp"]`` under
    the compressed visibility; selected: ``aux["block_idx"]``, causal; window). dn/db: the
    branch sums of |terms| (and ``dn_sum``, ``db_sum``); dq: norm of the summed |terms|
    arrays; dk, dv: keys/values shared by the branches (``k_slc is k``...) sum their
    arrays, the compressed branch's mapped back through the compression's adjoint (exact
    for ``compress="mean"``, a linear map with non-negative weights; for ``"mlp"`` the
    compressed branch is left out of dk/dv). ``aux`` from ``nsa_attention(...,
    return_aux=True)``. Also returns ``k_cmp_terms``, ``v_cmp_terms``: the |terms| arrays of
    the gradient w.r.t. the compressed keys/values (for bounds on φ's gradients).
    """
    from nemo_ssa.ops.nsa.naive import compress_kv, compressed_visibility, selection_keep_mask, window_mask

    dev = q.device
    f = lambda t: t.detach().to(device=dev, dtype=torch.float64)  # noqa: E731
    g = torch.sigmoid(f(gate_logits))
    do64, n_tok = f(do), q.shape[2]
    hq, hkv = q.shape[1], k_slc.shape[1]
    causal = torch.ones(n_tok, n_tok, dtype=torch.bool, device=dev).tril()
    keep_slc = (selection_keep_mask(aux["block_idx"].to(dev), n_tok, config) & causal).repeat_interleave(hq // hkv, 1)
    branches = [
        ("cmp", aux["k_cmp"], aux["v_cmp"], compressed_visibility(n_tok, config, dev)),
        ("slc", k_slc, v_slc, keep_slc),
        ("win", k_win, v_win, window_mask(n_tok, config.window, dev)),
    ]
    keys = ("dn", "db", "dn_sum", "db_sum", "dn_split", "db_split")
    acc = [0.0] * len(keys)
    cmp_terms = None
    tq = torch.zeros(q.shape, dtype=torch.float64, device=dev)
    tk = {id(k): torch.zeros(k.shape, dtype=torch.float64, device=dev)}
    tv = {id(v): torch.zeros(v.shape, dtype=torch.float64, device=dev)}
    for c, (name, kc, vc, keep) in enumerate(branches):
        if kc.shape[2] == 0:
            continue
        t = attention_grad_terms(q, kc, vc, g[..., c:c + 1] * do64, transform=transform, n=n, b=b,
                                 softmax_scale=softmax_scale, mask=keep, arrays=True)
        if transform == "ssa":
            acc = [x + t[key] for x, key in zip(acc, keys)]
        tq += t["dq"]
        if name == "cmp":
            cmp_terms = dict(dk=t["dk"], dv=t["dv"])
            if config.compress != "mean":
                continue
            kk = k.detach().to(device=dev, dtype=torch.float64).requires_grad_()
            tk_c, = torch.autograd.grad(compress_kv(kk, config), kk, t["dk"])
            tv_c, = torch.autograd.grad(compress_kv(kk, config), kk, t["dv"])
            tk[id(k)] += tk_c
            tv[id(v)] += tv_c
        else:
            tk.setdefault(id(kc), torch.zeros(kc.shape, dtype=torch.float64, device=dev)).add_(t["dk"])
            tv.setdefault(id(vc), torch.zeros(vc.shape, dtype=torch.float64, device=dev)).add_(t["dv"])
    out: Dict[str, object] = {"dq": tq.norm().item()}
    if cmp_terms is not None:  # |terms| arrays w.r.t. the compressed keys / values themselves
        out["k_cmp_terms"], out["v_cmp_terms"] = cmp_terms["dk"], cmp_terms["dv"]
    for name, t, store in (("k", k, tk), ("v", v, tv), ("k_slc", k_slc, tk), ("v_slc", v_slc, tv),
                           ("k_win", k_win, tk), ("v_win", v_win, tv)):
        out["d" + name] = store[id(t)].norm().item() if id(t) in store else 0.0
    if transform == "ssa":
        out.update(zip(keys, acc))
    return out


def nsa_scalar_grad_terms(
    q: torch.Tensor,
    gate_logits: torch.Tensor,
    config,
    n: torch.Tensor,
    b: torch.Tensor,
    do: torch.Tensor,
    aux: Dict[str, torch.Tensor],
    *,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    softmax_scale: Optional[float] = None,
    return_sums: bool = False,
) -> Tuple[float, ...]:
    """``(sum |dn terms|, sum |db terms|)`` of NSA with the SSA transform in every branch
    (``nsa_grad_terms``; ``return_sums`` appends the signed sums ``(dn, db)``)."""
    t = nsa_grad_terms(q, gate_logits, config, do, aux, k=k_slc, v=v_slc, k_slc=k_slc, v_slc=v_slc, k_win=k_win,
                       v_win=v_win, transform="ssa", n=n, b=b, softmax_scale=softmax_scale)
    out = (t["dn_split"], t["db_split"])
    return out + (t["dn_sum"], t["db_sum"]) if return_sums else out


def assert_grad_close_to_terms(name: str, got: torch.Tensor, ref: torch.Tensor, terms: float, rtol: float) -> float:
    """``||got - ref|| <= rtol * terms`` with ``terms`` the norm of the gradient's |terms|
    (``attention_grad_terms``): for gradients whose true value may vanish while their
    terms do not (one-hot rows at extreme logits). Returns ``||got - ref|| / terms``."""
    err = torch.linalg.vector_norm(got.detach().to(torch.float64) - ref.detach().to(torch.float64)).item()
    rel = err / terms if terms > 0 else (0.0 if err == 0 else math.inf)
    if not (math.isfinite(err) and rel <= rtol):
        raise AssertionError(f"{name}: ||got - ref|| = {err:.3e} > {rtol:.1e} x |terms| norm {terms:.3e} "
                             f"(ratio {rel:.2e})")
    return rel


def assert_scalar_grad_close(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    terms: float,
    dtype: torch.dtype,
    eager: Optional[torch.Tensor] = None,
    factor: float = 2.0,
    rtol: Optional[float] = None,
) -> Dict[str, float]:
    """Assert a scalar gradient (dn, db) against its fp64 reference.

    ``|got - ref| <= factor * |eager - ref| + rtol * terms`` where ``terms`` is the sum
    of |terms| of the gradient (``ssa_scalar_grad_terms``), ``rtol`` defaults to
    ``SCALAR_GRAD_RTOL[dtype]`` (dtype of the kernel's inputs) and the eager part is
    there only when an eager same-dtype result is given (the 2x-eager rule).

    Returns ``{"err", "eager_err", "bound", "terms"}`` for logging.
    """
    g = got.detach().to(torch.float64).reshape(-1).cpu()
    r = ref.detach().to(torch.float64).reshape(-1).cpu()
    if g.numel() != 1 or r.numel() != 1:
        raise ValueError(f"{name}: scalar gradients expected, got shapes {tuple(got.shape)}, {tuple(ref.shape)}")
    err = abs(g.item() - r.item())
    eager_err = 0.0
    if eager is not None:
        eager_err = abs(float(eager.detach().to(torch.float64).reshape(-1)[0]) - r.item())
    tol = SCALAR_GRAD_RTOL[dtype] if rtol is None else float(rtol)
    bound = factor * eager_err + tol * terms
    if not (math.isfinite(err) and err <= bound):
        raise AssertionError(
            f"{name}: |got - ref| = {err:.3e} > {factor:g} x eager {eager_err:.3e} + {tol:.1e} x "
            f"sum|terms| {terms:.3e} (= {bound:.3e}); got {g.item():+.6e}, ref {r.item():+.6e}"
        )
    return {"err": err, "eager_err": eager_err, "bound": bound, "terms": terms}
