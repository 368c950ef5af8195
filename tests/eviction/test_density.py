"""Density's age buckets: the sorted search over whole ages gives the log formula's buckets."""

from __future__ import annotations

import numpy as np

from eviction.density import NUM_BUCKETS, RATIO, _age_buckets_by_log, age_bucket, age_buckets


def test_whole_ages_fall_in_the_buckets_of_the_log_formula() -> None:
    edges = np.floor(RATIO ** np.arange(NUM_BUCKETS + 2)).astype(np.int64)
    ages = np.concatenate([np.arange(-3, 5000), (edges[:, None] + np.arange(-2, 3)).ravel(),
                           np.random.default_rng(0).integers(0, 1 << 40, 20_000)])
    got = age_buckets(ages)
    assert np.array_equal(got, _age_buckets_by_log(ages))
    assert [age_bucket(int(a)) for a in ages[:300]] == got[:300].tolist()
    assert got.max() == NUM_BUCKETS - 1 and got.min() == 0


def test_fractional_ages_use_the_formula() -> None:
    ages = np.array([0.0, 0.5, 1.0, 1.5, 2.7, 1e9])
    assert age_buckets(ages).tolist() == [age_bucket(a) for a in ages.tolist()]
