"""Example-cluster bootstrap.

Rows that share an example_id (variants, seeds, decode steps, layers, heads) are dependent, so every interval in the
analysis resamples whole examples. A resample is represented by multinomial counts per cluster: a statistic is a
function of per-row weights (the count of the row's cluster), which makes "the same resample" for a paired
difference trivial (same weight vector for both statistics) and keeps 2000 resamples cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

Stat = Callable[[np.ndarray], float]


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile bootstrap interval."""

    estimate: float
    lo: float
    hi: float
    n_clusters: int
    n_boot: int
    n_valid: int  # resamples where the statistic was defined (e.g. both classes present for an AUROC)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "estimate": self.estimate,
            "lo": self.lo,
            "hi": self.hi,
            "n_clusters": self.n_clusters,
            "n_boot": self.n_boot,
            "n_valid": self.n_valid,
        }

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (e.g. x100 for percentage points)."""
        return Interval(
            self.estimate * factor, self.lo * factor, self.hi * factor, self.n_clusters, self.n_boot, self.n_valid
        )


def cluster_codes(clusters: Sequence | np.ndarray | pd.Series) -> tuple[np.ndarray, int]:
    """Integer code per row (0..n_clusters-1, in sorted cluster order) and the number of clusters."""
    codes, uniques = pd.factorize(pd.Series(np.asarray(clusters)), sort=True)
    return codes.astype(np.int64), len(uniques)


@functools.lru_cache(maxsize=16)
def bootstrap_weights(n_clusters: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, n_clusters) counts: drawing n_clusters clusters with replacement, n_boot times. Read-only and drawn
    once per (n_clusters, n_boot, seed): a coverage table asks for the same matrix for every group."""
    if n_clusters == 0:
        weights = np.zeros((n_boot, 0))
    else:
        rng = np.random.default_rng(seed)
        weights = rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=n_boot).astype(np.float64)
    weights.flags.writeable = False
    return weights


def percentile_ci(samples: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """Percentile interval over the finite samples (NaN, NaN when none is finite)."""
    finite = np.asarray(samples, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def bootstrap_many(
    stats: dict[str, Stat],
    clusters: Sequence | np.ndarray | pd.Series,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    derived: dict[str, Callable[[dict[str, float]], float]] | None = None,
) -> dict[str, Interval]:
    """Every statistic on the same cluster resamples; each stat maps per-row weights to a float (NaN = undefined).

    `derived` statistics are functions of the base values of one resample (e.g. a paired difference), so an
    expensive statistic is computed once per resample. The point estimate is the statistic at unit weights. An
    interval needs at least half the resamples defined, otherwise it is NaN rather than falsely narrow.
    """
    derived = derived or {}
    codes, n_clusters = cluster_codes(clusters)
    point = {name: float(stat(np.ones(len(codes)))) for name, stat in stats.items()}
    point |= {name: float(fn(point)) for name, fn in derived.items()}
    weights = bootstrap_weights(n_clusters, n_boot, seed)
    samples = {name: np.empty(n_boot) for name in point}
    for b in range(n_boot):
        row_w = weights[b, codes]
        values = {name: float(stat(row_w)) for name, stat in stats.items()}
        values |= {name: float(fn(values)) for name, fn in derived.items()}
        for name, v in values.items():
            samples[name][b] = v
    out = {}
    for name in point:
        s = samples[name]
        n_valid = int(np.isfinite(s).sum())
        lo, hi = percentile_ci(s, alpha) if n_valid >= max(1, n_boot // 2) else (float("nan"), float("nan"))
        out[name] = Interval(point[name], lo, hi, n_clusters, n_boot, n_valid)
    return out


def cluster_bootstrap(
    stat: Stat, clusters: Sequence | np.ndarray | pd.Series, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> Interval:
    """One statistic with its example-cluster percentile interval."""
    return bootstrap_many({"stat": stat}, clusters, n_boot, seed, alpha)["stat"]


def paired_difference(
    stat_a: Stat,
    stat_b: Stat,
    clusters: Sequence | np.ndarray | pd.Series,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    diff: Stat | None = None,
) -> dict[str, Interval]:
    """a, b and a - b, all on the same resampled clusters (so shared example difficulty cancels in a - b).

    By default diff is a - b per resample. For paired units pass `diff`, the statistic of the unit differences
    (e.g. weighted_mean(a_values - b_values)): diff is then computed from the differences themselves."""
    if diff is not None:
        return bootstrap_many({"a": stat_a, "b": stat_b, "diff": diff}, clusters, n_boot, seed, alpha)
    return bootstrap_many(
        {"a": stat_a, "b": stat_b}, clusters, n_boot, seed, alpha, derived={"diff": lambda v: v["a"] - v["b"]}
    )


def ratio_of_sums(
    numerator: np.ndarray, denominator: np.ndarray, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> Interval:
    """sum(num)/sum(den) over clusters, one entry per cluster; vectorized because coverage tables need many."""
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    n = len(num)
    if n == 0 or den.sum() <= 0:
        return Interval(float("nan"), float("nan"), float("nan"), n, n_boot, 0)
    weights = bootstrap_weights(n, n_boot, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = (weights @ num) / (weights @ den)
    lo, hi = percentile_ci(samples, alpha)
    return Interval(float(num.sum() / den.sum()), lo, hi, n, n_boot, int(np.isfinite(samples).sum()))


def weighted_mean(values: np.ndarray) -> Stat:
    """A Stat computing the weighted mean of fixed per-row values."""
    v = np.asarray(values, dtype=np.float64)

    def stat(w: np.ndarray) -> float:
        total = w.sum()
        return float(w @ v / total) if total > 0 else float("nan")

    return stat
