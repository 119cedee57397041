"""Shared test setup.

- Without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module imports a
  ``@triton.jit`` kernel (Triton reads it when a kernel is decorated): every Triton kernel
  in the session then runs in the CPU interpreter, whatever the collection order.
- One intra-op thread for the whole session: the tests use tiny CPU tensors, and with
  thread contention on a busy 2-core box each op gets ~100x slower.
- Every test starts from its own seed (python, numpy, torch CPU and CUDA), derived from
  its test id: inputs drawn "fresh" with ``torch.randn`` are still random across tests
  but the same on every run of one test, whatever ran before it, so a failure
  reproduces alone. A failing test's report shows its seed. ``NEMO_SSA_TEST_SEED_SALT``
  draws another set of inputs for every test (e.g. a nightly loop over salts).
- ``NEMO_SSA_TEST_ORDER=reverse`` or ``shuffle:<int>`` runs the collected tests in
  reverse or shuffled order (order-independence check; the default keeps file order).
- ``NEMO_SSA_TEST_LOG=<file.jsonl>``: one JSON line per collected test id and per
  finished test (outcome, seconds, first line of the failure), appended as tests finish,
  so a run killed at a time limit still leaves its results (``scripts/device/gpu_session.py``
  turns the file into the markdown results table). Works under pytest-xdist (the
  controller writes the results, the workers their collection).
- ``megatron_cpu``: torch.distributed over gloo (world size 1), megatron's parallel state
  (TP=1, PP=1) and the RNG tracker, set up exactly like the CPU training loop does
  (``nemo_ssa.train.process.init_distributed``) and torn down with its
  ``teardown_distributed`` at the end of the session.
"""

import hashlib
import json
import os
import random
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


_XDIST_WORKER = False  # this process is a pytest-xdist worker (set in pytest_configure)


def pytest_configure(config):
    global _XDIST_WORKER
    # the worker's own config says so; PYTEST_XDIST_WORKER does not: a pytest that a test
    # starts as a subprocess inherits it and would then write nothing to the test log
    _XDIST_WORKER = hasattr(config, "workerinput")
    torch.set_num_threads(1)
    # registered here, not in pyproject.toml: a pyproject change makes scripts/env.sh reinstall
    config.addinivalue_line("markers", "network: needs the package registry (skipped, with the reason, when it is not reachable)")


def test_seed(nodeid: str) -> int:
    """The seed of one test: a hash of its id (and of ``NEMO_SSA_TEST_SEED_SALT``)."""
    salt = os.environ.get("NEMO_SSA_TEST_SEED_SALT", "")
    return int.from_bytes(hashlib.sha256(f"{salt}|{nodeid}".encode()).digest()[:4], "little")


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = test_seed(request.node.nodeid)
    request.node._nemo_ssa_seed = seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    seed = getattr(item, "_nemo_ssa_seed", None)
    if rep.failed and seed is not None:
        salt = os.environ.get("NEMO_SSA_TEST_SEED_SALT", "")
        rep.sections.append(("random seed", f"seed {seed} (from the test id{f' and salt {salt!r}' if salt else ''}); "
                                            f"re-running this test alone draws the same inputs"))


def pytest_collection_modifyitems(session, config, items):
    order = os.environ.get("NEMO_SSA_TEST_ORDER", "")
    if not order:
        return
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    else:
        raise pytest.UsageError(f"NEMO_SSA_TEST_ORDER={order!r}; supported: reverse, shuffle:<int>")


@pytest.fixture(scope="session")
def megatron_cpu():
    from nemo_ssa.train.process import init_distributed, teardown_distributed

    init_distributed(seed=1234)
    try:
        yield
    finally:
        teardown_distributed()


# ----------------------------------------------------------------------------- test log
def _test_log(record: dict) -> None:
    path = os.environ.get("NEMO_SSA_TEST_LOG")
    if path:
        with open(path, "a") as f:  # one short write per line: safe across processes
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    if os.environ.get("NEMO_SSA_TEST_LOG"):
        _test_log({"collected": [item.nodeid for item in session.items], "pid": os.getpid()})


_PHASES: dict = {}


def pytest_runtest_logreport(report):
    if not os.environ.get("NEMO_SSA_TEST_LOG"):
        return
    if _XDIST_WORKER:
        return  # under xdist the controller receives every report: write there only
    acc = _PHASES.setdefault(report.nodeid, {"seconds": 0.0, "outcome": None, "message": ""})
    acc["seconds"] += getattr(report, "duration", 0.0) or 0.0
    failed = report.failed
    if report.when == "call" or failed or (report.when == "setup" and report.skipped):
        if acc["outcome"] != "failed":
            acc["outcome"] = "skipped" if report.skipped else ("failed" if failed else "passed")
            if report.skipped and isinstance(report.longrepr, tuple):
                acc["message"] = str(report.longrepr[2])[:300]
            elif failed:
                text = getattr(report, "longreprtext", "") or str(report.longrepr)
                lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-1:]
                acc["message"] = (lines[0][2:].strip() if lines and lines[0].startswith("E ") else
                                  (lines[0] if lines else ""))[:300]
                if report.when != "call":
                    acc["message"] = f"[{report.when}] " + acc["message"]
    if report.when == "teardown":
        _test_log({"test": report.nodeid, "outcome": acc["outcome"] or "error", "seconds": round(acc["seconds"], 2),
                   "message": acc["message"], "time": time.time()})
        _PHASES.pop(report.nodeid, None)
