"""Speed/memory scripts, each printing ratios against a baseline timed in the same run; one op
registry (registry.py) and runner (run.py) with the shared timer (timing.py); correctness checks
in checks/ (docs/benchmarks.md)."""
