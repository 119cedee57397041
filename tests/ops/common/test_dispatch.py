"""ops/common/dispatch.py: one decision per call, whoever calls; said once; in the record.

The flash custom op, ELSA's backward and a direct ``attention_bwd`` call ask the same
function with the same facts, so one shape takes one backward (ELSA used to decide without
the TMA and Gluon facts: on a TMA-capable SSA D64 call it took the two kernels where flash
took the single pass -- shown here by making the TMA check say yes)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nemo_ssa.config.policy import resolve_attention  # noqa: E402
from nemo_ssa.ops.common import dispatch  # noqa: E402
from nemo_ssa.ops.common.launch import is_interpreter  # noqa: E402

pytestmark = pytest.mark.skipif(not (is_interpreter() or CUDA), reason="Triton kernels need the interpreter or CUDA")
DEV = "cuda" if CUDA and not is_interpreter() else "cpu"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_BWD", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


def _qkv(d, s=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(d)
    return [torch.randn(1, 2, s, d, generator=g, dtype=dtype).to(DEV) for _ in range(3)]


def _paths(op):
    return [c["path"] for c in dispatch.chosen() if c["op"] == op]


@pytest.mark.parametrize("tma", [False, True])
def test_flash_and_elsa_take_the_same_backward_for_one_shape(monkeypatch, tma):
    """SSA at D64: the flash kernels take the single pass only where the call can take TMA
    (measured faster there); ELSA's SSA backward is the two kernels and says why (its scan
    writes no row means C, the single pass's dn needs them); ELSA's softmax backward is the
    flash kernels' choice for the shape."""
    monkeypatch.setattr(dispatch, "use_tma", lambda *a, **k: tma)
    from nemo_ssa.ops.elsa.backward import elsa_bwd

    q, k, v = _qkv(64)
    n, b = torch.tensor([1.5], device=DEV), torch.tensor([0.8], device=DEV)
    o = torch.zeros_like(q)
    lse = torch.zeros(1, 2, 8, device=DEV)
    for transform in ("ssa", "softmax"):
        flash = dispatch.backward_plan(transform, q, k, v, varlen=False, dropout=False, fast_log2=1, scores=64,
                                       causal=True)
        dispatch.reset()
        elsa_bwd(torch.ones_like(q), q, k, v, o, lse, n, b, transform, True, 0.125, "ieee", False)
        bwd = [c for c in dispatch.chosen() if c["op"] == "attention.bwd"]
        if transform == "ssa":
            assert flash.path == (dispatch.SINGLE if tma else dispatch.TWO_KERNEL)
            assert [c["path"] for c in bwd] == [dispatch.TWO_KERNEL] and "writes no row means C" in bwd[0]["reason"]
        else:
            assert [c["path"] for c in bwd] == [flash.path]
        # what ran is what was said
        ran = [c["path"] for c in dispatch.chosen() if c["op"] == "attention.bwd.kernels"]
        assert all(("single-pass" in r) == (bwd[0]["path"] == dispatch.SINGLE) for r in ran), (bwd, ran)
        dispatch.reset()


def test_a_choice_is_said_once_per_call_and_again_when_it_changes(monkeypatch, caplog):
    from nemo_ssa.ops.attention.flash import ssa_attention_triton

    q, k, v = (t.requires_grad_() for t in _qkv(32))
    n = torch.tensor([1.5], device=DEV, requires_grad=True)
    b = torch.tensor([0.8], device=DEV)
    with caplog.at_level(logging.INFO, logger="nemo_ssa.kernels"):
        for _ in range(3):
            ssa_attention_triton(q, k, v, n, b, causal=True).sum().backward()
        monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
        ssa_attention_triton(q, k, v, n, b, causal=True).sum().backward()
    bwd = [c for c in dispatch.chosen() if c["op"] == "attention.bwd"]
    assert [c["path"] for c in bwd] == [dispatch.SINGLE, dispatch.TWO_KERNEL], bwd
    assert bwd[0]["reason"] == "measured faster for ssa D32" and bwd[1]["reason"] == "NEMO_SSA_BWD=deterministic"
    assert "ssa D32 float32 dense causal" in bwd[0]["call"]
    fwd = [c for c in dispatch.chosen() if c["op"] == "flash.fwd"]
    assert len(fwd) == 1 and fwd[0]["path"].startswith("triton-"), fwd
    ran = [(c["path"], c["reason"]) for c in dispatch.chosen() if c["op"] == "attention.bwd.kernels"]
    assert ran == [("triton-single-pass", "no Gluon row or layout for the call"),
                   ("triton-two-kernel", "the two-kernel schedule")], ran
    said = [r.getMessage() for r in caplog.records if r.name == "nemo_ssa.kernels"]
    assert len(said) == 5, said  # forward once; each schedule and its kernels once


