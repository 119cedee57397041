"""nemo_ssa.megatron.compat: megatron-core 0.15's multi-rank checkpoints under numpy 2.

The GPU image runs numpy 2 and every multi-rank save of megatron-core 0.15.3 died in
``exchange_utils._shard_size`` (``np.product``). The CPU lock keeps numpy 1, so the
two-rank test runs in a subprocess world whose PYTHONPATH starts with the ``numpy2``
overlay that scripts/env.sh installs (requirements/overlays/numpy2.txt): the same
checkpoint path as NeMo's default (fully parallel save and load), the distributed
optimizer, saved at step 2, interrupted at 3, resumed to 4 — with the shim it continues
the uninterrupted curve, without it the save fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy
import pytest

from nemo_ssa.megatron import compat

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(REPO, "tests", "scripts", "_cpu_dist_worker.py")
OVERLAY = os.path.join(sys.prefix, "overlays", "numpy2")


def test_the_shimmed_modules_are_every_np_product_call_of_the_installed_megatron():
    """A megatron-core with a new ``np.product`` call fails here, not at a user's checkpoint."""
    found = compat.modules_calling_np_product()
    assert set(found) <= set(compat.NUMPY2_MODULES), found
    import megatron.core

    if megatron.core.__version__.startswith("0.15."):
        assert found == sorted(compat.NUMPY2_MODULES)


def test_the_view_is_numpy_plus_product():
    view = compat._NumpyWithProduct(numpy)
    assert view.product((2, 3, 7)) == 42 and view.prod is numpy.prod
    assert view.ndarray is numpy.ndarray and view.zeros(3).shape == (3,)


def test_nothing_changes_on_numpy_1():
    if compat.needs_numpy2_shim():
        pytest.skip("this environment runs numpy 2 (the subprocess test covers it)")
    assert compat.apply_megatron_compat() == []
    from megatron.core.dist_checkpointing import exchange_utils

    assert exchange_utils.np is numpy


@pytest.fixture(scope="module")
def numpy2_world(tmp_path_factory):
    if not os.path.isdir(os.path.join(OVERLAY, "numpy")):
        msg = f"no numpy 2 overlay at {OVERLAY}: run the tests through scripts/env.sh, which installs it"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    from nemo_ssa.data import build_corpus

    out = tmp_path_factory.mktemp("np2")
    c = build_corpus(str(out / "corpus"), source="stdlib", vocab_size=512, max_bytes=200_000, quiet=True)
    base = dict(attention="ssa_reference", world=2, dist_opt=True, max_steps=4, global_batch_size=8,
                micro_batch_size=2)
    jobs = [
        # first in the world, so nothing has applied the shim yet
        dict(name="no-shim", run_dir=str(out / "no-shim"), no_numpy2_compat=True, train={"ckpt_every": 1},
             **{**base, "max_steps": 1}),
        dict(name="full", run_dir=str(out / "full"), **base),
        dict(name="a", run_dir=str(out / "res"), train={"ckpt_every": 2, "stop_after": 3, "save_at_end": False},
             **base),
        dict(name="b", run_dir=str(out / "res"), train={"resume": True}, **base),
    ]
    spec = {"corpus": {"prefix": c.prefix, "tokenizer_dir": c.tokenizer_dir}, "out": str(out / "results.json"),
            "jobs": jobs}
    (out / "jobs.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([OVERLAY, REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           WORKER, str(out / "jobs.json")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert os.path.exists(spec["out"]), (proc.stdout + proc.stderr)[-5000:]
    return json.load(open(spec["out"]))


@pytest.mark.slow
def test_two_rank_checkpoint_saves_and_resumes_under_numpy2(numpy2_world):
    env = numpy2_world["_env"]
    assert env["numpy"].startswith("2."), env
    if env["megatron_core"].startswith("0.15."):
        assert sorted(env["numpy2_shimmed"]) == sorted(compat.NUMPY2_MODULES), env
    full, a, b = (numpy2_world[k] for k in ("full", "a", "b"))
    for r in (full, a, b):
        assert "error" not in r, f"{r.get('error')}\n{r.get('traceback', '')}"
    assert a["steps"] == 3 and len(b["losses"]) == 2  # resumed from the step-2 checkpoint
    assert a["losses"][:2] + b["losses"] == pytest.approx(full["losses"], rel=1e-6)
    assert b["ssa_n"] == pytest.approx(full["ssa_n"], rel=1e-6)


@pytest.mark.slow
def test_without_the_shim_megatron_015_cannot_save_under_numpy2(numpy2_world):
    """The negative control: the shim is what makes the test above pass."""
    if not numpy2_world["_env"]["megatron_core"].startswith("0.15."):
        pytest.skip("this megatron-core calls np.prod itself")
    err = numpy2_world["no-shim"].get("error", "")
    assert "product" in err, numpy2_world["no-shim"]
