"""Gated sum of the three NSA branches in Triton: ``o = Σ_c sigmoid(g_c) · o_c``.

One pass over the rows ``(b, h, t)`` of ``o_cmp, o_slc, o_win [B, Hq, N, D]`` and
``gate_logits [B, Hq, N, 3]``; math in fp32 registers, output in the inputs' dtype.
The torch expression it replaces reads/writes four fp32 ``[B, Hq, N, D]`` temporaries
per direction (~1 GB each at N=64K, D=128); this kernel reads the inputs once.

Backward: ``d o_c = sigmoid(g_c) · dO`` and
``d g_c = sigmoid(g_c) (1 - sigmoid(g_c)) · <dO, o_c>`` (row dot product in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nemo_ssa.ops.common.launch import is_interpreter

__all__ = ["gate_combine"]


@triton.jit
def _gate_fwd_kernel(OC, OS, OW, G, O, ROWS, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    r_ok = rows < ROWS
    mask = r_ok[:, None] & (cols < D)[None, :]
    off = rows[:, None] * D + cols[None, :]
    s0 = tl.sigmoid(tl.load(G + rows * 3, mask=r_ok, other=0.0).to(tl.float32))
    s1 = tl.sigmoid(tl.load(G + rows * 3 + 1, mask=r_ok, other=0.0).to(tl.float32))
    s2 = tl.sigmoid(tl.load(G + rows * 3 + 2, mask=r_ok, other=0.0).to(tl.float32))
    o = s0[:, None] * tl.load(OC + off, mask=mask, other=0.0).to(tl.float32)
    o += s1[:, None] * tl.load(OS + off, mask=mask, other=0.0).to(tl.float32)
    o += s2[:, None] * tl.load(OW + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + off, o.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(DO, OC, OS, OW, G, DOC, DOS, DOW, DG, ROWS, D,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    r_ok = rows < ROWS
    mask = r_ok[:, None] & (cols < D)[None, :]
    off = rows[:, None] * D + cols[None, :]
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    for c in tl.static_range(3):
        if c == 0:
            src, dst = OC, DOC
        elif c == 1:
            src, dst = OS, DOS
        else:
            src, dst = OW, DOW
        s = tl.sigmoid(tl.load(G + rows * 3 + c, mask=r_ok, other=0.0).to(tl.float32))
        oc = tl.load(src + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + off, (s[:, None] * do).to(dst.dtype.element_ty), mask=mask)
        dg = s * (1.0 - s) * tl.sum(do * oc, 1)
        tl.store(DG + rows * 3 + c, dg.to(DG.dtype.element_ty), mask=r_ok)


def _launch_cfg(d: int):
    block_d = max(16, triton.next_power_of_2(d))
    block_r = 16 if is_interpreter() else max(1, 4096 // block_d)
    return block_r, block_d


class _GateCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_cmp, o_slc, o_win, gates):
        o_cmp, o_slc, o_win, gates = (t.contiguous() for t in (o_cmp, o_slc, o_win, gates))
        d = o_cmp.shape[-1]
        rows = o_cmp.numel() // d
        out = torch.empty_like(o_cmp)
        br, bd = _launch_cfg(d)
        _gate_fwd_kernel[(triton.cdiv(rows, br),)](o_cmp, o_slc, o_win, gates, out, rows, d,
                                                   BLOCK_R=br, BLOCK_D=bd)
        ctx.save_for_backward(o_cmp, o_slc, o_win, gates)
        return out

    @staticmethod
    def backward(ctx, do):
        o_cmp, o_slc, o_win, gates = ctx.saved_tensors
        do = do.contiguous()
        d = o_cmp.shape[-1]
        rows = o_cmp.numel() // d
        d_cmp, d_slc, d_win = (torch.empty_like(o_cmp) for _ in range(3))
        dg = torch.empty_like(gates)
        br, bd = _launch_cfg(d)
        _gate_bwd_kernel[(triton.cdiv(rows, br),)](do, o_cmp, o_slc, o_win, gates, d_cmp, d_slc, d_win, dg,
                                                   rows, d, BLOCK_R=br, BLOCK_D=bd)
        return d_cmp, d_slc, d_win, dg


def gate_combine(o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
                 gate_logits: torch.Tensor) -> torch.Tensor:
    """``Σ_c sigmoid(gate_logits[..., c]) · o_c`` for ``o_c [B, H, N, D]``, ``gate_logits [B, H, N, 3]``.

    All four must share dtype and device; output in that dtype (fp32 math inside).
    """
    if not (o_cmp.shape == o_slc.shape == o_win.shape) or tuple(gate_logits.shape) != (*o_cmp.shape[:-1], 3):
        raise ValueError(f"gate_combine: branch outputs {tuple(o_cmp.shape)} and gate logits "
                         f"{tuple(gate_logits.shape)} do not match (expected [..., D] x3 and [..., 3])")
    if len({t.dtype for t in (o_cmp, o_slc, o_win, gate_logits)}) != 1:
        raise ValueError("gate_combine: branch outputs and gate logits must share a dtype")
    return _GateCombine.apply(o_cmp, o_slc, o_win, gate_logits)
