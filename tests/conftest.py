"""Shared test setup.

- One intra-op thread for the whole session: the tests use tiny CPU tensors, and with
  thread contention on a busy 2-core box each op gets ~100x slower.
- ``megatron_cpu``: torch.distributed over gloo (world size 1), megatron's parallel state
  (TP=1, PP=1) and the RNG tracker, set up exactly like the CPU training loop does
  (``nemo_ssa.nemo.cpu_loop._init_distributed``) and torn down with its
  ``teardown_distributed`` at the end of the session.
"""

import pytest
import torch


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def megatron_cpu():
    from nemo_ssa.nemo.cpu_loop import _init_distributed, teardown_distributed

    _init_distributed(seed=1234)
    try:
        yield
    finally:
        teardown_distributed()
