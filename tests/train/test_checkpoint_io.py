"""Checkpoint I/O of the CPU loop: which directory a resume picks (no training here;
tests/scripts/test_resume_cpu.py kills a real run mid-save and resumes it)."""

import os
import shutil


def test_partial_checkpoint_is_never_resumed_from(tmp_path):
    """The completion rule on its own (no training): a ``.partial`` copy of a whole
    checkpoint is ignored; the same directory under the final name is picked."""
    from nemo_ssa.train.checkpoint_io import latest_checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_0000002").mkdir(parents=True)
    (root / "step_0000002" / "metadata.json").write_text("{}")
    shutil.copytree(root / "step_0000002", root / "step_0000004.partial")
    (root / "step_0000006").mkdir()  # a directory without metadata (not written by a save)
    assert latest_checkpoint(str(root)).endswith("step_0000002")
    os.replace(root / "step_0000004.partial", root / "step_0000004")  # what the save's rename does
    assert latest_checkpoint(str(root)).endswith("step_0000004")



def test_rng_state_in_the_common_state_loads_with_weights_only(tmp_path):
    """megatron-core 0.19 loads a checkpoint's common state with ``torch.load(weights_only=True)``:
    the RNG state we put there must load that way and restore every generator."""
    import random

    import numpy as np
    import torch

    from nemo_ssa.train.checkpoint_io import _rng_from_obj, _rng_to_obj
    from nemo_ssa.train.process import ParallelLayout
    from nemo_ssa.train.rng import restore_rng, snapshot_rng
    import dataclasses

    np.random.normal()  # a cached Gaussian in numpy's state
    snap = snapshot_rng()
    common = {"step": 3, "rng": _rng_to_obj(snap), "rng_per_rank": [_rng_to_obj(snap)],
              "layout": dataclasses.asdict(ParallelLayout(world=1))}
    torch.save(common, tmp_path / "common.pt")
    loaded = torch.load(tmp_path / "common.pt", weights_only=True)
    expected = (random.random(), np.random.normal(), torch.rand(2))
    restore_rng(_rng_from_obj(loaded["rng"]))
    got = (random.random(), np.random.normal(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    # a checkpoint written before (numpy's key as an array) still restores
    old = dict(common["rng"], numpy=snap.numpy)
    restore_rng(_rng_from_obj(old))
    assert np.random.normal() == expected[1]
