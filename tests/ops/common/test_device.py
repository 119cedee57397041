"""ops/common/device.py, host half: the dropout mask's Philox counter layout and seed state."""

import torch

from nemo_ssa.ops.common.device import dropout_rng_layout, make_rng_state


def test_dense_layout_gives_each_entry_its_own_counter():
    hq, sq, sk, bz = 3, 5, 7, 2
    rz, rh, rs = dropout_rng_layout(hq, sq, sk, varlen=False)
    assert (rz, rh, rs) == (hq * sq * sk, sq * sk, sk)
    counters = {z * rz + h * rh + i * rs + j for z in range(bz) for h in range(hq) for i in range(sq) for j in range(sk)}
    assert len(counters) == bz * hq * sq * sk


def test_packed_layout_counts_rows_of_the_whole_pack():
    assert dropout_rng_layout(4, 9, 11, varlen=True, total_q=30) == (0, 30 * 11, 11)


def test_rng_state_from_seed_and_from_generator():
    s = make_rng_state("cpu", seed=123, offset=7)
    assert s.dtype == torch.int64 and s.tolist() == [123, 7]
    torch.manual_seed(0)
    a = make_rng_state("cpu")
    torch.manual_seed(0)
    b = make_rng_state("cpu")
    assert a.shape == (2,) and a.dtype == torch.int64 and torch.equal(a, b)
    assert not torch.equal(a, make_rng_state("cpu"))
