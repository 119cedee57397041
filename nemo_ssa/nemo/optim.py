"""NeMo's optimizer module with nemo_ssa's fixes for megatron-core 0.15.3's optimizers.

:class:`SSAMegatronOptimizerModule` is NeMo's ``MegatronOptimizerModule`` (same
arguments, same optimizer) that installs ``nemo_ssa.megatron.optimizer_fixes`` on the
megatron optimizer it builds: checkpoints of an fp32 ``n`` inside a bf16 model, and the
distributed optimizer's save/resume with torch's Adam. The recipe uses it for ``optim``.
"""

from __future__ import annotations

from nemo.lightning.pytorch.optim.megatron import MegatronOptimizerModule

from nemo_ssa.megatron.optimizer_fixes import patch_megatron_optimizer


class SSAMegatronOptimizerModule(MegatronOptimizerModule):
    """``MegatronOptimizerModule`` + :func:`nemo_ssa.megatron.optimizer_fixes.patch_megatron_optimizer`."""

    def optimizers(self, model):
        optimizers = super().optimizers(model)
        for opt in optimizers:
            patch_megatron_optimizer(opt)
        return optimizers
