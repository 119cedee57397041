"""Pieces shared by every attention schedule (flash, ELSA scan, NSA branches).

Modules, by concern (import them directly; this package re-exports nothing):

* ``env``: the ``NEMO_SSA_*`` debugging overrides, read in one place.
* ``launch``: the interpreter check, the cached Triton launch, host integer and stride helpers.
* ``alloc``: kernel outputs (NaN-poisoned on request).
* ``device``: ``@triton.jit`` helpers of the forward and backward kernels, and the dropout mask.
* ``transforms``: the score transforms (softmax, SSA) as compile-time choices.
* ``tma``: tensor descriptors for the Hopper path (TMA loads/stores) and when it applies.
* ``bwd_kernels``, ``bwd_config``, ``bwd``: the shared attention backward -- its kernels,
  its tile tables and mode choice, and its host driver ``attention_bwd``.
"""
