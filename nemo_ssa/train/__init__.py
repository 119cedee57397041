"""Training outside NeMo's trainer: the CPU loop and what it is made of.

- :mod:`.cpu_recipe`: shrink a NeMo recipe to the CPU loop's size and precision;
- :mod:`.process`: the process group, megatron's parallel state and the parallel layout;
- :mod:`.ddp`: megatron DDP and optimizer with the project's weight-decay rule;
- :mod:`.checkpoint_io`: dist_checkpointing save/load that survives a kill mid-save;
- :mod:`.faults`: the test hook that stalls a run where a test then kills it;
- :mod:`.warmup`: the attention warm-up before step 0 (also used by the GPU callbacks);
- :mod:`.rng`: snapshot and restore of every RNG a run draws from;
- :mod:`.loop`: :func:`~nemo_ssa.train.loop.train_on_cpu`, the loop itself.
"""