def test_a_learnable_b_says_why_the_single_pass_did_not_run():
    from nemo_ssa.ops.attention.flash import ssa_attention_triton

    q, k, v = (t.requires_grad_() for t in _qkv(32))
    n = torch.tensor([1.5], device=DEV, requires_grad=True)
    b = torch.tensor([0.8], device=DEV, requires_grad=True)
    ssa_attention_triton(q, k, v, n, b, causal=True).sum().backward()
    ran = [(c["path"], c["reason"]) for c in dispatch.chosen() if c["op"] == "attention.bwd.kernels"]
    assert ran == [("triton-two-kernel", "db wanted (b learnable): the dQ kernel's row sums")], ran


def test_a_plan_seen_before_is_not_replayed_when_a_fact_changes(monkeypatch):
    """``backward_plan`` keeps its answers per call: every fact the schedule depends on is
    in its key (a missing one would replay a stale answer, e.g. the single pass after
    torch's deterministic mode was switched on), and ``reset`` forgets them with the record."""
    def plan(q, k, v, **kw):
        return dispatch.backward_plan("ssa", q, k, v, varlen=False, dropout=False, fast_log2=1, scores=64,
                                      causal=True, **kw).path

    qkv = _qkv(32)
    assert plan(*qkv) == dispatch.SINGLE
    assert plan(*qkv, deterministic=True) == dispatch.TWO_KERNEL
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert plan(*qkv) == dispatch.TWO_KERNEL
    finally:
        torch.use_deterministic_algorithms(was)
    monkeypatch.setenv("NEMO_SSA_BWD", "deterministic")
    assert plan(*qkv) == dispatch.TWO_KERNEL
    monkeypatch.delenv("NEMO_SSA_BWD")
    assert plan(*qkv) == dispatch.SINGLE
    qkv64 = _qkv(64)  # SSA D64: the single pass only where this call's layout takes TMA
    for tma in (True, False, True):
        monkeypatch.setattr(dispatch, "use_tma", lambda *a, **k: tma)
        assert plan(*qkv64) == (dispatch.SINGLE if tma else dispatch.TWO_KERNEL)
    dispatch.reset()
    plan(*qkv)
    assert _paths("attention.bwd") == [dispatch.SINGLE]


def test_note_call_builds_the_record_key_once_per_facts_and_path():
    """``note_call`` keeps its choices by the call's raw facts and path: each fact of the
    record's key is in them (another value is another entry, with its own key and reason),
    a seen call is neither logged nor re-keyed, and ``reset`` forgets them with the record."""
    base = dict(transform="ssa", head_dim=32, dtype=torch.bfloat16, varlen=False, causal=True, dropout=False)
    reasons = []

    def call(path="triton-pointers", **over):
        facts = dict(base, **over)
        return dispatch.note_call("flash.fwd", path, lambda: reasons.append(1) or f"r{len(reasons)}", *facts.values())

    first = call()
    assert call() is first and len(reasons) == 1  # seen: no new reason, key or record entry
    assert first.reason == "r1" and dispatch.chosen()[0]["call"] == "ssa D32 bfloat16 dense causal"
    changes = [dict(transform="softmax"), dict(head_dim=64), dict(dtype=torch.float16), dict(varlen=True),
               dict(causal=False), dict(dropout=True)]
    for over in changes:
        assert call(**over) is not first
    assert call("triton-tma") is not first
    assert len(reasons) == 2 + len(changes) and len(dispatch.chosen()) == 2 + len(changes)
    calls = {c["call"] for c in dispatch.chosen()}
    assert {"softmax D32 bfloat16 dense causal", "ssa D64 bfloat16 dense causal", "ssa D32 float16 dense causal",
            "ssa D32 bfloat16 varlen causal", "ssa D32 bfloat16 dense full",
            "ssa D32 bfloat16 dense causal dropout"} <= calls
    dispatch.reset()
    again = call()
    assert again is not first and len(reasons) == 3 + len(changes) and len(dispatch.chosen()) == 1
    # the key is note()'s: a decision noted directly under it is the one note_call returns
    dispatch.reset()
    direct = dispatch.note(("flash.fwd", "ssa", "D32", torch.bfloat16, "dense", "causal", ""), "flash.fwd",
                           "triton-pointers", "direct")
    assert call() is direct


