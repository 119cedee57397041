"""nemo_ssa.study: the seed-paired verdict on synthetic curves with a known difference
(detected) and none (not detected), and the in-context regression data (least squares
reaches zero error from d examples on, noiseless; the shifts change the scale)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nemo_ssa.study import icl
from nemo_ssa.study.verdict import compare_pair, format_table, t_quantile_975

STEPS = list(range(1, 301))
BUCKETS = [(1, 100), (101, 200), (201, 300)]


def _curves(rng, seeds, offset, noise=0.01, seed_band=0.05):
    """Per seed: a shared decay + a per-seed offset (same data order for both attentions),
    attention b shifted by ``offset`` from step 100 on, independent noise per run."""
    a, b = {}, {}
    for s in seeds:
        band = rng.gauss(0, seed_band)
        base = [3 + 5 * math.exp(-t / 60) + band for t in STEPS]
        a[s] = (STEPS, [v + rng.gauss(0, noise) for v in base])
        b[s] = (STEPS, [v + (offset if t > 100 else 0.0) + rng.gauss(0, noise) for t, v in zip(STEPS, base)])
    return a, b


def test_a_known_difference_is_detected_where_it_is():
    hits = 0
    for trial in range(20):
        a, b = _curves(random.Random(trial), [1, 2, 3], offset=0.15)
        v = compare_pair(a, b, BUCKETS, names=("softmax", "ssa"))
        assert not v[0].detected  # no difference before step 100
        hits += v[2].detected and v[2].diff < 0 and "softmax lower" in v[2].verdict
    assert hits >= 19, hits


def test_no_difference_is_not_detected():
    false = sum(any(x.detected for x in compare_pair(*_curves(random.Random(100 + t), [1, 2, 3], 0.0), BUCKETS))
                for t in range(20))
    assert false <= 1, false


def test_a_difference_inside_the_seed_spread_is_not_a_verdict():
    """Consistent across seeds (a tight interval) but smaller than what a seed moves: reported
    as no difference beyond the seed spread."""
    a, b = _curves(random.Random(7), [1, 2, 3, 4, 5], offset=0.02, noise=0.001, seed_band=0.2)
    v = compare_pair(a, b, [(201, 300)])[0]
    assert v.ci[1] < 0 and not v.detected and v.seed_spread > 0.02


def test_one_seed_gives_no_verdict_and_the_table_says_so():
    a, b = _curves(random.Random(1), [1], offset=0.5)
    v = compare_pair(a, b, BUCKETS, names=("x", "y"))
    assert all(not x.detected and x.verdict == "one seed: no verdict" for x in v)
    assert "| 201-300 | 1 |" in format_table(v, ("x", "y"))


def test_a_run_that_stopped_inside_a_bucket_does_not_count_there():
    """A run cut off at step 150 would bring only the bucket's early (higher) losses into
    101-200: it counts in 1-100 and nowhere after."""
    a, b = _curves(random.Random(3), [1, 2, 3], offset=0.0)
    b[3] = (STEPS[:150], b[3][1][:150])
    v = {x.bucket: x for x in compare_pair(a, b, BUCKETS)}
    assert v[(1, 100)].seeds == 3 and v[(101, 200)].seeds == 2 and v[(201, 300)].seeds == 2
    b[2] = (STEPS[:150], b[2][1][:150])
    b[1] = (STEPS[:90], b[1][1][:90])
    v = {x.bucket: x for x in compare_pair(a, b, BUCKETS)}
    assert v[(1, 100)].seeds == 2 and (101, 200) not in v and (201, 300) not in v


def test_t_quantiles():
    assert t_quantile_975(2) == pytest.approx(4.303) and t_quantile_975(200) == 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_least_squares_floor_is_reached_from_d_examples_noiseless():
    d, k = 5, 12
    p = icl.sample(64, k, d, seed=3)
    err = icl.least_squares_error(p)
    assert torch.all(err[d:] < 1e-9), err  # float32 prompts: rounding only (the first error is ~7)
    assert torch.all(err[1:d] > 0.05), err  # fewer examples than dimensions: not determined
    noisy = icl.least_squares_error(icl.sample(64, k, d, seed=3, noise=0.1))
    assert torch.all(noisy[d + 1:] > 1e-4)


def test_tokens_and_shifts():
    p = icl.sample(4, 3, 2, seed=0)
    tok = icl.to_tokens(p)
    assert tok.shape == (4, 6, 3)
    assert torch.equal(tok[:, 0, :2], p.xs[:, 0]) and torch.equal(tok[:, 1, 2], p.ys[:, 0])
    assert torch.all(tok[:, 0, 2] == 0) and torch.all(tok[:, 1, :2] == 0)
    for dist in icl.DISTRIBUTIONS:
        x = icl.sample(4000, 1, 4, x_dist=dist, x_scale=4.0, seed=1).xs
        assert x.std().item() == pytest.approx(4.0, rel=0.15), dist
    with pytest.raises(ValueError, match="one of"):
        icl.sample(1, 1, 1, x_dist="cauchy")
