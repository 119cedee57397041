"""Verdicts between two attentions trained over the same seeds: is a difference in loss
larger than what another seed would give?

Each seed trains every attention on the same data order, so runs pair by seed. For a step
bucket (a range of steps) each run contributes its mean loss there; the per-seed
differences ``d_s = a_s - b_s`` give

- the mean difference and its 95 % confidence interval over seeds (Student's t, n - 1
  degrees of freedom: seeds are few);
- the seed spread: the pooled standard deviation of the two attentions' own values over
  seeds (what changing the seed alone moves the loss by).

A difference is **detected** when the interval excludes 0 *and* the mean difference exceeds
the seed spread; otherwise "no difference beyond the seed spread". One seed gives no verdict.
Lower loss is better.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["BucketVerdict", "t_quantile_975", "bucket_means", "compare_pair", "format_table"]

#: Student's t 0.975 quantiles for 1..30 degrees of freedom (beyond: the normal's 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_quantile_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass
class BucketVerdict:
    bucket: Tuple[int, int]        # first and last step
    seeds: int
    mean_a: float
    mean_b: float
    diff: float                    # mean over seeds of a - b
    ci: Optional[Tuple[float, float]]
    seed_spread: Optional[float]
    detected: bool
    verdict: str


def bucket_means(steps: Sequence[int], values: Sequence[float], bucket: Tuple[int, int]) -> Optional[float]:
    """Mean of ``values`` at steps within ``bucket`` (inclusive); None if the run has none there."""
    inside = [v for s, v in zip(steps, values) if bucket[0] <= s <= bucket[1] and math.isfinite(v)]
    return statistics.fmean(inside) if inside else None


def _last_step(run: Tuple[Sequence[int], Sequence[float]]) -> int:
    return max(run[0]) if len(run[0]) else -1


def compare_pair(runs_a: Dict[int, Tuple[Sequence[int], Sequence[float]]],
                 runs_b: Dict[int, Tuple[Sequence[int], Sequence[float]]],
                 buckets: Sequence[Tuple[int, int]], names: Tuple[str, str] = ("a", "b")) -> List[BucketVerdict]:
    """One verdict per bucket from the seeds both attentions have (``{seed: (steps, values)}``).

    A run that stopped inside a bucket (its last step before the bucket's end) does not
    count there: its mean would cover only the bucket's earlier, higher-loss steps."""
    out = []
    seeds = sorted(set(runs_a) & set(runs_b))
    for bucket in buckets:
        pairs = []
        for s in seeds:
            if min(_last_step(runs_a[s]), _last_step(runs_b[s])) < bucket[1]:
                continue
            a, b = bucket_means(*runs_a[s], bucket), bucket_means(*runs_b[s], bucket)
            if a is not None and b is not None:
                pairs.append((a, b))
        n = len(pairs)
        if n == 0:
            continue
        ma, mb = statistics.fmean(p[0] for p in pairs), statistics.fmean(p[1] for p in pairs)
        diffs = [a - b for a, b in pairs]
        d = statistics.fmean(diffs)
        if n < 2:
            out.append(BucketVerdict(bucket, n, ma, mb, d, None, None, False, "one seed: no verdict"))
            continue
        half = t_quantile_975(n - 1) * statistics.stdev(diffs) / math.sqrt(n)
        ci = (d - half, d + half)
        spread = math.sqrt((statistics.variance([p[0] for p in pairs]) + statistics.variance([p[1] for p in pairs])) / 2)
        detected = (ci[0] > 0 or ci[1] < 0) and abs(d) > spread
        if detected:
            better = names[0] if d < 0 else names[1]
            verdict = f"{better} lower by {abs(d):.3f} (beyond the seed spread {spread:.3f})"
        else:
            verdict = "no difference beyond the seed spread"
        out.append(BucketVerdict(bucket, n, ma, mb, d, ci, spread, detected, verdict))
    return out


def format_table(verdicts: Sequence[BucketVerdict], names: Tuple[str, str]) -> str:
    lines = [f"| steps | seeds | {names[0]} | {names[1]} | {names[0]} - {names[1]} | 95 % CI | seed spread | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        ci = f"[{v.ci[0]:+.3f}, {v.ci[1]:+.3f}]" if v.ci else "-"
        spread = f"{v.seed_spread:.3f}" if v.seed_spread is not None else "-"
        lines.append(f"| {v.bucket[0]}-{v.bucket[1]} | {v.seeds} | {v.mean_a:.4f} | {v.mean_b:.4f} | {v.diff:+.4f} | "
                     f"{ci} | {spread} | {v.verdict} |")
    return "\n".join(lines)