def test_the_caller_asking_for_determinism_wins():
    c = dispatch.backward_schedule("ssa", 32, deterministic=True)
    assert c.path == dispatch.TWO_KERNEL and "caller" in c.reason
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert dispatch.backward_schedule("ssa", 32).reason == "torch deterministic algorithms are on"
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_policy_record_lists_the_kernels_that_ran(tmp_path):
    from nemo_ssa.ops.attention.flash import softmax_attention_triton

    resolved = resolve_attention("softmax_triton", device="cpu")
    resolved.write(str(tmp_path))
    assert json.load(open(tmp_path / "attention_policy.json"))["kernels"] == []
    q, k, v = _qkv(32)
    softmax_attention_triton(q, k, v, causal=False)
    resolved.write(str(tmp_path))
    kernels = json.load(open(tmp_path / "attention_policy.json"))["kernels"]
    assert [(c["op"], c["call"]) for c in kernels] == [("flash.fwd", "softmax D32 float32 dense full")], kernels


@pytest.mark.parametrize("forced", [None, True])
def test_nsa_selected_branch_says_which_schedule_it_took(monkeypatch, forced):
    from nemo_ssa.ops.nsa import selected_attn as sel
    from nemo_ssa.ops.nsa.naive import NSAConfig, num_select_blocks, select_blocks

    if forced is not None:
        monkeypatch.setitem(sel.TILE_OVERRIDE, "qmajor", forced)
    cfg = NSAConfig(block_len=4, stride=2, select_block=8, top_n=3, window=8)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 24, 16, generator=g).to(DEV).requires_grad_()
    k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DEV).requires_grad_() for _ in range(2))
    idx = select_blocks(torch.rand(1, 2, 24, num_select_blocks(24, cfg), generator=g).to(DEV), cfg)
    sel.selected_attention(q, k, v, idx.int(), cfg.select_block).sum().backward()
    (fwd,) = [c for c in dispatch.chosen() if c["op"] == "nsa.selected.fwd"]
    if forced:
        assert (fwd["path"], fwd["reason"]) == ("query-major", "TILE_OVERRIDE['qmajor']"), fwd
        (bwd,) = [c for c in dispatch.chosen() if c["op"] == "nsa.selected.bwd"]
        assert bwd["path"] == "kv-major, dq by atomics" and "group 2" in bwd["call"], bwd
    else:
        assert (fwd["path"], fwd["reason"]) == ("kv-major", f"GQA group 2 < {sel.QMAJOR_MIN_GROUP}"), fwd


@pytest.mark.parametrize("d,forced", [(32, None), (32, 0), (128, 1)])
def test_nsa_range_kernels_say_whether_they_took_tma(monkeypatch, d, forced):
    """NSA's range kernels (compressed and window branches) note their TMA choice per kernel:
    on this machine the call is too small for descriptors; ``TILE_OVERRIDE['tma']`` says so
    when it decides; above its TMA limit the dQ kernel keeps pointers whatever is forced."""
    from nemo_ssa.ops.nsa import range_attn as ra

    if forced is not None:
        monkeypatch.setitem(ra.TILE_OVERRIDE, "tma", forced)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 24, d, generator=g).to(DEV).requires_grad_()
    k, v = (torch.randn(1, 2, 24, d, generator=g).to(DEV).requires_grad_() for _ in range(2))
    ra.window_attention(q, k, v, window=8).sum().backward()
    picks = {c["op"]: c for c in dispatch.chosen() if c["op"].startswith("nsa.range.")}
    assert set(picks) == {"nsa.range.fwd", "nsa.range.dq", "nsa.range.dkv"}, picks
    dq = picks["nsa.range.dq"]
    if d > ra.TMA_MAX_HEAD_DIM["dq"]:
        assert dq["path"] == "triton-pointers" and "above the dq kernel's TMA limit" in dq["reason"], dq
    for kind in ("fwd", "dkv") if d > ra.TMA_MAX_HEAD_DIM["dq"] else ("fwd", "dq", "dkv"):
        c = picks[f"nsa.range.{kind}"]
        if forced is None:
            assert c["path"] == "triton-pointers" and "cannot take tensor descriptors" in c["reason"], c
        else:
            assert c["reason"] == f"TILE_OVERRIDE['tma'] = {forced}", c
            assert c["path"] == ("triton-tma" if forced else "triton-pointers"), c
