"""NeMo's optimizer module with nemo_ssa's fixes for megatron-core 0.15.3's optimizers.

:class:`SSAMegatronOptimizerModule` is NeMo's ``MegatronOptimizerModule`` (same
arguments, same optimizer) that installs ``nemo_ssa.megatron.optimizer_fixes`` on the
megatron optimizer it builds: checkpoints of an fp32 ``n`` inside a bf16 model, and the
distributed optimizer's save/resume with torch's Adam. The recipe uses it for ``optim``.

With ``fast_paths=True`` (the default) it also installs ``nemo_ssa.megatron.fast_paths``:
sync-free multi-tensor norm/scale in place of megatron's no-apex fallbacks, and the fused
``torch.optim.AdamW`` kernel on CUDA (docs/training-step.md).
"""

from __future__ import annotations

from nemo.lightning.pytorch.optim.megatron import MegatronOptimizerModule

from nemo_ssa.megatron import fast_paths
from nemo_ssa.megatron.compat import legacy_optimizer_arguments
from nemo_ssa.megatron.optimizer_fixes import patch_megatron_optimizer


class SSAMegatronOptimizerModule(MegatronOptimizerModule):
    """``MegatronOptimizerModule`` + :func:`nemo_ssa.megatron.optimizer_fixes.patch_megatron_optimizer`."""

    def __init__(self, *args, fast_paths: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_paths = bool(fast_paths)

    def optimizers(self, model):
        if self.fast_paths:
            fast_paths.install()
        # NeMo 2.7.3 passes get_megatron_optimizer the arguments megatron-core 0.16 removed
        with fast_paths.fused_adamw(self.fast_paths), legacy_optimizer_arguments():
            optimizers = super().optimizers(model)
        for opt in optimizers:
            patch_megatron_optimizer(opt)
        return optimizers
