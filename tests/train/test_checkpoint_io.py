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

