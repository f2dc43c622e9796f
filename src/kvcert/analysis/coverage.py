"""C1: does the certificate radius z * sqrt(V_hat) cover the true attention-output error?

A cell is one (example, variant, decode step, layer, head) row of `steps`; coverage is pooled over cells, with the
interval from resampling whole examples (cells of one example are strongly dependent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np
import pandas as pd

from kvcert.analysis.bootstrap import bootstrap_weights, percentile_ci, ratio_of_sums

DEFAULT_LEVELS = (0.50, 0.60, 0.70, 0.80, 0.85, 0.90, 0.95, 0.975, 0.99)
TAIL_MASS_BINS = (0.0, 1e-3, 1e-2, 1e-1, 1.0)
P_MAX_BINS = (0.0, 0.1, 0.3, 0.6, 1.0)
KEY = ["run", "example_id", "variant"]
POOLED_COLUMNS = ("example_id", "error", "variance")  # what pooled_coverage reads


def z_value(level: float) -> float:
    """Two-sided normal quantile z_{1 - alpha/2} for a nominal level 1 - alpha."""
    return NormalDist().inv_cdf(0.5 + level / 2)


def certified_cells(steps: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Cells with a finite error and a finite, non-negative variance, and how many were excluded."""
    err = steps["error"].to_numpy(np.float64)
    var = steps["variance"].to_numpy(np.float64)
    ok = np.isfinite(err) & np.isfinite(var) & (var >= 0)
    return steps.loc[ok], int((~ok).sum())


