"""NeMo's optimizer module with nemo_ssa's fixes for megatron-core 0.15.3's optimizers.

:class:`SSAMegatronOptimizerModule` is NeMo's ``MegatronOptimizerModule`` (same
arguments, same optimizer) that installs ``nemo_ssa.megatron.optimizer_fixes`` on the
megatron optimizer it builds: checkpoints of an fp32 ``n`` inside a bf16 model, and the
distributed optimizer's save/resume with torch's Adam. The recipe uses it for ``optim``.

With ``fast_paths=True`` (the default) it also installs ``nemo_ssa.megatron.fast_paths``:
sync-free multi-tensor norm/scale in place of megatron's no-apex fallbacks, and the fused
``torch.optim.AdamW`` kernel on CUDA (docs/training-step.md); and
``nemo_ssa.megatron.sync_free``: gradient clipping and megatron's gradient NaN check on the
device, the check's result read a step later or before a checkpoint is written (this module's
``on_save_checkpoint``) and at the end of training -- a bad step is skipped on the device and
raises megatron's error then.

It also logs the learning rate without a host-device synchronisation: NeMo's module logs the
Python float, which Lightning turns into a device tensor with a blocking copy at the start of
every step (a drain of the GPU's queue before the step's first launch).
"""

from __future__ import annotations

import logging

import torch
from nemo.lightning.pytorch.optim.megatron import MegatronOptimizerModule

from nemo_ssa.megatron import fast_paths, sync_free
from nemo_ssa.megatron.compat import legacy_optimizer_arguments
from nemo_ssa.megatron.optimizer_fixes import patch_megatron_optimizer

log = logging.getLogger(__name__)


class SSAMegatronOptimizerModule(MegatronOptimizerModule):
    """``MegatronOptimizerModule`` + :func:`nemo_ssa.megatron.optimizer_fixes.patch_megatron_optimizer`."""

    def __init__(self, *args, fast_paths: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_paths = bool(fast_paths)

    def optimizers(self, model):
        if self.fast_paths:
            fast_paths.install()
            sync_free.install()
        # NeMo 2.7.3 passes get_megatron_optimizer the arguments megatron-core 0.16 removed
        with fast_paths.fused_adamw(self.fast_paths), legacy_optimizer_arguments():
            optimizers = super().optimizers(model)
        for opt in optimizers:
            patch_megatron_optimizer(opt)
            if self.fast_paths:
                why = sync_free.activate(opt)
                log.info("nemo_ssa: gradient NaN check and clipping %s", "on the device, read a step later"
                         if why is None else f"as megatron does them (host reads): {why}")
        return optimizers

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        """No checkpoint of a step whose gradient check failed: wait for the checks in flight."""
        sync_free.GUARD.check(wait=True)

    def on_train_end(self, trainer, pl_module) -> None:
        sync_free.GUARD.check(wait=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """NeMo's ``lr`` log, as a device tensor copied from pinned memory without blocking.

        The logged value is the one NeMo's hook logs: the first group's rate in the dtype
        Lightning makes of a float (the default dtype, float32 at least); off CUDA it is NeMo's
        hook as it is.
        """
        sync_free.GUARD.iteration = getattr(trainer, "global_step", sync_free.GUARD.iteration)
        device = getattr(pl_module, "device", None)
        if self._optimizers is None or device is None or torch.device(device).type != "cuda":
            return super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        groups = self._optimizers[0].param_groups
        lr = groups[0]["lr"] if len(groups) > 0 else 0.0
        dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
        value = torch.tensor(lr, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
        pl_module.log("lr", value, batch_size=1, prog_bar=True)
