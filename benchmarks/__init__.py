"""Speed/memory scripts; each prints ratios vs SDPA measured in the same run."""