def standardized_error(steps: pd.DataFrame) -> np.ndarray:
    """error / sqrt(V_hat); a zero variance covers only a zero error (0 -> 0, otherwise inf)."""
    err = steps["error"].to_numpy(np.float64)
    sd = np.sqrt(steps["variance"].to_numpy(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = err / sd
    return np.where(sd > 0, ratio, np.where(err <= 0, 0.0, np.inf))


def attach_example_columns(steps: pd.DataFrame, examples: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """Bring example-level columns (budget, task, scorer, ...) onto step rows."""
    wanted = [c for c in columns if c not in steps.columns]
    if not wanted:
        return steps
    meta = examples[KEY + wanted].drop_duplicates(KEY)
    return steps.merge(meta, on=KEY, how="inner")


def steps_for(examples: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The step rows that belong to the given example rows."""
    keys = examples[KEY].drop_duplicates()
    return steps.merge(keys, on=KEY, how="inner")


def _cluster_counts(covered: np.ndarray, clusters: pd.Series | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # a Series is factorized in its own dtype (an Arrow string column: ~10x faster than its object array)
    codes, uniques = pd.factorize(clusters if isinstance(clusters, pd.Series) else pd.Series(clusters), sort=True)
    cov = np.bincount(codes, weights=covered.astype(np.float64), minlength=len(uniques))
    cells = np.bincount(codes, minlength=len(uniques)).astype(np.float64)
    return cov, cells


def pooled_coverage(
    steps: pd.DataFrame, level: float = 0.95, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> dict:
    """Pooled coverage of the level radius over certified cells, with an example-cluster interval."""
    cells, n_excluded = certified_cells(steps)
    covered = standardized_error(cells) <= z_value(level)
    cov, n = _cluster_counts(covered, cells["example_id"])
    ci = ratio_of_sums(cov, n, n_boot, seed, alpha)
    return {
        "level": level,
        "coverage": ci.estimate,
        "lo": ci.lo,
        "hi": ci.hi,
        "n_cells": int(len(cells)),
        "n_examples": int(len(cov)),
        "n_excluded_cells": n_excluded,
    }


def coverage_from_examples(examples: pd.DataFrame, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05) -> dict:
    """95% coverage from the per-example counts (steps95 / steps_total) when step records are not at hand."""
    ex = examples[examples["has_certificate"].astype(bool) & (examples["steps_total"] > 0)]
    grouped = ex.groupby("example_id")[["steps95", "steps_total"]].sum()
    ci = ratio_of_sums(grouped["steps95"].to_numpy(), grouped["steps_total"].to_numpy(), n_boot, seed, alpha)
    return {
        "level": 0.95,
        "coverage": ci.estimate,
        "lo": ci.lo,
        "hi": ci.hi,
        "n_cells": int(grouped["steps_total"].sum()),
        "n_examples": int(len(grouped)),
        "n_excluded_cells": 0,
    }


def coverage_table(
    steps: pd.DataFrame,
    by: str | Sequence[str],
    level: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """Coverage per group (e.g. budget, task, layer); group columns must already be on `steps`."""
    by = [by] if isinstance(by, str) else list(by)
    rows = []
    needed = steps[[*by, *(c for c in POOLED_COLUMNS if c not in by)]]  # groups copy only what pooled_coverage reads
    for key, group in needed.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key, strict=True)), **pooled_coverage(group, level, n_boot, seed, alpha)})
    return pd.DataFrame(rows)


def calibration_curve(
    steps: pd.DataFrame,
    levels: Sequence[float] = DEFAULT_LEVELS,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """Empirical vs nominal coverage; one resample set for all levels, so the curve and its band are coherent."""
    cells, _ = certified_cells(steps)
    ratio = standardized_error(cells)
    codes, uniques = pd.factorize(cells["example_id"], sort=True)
    n_cells = np.bincount(codes, minlength=len(uniques)).astype(np.float64)
    weights = bootstrap_weights(len(uniques), n_boot, seed)
    rows = []
    for level in levels:
        z = z_value(level)
        cov = np.bincount(codes, weights=(ratio <= z).astype(np.float64), minlength=len(uniques))
        with np.errstate(invalid="ignore", divide="ignore"):
            samples = (weights @ cov) / (weights @ n_cells)
        lo, hi = percentile_ci(samples, alpha)
        est = float(cov.sum() / n_cells.sum()) if n_cells.sum() > 0 else float("nan")
        rows.append({"nominal": level, "z": z, "coverage": est, "lo": lo, "hi": hi, "n_cells": int(n_cells.sum())})
    return pd.DataFrame(rows)


def coverage_by_regime(
    steps: pd.DataFrame,
    level: float = 0.95,
    tail_mass_bins: Sequence[float] = TAIL_MASS_BINS,
    p_max_bins: Sequence[float] = P_MAX_BINS,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """Coverage per bin of tail mass and of peak attention weight, so that a pooled number cannot hide a regime
    (e.g. very peaked attention) where the radius under-covers."""
    cells, _ = certified_cells(steps)
    rows = []
    for regime, edges in (("tail_mass", tail_mass_bins), ("p_max", p_max_bins)):
        bins = pd.cut(cells[regime].astype(np.float64), bins=list(edges), include_lowest=True)
        for interval, group in cells[list(POOLED_COLUMNS)].groupby(bins, observed=True, sort=True):
            res = pooled_coverage(group, level, n_boot, seed, alpha)
            rows.append(
                {"regime": regime, "bin": str(interval), "bin_lo": interval.left, "bin_hi": interval.right, **res}
            )
    return pd.DataFrame(rows)


def split_examples(example_ids: Sequence[str] | np.ndarray, seed: int) -> tuple[set, set]:
    """Deterministic half split of the examples (calibration, test)."""
    ids = np.array(sorted(set(np.asarray(example_ids).tolist())), dtype=object)
    perm = np.random.default_rng(seed).permutation(len(ids))
    half = len(ids) // 2
    return set(ids[perm[:half]].tolist()), set(ids[perm[half:]].tolist())


def conformal_quantile(scores: np.ndarray, level: float) -> float:
    """Split-conformal quantile: the ceil((n + 1) * level)-th smallest score (inf when that exceeds n)."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    n = len(s)
    k = math.ceil((n + 1) * level)
    return float(s[k - 1]) if 0 < k <= n else float("inf")


def conformal_multiplier(
    steps: pd.DataFrame,
    level: float = 0.95,
    split_seed: int = 0,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """Calibrate q (quantile of error / sqrt(V_hat)) on half the examples and check q * sqrt(V_hat) on the rest.

    The finite-sample guarantee assumes exchangeable cells; cells within an example are not, which is why the test
    coverage is reported with an example-cluster interval rather than taken on faith.
    """
    cells, _ = certified_cells(steps)
    cal_ids, test_ids = split_examples(cells["example_id"].unique(), split_seed)  # the ids, not every cell's
    ratio = standardized_error(cells)
    in_cal = cells["example_id"].isin(cal_ids).to_numpy()
    q = conformal_quantile(ratio[in_cal], level)
    z = z_value(level)
    test_ratio = ratio[~in_cal]
    test_clusters = cells["example_id"][~in_cal]  # the one column the test half needs, not a copy of every column
    cov_q, n = _cluster_counts(test_ratio <= q, test_clusters)
    cov_z, _ = _cluster_counts(test_ratio <= z, test_clusters)
    ci_q = ratio_of_sums(cov_q, n, n_boot, seed, alpha)
    ci_z = ratio_of_sums(cov_z, n, n_boot, seed, alpha)
    return {
        "level": level,
        "q": q,
        "multiplier": q / z,
        "coverage_test": ci_q.as_dict(),
        "coverage_test_gaussian": ci_z.as_dict(),
        "n_cal_examples": len(cal_ids),
        "n_test_examples": len(test_ids),
        "n_cal_cells": int(in_cal.sum()),
        "n_test_cells": int((~in_cal).sum()),
    }
