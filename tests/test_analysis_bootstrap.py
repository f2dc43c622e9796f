"""Example-cluster bootstrap (kvcert.analysis.bootstrap)."""

from __future__ import annotations

import numpy as np

from kvcert.analysis import bootstrap
from synthetic import NB

# --- bootstrap -------------------------------------------------------------------------------------------------


def test_paired_difference_of_identical_columns_is_exactly_zero():
    x = np.random.default_rng(1).random(50)
    clusters = np.repeat(np.arange(10), 5)
    res = bootstrap.paired_difference(bootstrap.weighted_mean(x), bootstrap.weighted_mean(x), clusters, NB, 3)
    assert res["diff"].estimate == 0.0 and res["diff"].lo == 0.0 and res["diff"].hi == 0.0
    assert res["a"].lo < res["a"].estimate < res["a"].hi


def test_bootstrap_is_deterministic_and_resamples_clusters():
    x = np.r_[np.zeros(10), np.ones(10)]
    one_cluster_per_value = np.r_[np.zeros(10), np.ones(10)]
    a = bootstrap.cluster_bootstrap(bootstrap.weighted_mean(x), one_cluster_per_value, NB, 5)
    b = bootstrap.cluster_bootstrap(bootstrap.weighted_mean(x), one_cluster_per_value, NB, 5)
    assert a == b and a.n_clusters == 2
    assert a.lo == 0.0 and a.hi == 1.0  # two clusters: resamples are all-0, mixed or all-1


def test_paired_difference_of_paired_units_uses_the_unit_differences():
    rng = np.random.default_rng(4)
    a, b = rng.random(40), rng.random(40)
    clusters = np.repeat(np.arange(20), 2)
    res = bootstrap.paired_difference(
        bootstrap.weighted_mean(a), bootstrap.weighted_mean(b), clusters, NB, 1, diff=bootstrap.weighted_mean(a - b)
    )
    derived = bootstrap.paired_difference(bootstrap.weighted_mean(a), bootstrap.weighted_mean(b), clusters, NB, 1)
    assert res["diff"].estimate == bootstrap.weighted_mean(a - b)(np.ones(40))
    assert res["a"] == derived["a"] and res["b"] == derived["b"]
    assert abs(res["diff"].lo - derived["diff"].lo) < 1e-12 and abs(res["diff"].hi - derived["diff"].hi) < 1e-12
