"""Run tooling: what reads, compares and summarises finished or running runs.

- :mod:`.compare`: merge/align/plot/gate loss curves (``python -m nemo_ssa compare``);
- :mod:`.metrics_log`: the per-step ``metrics.csv`` / TensorBoard writer and MFU arithmetic;
- :mod:`.profile_summary`: top ops of a torch profiler trace.
"""
