"""After a resume from a checkpoint saved every N steps, validation runs at the steps it ran at
before and at the last step (``ResumeCadenceCallback``).

Lightning (2.4) saves such a checkpoint in ``on_train_batch_end``, before it counts the batch
completed; resumed from it, the batch index runs one behind the step: a 3,000-step study
resumed at step 1,750 validated at 1,751, 1,876, ... and never at 3,000. Checked with plain
Lightning on CPU (the counters are Lightning's, NeMo's trainer inherits them); the control
without the callback shows the shift, so the check is not vacuous."""

from __future__ import annotations

import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from nemo_ssa.nemo.callbacks import ResumeCadenceCallback  # noqa: E402


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.validated_at = []

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return None

    def on_validation_end(self):
        self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(ckpt_dir, max_steps, ckpt_path=None, callbacks=()):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(400, 4)), batch_size=2)
    model = _Tiny()
    # as the recipe: a checkpoint every 3 steps (saved in on_train_batch_end), validation every 3
    every = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=3, save_last=True, save_top_k=-1)
    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=3, limit_val_batches=1, callbacks=[every, *callbacks],
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         accelerator="cpu", devices=1)
    trainer.fit(model, data, data, ckpt_path=ckpt_path)
    return model.validated_at, trainer.global_step


@pytest.mark.filterwarnings("ignore")
def test_resumed_run_validates_on_the_old_cadence_and_at_the_last_step(tmp_path):
    assert _fit(tmp_path, 4, callbacks=[ResumeCadenceCallback()]) == ([3], 4)  # killed after step 4
    ckpt = os.path.join(tmp_path, "epoch=0-step=3.ckpt")
    # Lightning first runs the validation the checkpoint was saved before, then every 3 steps
    assert _fit(tmp_path, 9, ckpt, [ResumeCadenceCallback()]) == ([3, 6, 9], 9)
    # the control: without the callback the cadence is one step late and step 9 is never validated
    assert _fit(tmp_path, 9, ckpt) == ([4, 7], 9)


@pytest.mark.filterwarnings("ignore")
def test_a_fresh_run_is_left_alone(tmp_path):
    assert _fit(tmp_path, 6, callbacks=[ResumeCadenceCallback()]) == ([3, 6], 6)
