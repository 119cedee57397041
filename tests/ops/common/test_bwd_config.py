"""ops/common/bwd_config.py: tile tables, head-dim buckets, which backward a call takes."""

import pytest
import torch

from nemo_ssa.ops.common import bwd_config as bc
from nemo_ssa.ops.common import dispatch
from nemo_ssa.ops.common.bwd_config import BwdConfig


def _single(transform, d, **kw):
    return dispatch.backward_schedule(transform, d, **kw).path == dispatch.SINGLE


@pytest.mark.parametrize("d,bucket", [(16, 32), (24, 32), (32, 32), (33, 64), (64, 64), (80, 128), (128, 128),
                                      (129, 256), (256, 256)])
def test_d_bucket_is_the_padded_block_d(d, bucket):
    assert bc.d_bucket(d) == bucket


def test_tables_cover_every_bucket_causal_and_dtype_kind():
    for bd in (32, 64, 128, 256):
        for kind in ("16bit", "fp32"):
            row = bc.SINGLE_CONFIGS[(bd, kind)]  # (BM, BN, warps, stages[, tma])
            assert isinstance(row, tuple) and len(row) in (4, 5) and (len(row) == 4 or row[4] in (0, 1))
            for causal in (False, True):
                assert isinstance(bc.BWD_CONFIGS[(bd, causal, kind)], BwdConfig)
    assert len(bc.BWD_CONFIGS) == 16 and len(bc.SINGLE_CONFIGS) == 8


def test_tile_sizes_are_powers_of_two_at_least_16():
    for cfg in list(bc.BWD_CONFIGS.values()) + [BwdConfig(0, 0, 0, 0, *t[:4]) for t in bc.SINGLE_CONFIGS.values()]:
        for blk in (cfg.block_m_kv, cfg.block_n_kv) + ((cfg.block_m_dq, cfg.block_n_dq) if cfg.block_m_dq else ()):
            assert blk >= 16 and blk & (blk - 1) == 0, cfg


@pytest.mark.parametrize("d", [16, 32, 64, 100, 128, 256])
@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, "16bit"), (torch.float16, "16bit"), (torch.float32, "fp32")])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_config_looks_up_the_table_off_the_interpreter(d, dtype, kind, causal):
    assert bc.bwd_config(d, causal, dtype, interpret=False) == bc.BWD_CONFIGS[(bc.d_bucket(d), causal, kind)]
    single = bc.single_config(d, dtype, interpret=False)
    row = bc.SINGLE_CONFIGS[(bc.d_bucket(d), kind)]
    assert tuple(single[4:8]) == row[:4] and tuple(single[:4]) == (0, 0, 0, 0)
    assert single.tma_kv == (row[4] if len(row) > 4 else 0) and single.tma_dq == 0


def test_interpreter_gets_small_tiles():
    for d in (16, 64, 256):
        assert bc.bwd_config(d, True, torch.bfloat16, interpret=True) == bc.INTERPRETER_BWD_CONFIG
        assert bc.single_config(d, torch.float32, interpret=True) == bc.INTERPRETER_BWD_CONFIG


def test_single_pass_pays_only_for_ssa_at_small_head_dim():
    assert bc.single_pass_pays("ssa", 16) and bc.single_pass_pays("ssa", 32) and bc.single_pass_pays(1, 32)
    assert not bc.single_pass_pays("ssa", 33) and not bc.single_pass_pays("ssa", 128)
    assert not bc.single_pass_pays("softmax", 32) and not bc.single_pass_pays(0, 32)
    # D64 only where the call takes the TMA path (dq by bulk tensor reduce), SSA only
    assert bc.single_pass_pays("ssa", 64, tma=True) and not bc.single_pass_pays("ssa", 64, tma=False)
    assert not bc.single_pass_pays("softmax", 64, tma=True) and not bc.single_pass_pays("ssa", 128, tma=True)


def test_single_pass_pointer_fallback_row():
    row = bc.single_config(64, torch.bfloat16, interpret=False)
    assert row.tma_kv == 1
    ptr = bc.pointer_single_config(row, 64)
    assert ptr.tma_kv == 0 and tuple(ptr[4:8]) == (64, 64, 4, 2)
    d32 = bc.single_config(32, torch.bfloat16, interpret=False)
    assert bc.pointer_single_config(d32, 32) is d32


@pytest.mark.parametrize("mode,ssa32,ssa64,softmax32", [
    ("auto", True, False, False), ("atomic", True, True, True), ("deterministic", False, False, False)])
def test_backward_schedule_follows_nemo_ssa_bwd(monkeypatch, mode, ssa32, ssa64, softmax32):
    monkeypatch.setenv("NEMO_SSA_BWD", mode)
    got = (_single("ssa", 32), _single("ssa", 64), _single("softmax", 32))
    assert got == (ssa32, ssa64, softmax32)


def test_auto_takes_the_two_kernel_backward_when_torch_is_deterministic(monkeypatch):
    monkeypatch.delenv("NEMO_SSA_BWD", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert not _single("ssa", 32)
    finally:
        torch.use_deterministic_algorithms(was)
    assert _single("ssa", 32)


@pytest.mark.parametrize("forced,ssa,softmax", [(None, False, True), ("0", False, False), ("1", True, True)])
def test_fused_delta_default_and_override(monkeypatch, forced, ssa, softmax):
    if forced is None:
        monkeypatch.delenv("NEMO_SSA_FUSED_DELTA", raising=False)
    else:
        monkeypatch.setenv("NEMO_SSA_FUSED_DELTA", forced)
    assert (bc.fused_delta(True), bc.fused_delta(False)) == (ssa, softmax)
