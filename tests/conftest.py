"""Shared test setup.

- Without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module imports a
  ``@triton.jit`` kernel (Triton reads it when a kernel is decorated): every Triton kernel
  in the session then runs in the CPU interpreter, whatever the collection order.
- One intra-op thread for the whole session: the tests use tiny CPU tensors, and with
  thread contention on a busy 2-core box each op gets ~100x slower.
- ``megatron_cpu``: torch.distributed over gloo (world size 1), megatron's parallel state
  (TP=1, PP=1) and the RNG tracker, set up exactly like the CPU training loop does
  (``nemo_ssa.nemo.cpu_loop._init_distributed``) and torn down with its
  ``teardown_distributed`` at the end of the session.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
