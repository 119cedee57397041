"""Which NeMo checkpoint a resumed GPU run reports and inspects (``nemo_resume_checkpoint``).

NeMo 2 writes ``<name>-last/weights/`` (the dist checkpoint, ``metadata.json``) beside
``<name>-last/context/``; the lookup looked for ``metadata.json`` one level up and said "no
complete checkpoint found" on an H100 run that NeMo then resumed from step 19 (2026-11-25)."""

import os

from nemo_ssa.megatron.checkpoints import nemo_resume_checkpoint


def _ckpt(root, name, complete=True, unfinished=False, nested=True):
    d = os.path.join(root, name)
    w = os.path.join(d, "weights") if nested else d
    os.makedirs(w)
    os.makedirs(os.path.join(d, "context"), exist_ok=True)
    if complete:
        open(os.path.join(w, "metadata.json"), "w").write("{}")
    if unfinished:
        open(d + "-unfinished", "w").close()
    return w


def test_newest_complete_last_checkpoint_is_its_weights_dir(tmp_path):
    root = str(tmp_path)
    assert nemo_resume_checkpoint(os.path.join(root, "missing")) is None
    assert nemo_resume_checkpoint(root) is None
    _ckpt(root, "model_name=0--step=9-consumed_samples=320.0")  # not a -last checkpoint
    assert nemo_resume_checkpoint(root) is None
    w19 = _ckpt(root, "model_name=0--step=19-consumed_samples=640.0-last")
    assert nemo_resume_checkpoint(root) == w19
    _ckpt(root, "model_name=0--step=29-consumed_samples=960.0-last", complete=False)  # killed while saving
    assert nemo_resume_checkpoint(root) == w19
    _ckpt(root, "model_name=0--step=39-consumed_samples=1280.0-last", unfinished=True)  # NeMo's marker
    assert nemo_resume_checkpoint(root) == w19
    w49 = _ckpt(root, "model_name=0--step=49-consumed_samples=1600.0-last")
    assert nemo_resume_checkpoint(root) == w49


def test_flat_layout_still_found(tmp_path):
    w = _ckpt(str(tmp_path), "x--step=5-last", nested=False)
    assert nemo_resume_checkpoint(str(tmp_path)) == w
