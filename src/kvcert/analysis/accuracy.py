"""C2 (randomizing costs no accuracy) and C3 (eviction vs the full cache): accuracies and paired differences.

Accuracies and differences are reported in percentage points. Pairing is by example: a unit is one example in one
cell (e.g. scorer x budget), its accuracy per arm the mean over that arm's rows (seeds) in the cell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from kvcert.analysis.bootstrap import Interval, cluster_bootstrap, paired_difference, weighted_mean

POINTS = 100.0


def row_mask(df: pd.DataFrame, filters: Mapping[str, object] | None) -> np.ndarray:
    """Rows matching every filter: a scalar means equality, a list means membership; floats compare with isclose."""
    mask = np.ones(len(df), dtype=bool)
    for column, wanted in (filters or {}).items():
        if column not in df.columns:
            raise KeyError(f"filter on unknown column {column!r}")
        values = list(wanted) if isinstance(wanted, (list, tuple, set)) else [wanted]
        col = df[column]
        if pd.api.types.is_float_dtype(col) and all(isinstance(v, (int, float)) for v in values):
            x = col.to_numpy(np.float64)
            hit = np.zeros(len(df), dtype=bool)
            for v in values:
                hit |= np.isclose(x, float(v), rtol=0.0, atol=1e-9)
        else:
            hit = col.isin(values).to_numpy()
        mask &= hit
    return mask


def select_rows(df: pd.DataFrame, filters: Mapping[str, object] | None) -> pd.DataFrame:
    return df.loc[row_mask(df, filters)]


def paired_means(
    a: np.ndarray,
    b: np.ndarray,
    clusters: Sequence | np.ndarray | pd.Series,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    diff: np.ndarray | None = None,
) -> dict[str, Interval]:
    """Mean of a, of b and of the paired differences (a - b unless given), in points, on the same example-cluster
    resamples (bootstrap.paired_difference)."""
    res = paired_difference(
        weighted_mean(a),
        weighted_mean(b),
        clusters,
        n_boot,
        seed,
        alpha,
        diff=weighted_mean(a - b if diff is None else diff),
    )
    return {k: v.scaled(POINTS) for k, v in res.items()}


def accuracy_table(
    examples: pd.DataFrame,
    by: Sequence[str] = ("scorer", "design", "budget"),
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """Accuracy (points) per group with an example-cluster interval."""
    rows = []
    for key, group in examples.groupby(list(by), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        ci = cluster_bootstrap(
            weighted_mean(group["correct"].to_numpy(np.float64)), group["example_id"], n_boot, seed, alpha
        ).scaled(POINTS)
        rows.append(
            {
                **dict(zip(by, key, strict=True)),
                "accuracy": ci.estimate,
                "lo": ci.lo,
                "hi": ci.hi,
                "n_rows": len(group),
                "n_examples": ci.n_clusters,
            }
        )
    return pd.DataFrame(rows)


def drop_vs_full(examples: pd.DataFrame, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05) -> dict:
    """Full-cache accuracy minus policy accuracy (points), paired on each row through its full_correct flag."""
    res = paired_means(
        examples["full_correct"].to_numpy(np.float64),
        examples["correct"].to_numpy(np.float64),
        examples["example_id"],
        n_boot,
        seed,
        alpha,
    )
    return {
        "drop": res["diff"].as_dict(),
        "full_accuracy": res["a"].as_dict(),
        "policy_accuracy": res["b"].as_dict(),
        "n_rows": len(examples),
        "n_examples": res["diff"].n_clusters,
    }


def accuracy_vs_budget(
    examples: pd.DataFrame,
    by: Sequence[str] = ("scorer", "design"),
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> pd.DataFrame:
    """Per policy (scorer x design) and budget: accuracy and the paired drop vs the full cache, in points.

    Full-cache rows (design 'full') are left out of the grid; their accuracy is the full_accuracy column."""
    grid = examples[examples["design"] != "full"]
    rows = []
    for key, group in grid.groupby([*by, "budget"], sort=True):
        res = drop_vs_full(group, n_boot, seed, alpha)
        rows.append(
            {
                **dict(zip([*by, "budget"], key, strict=True)),
                "accuracy": res["policy_accuracy"]["estimate"],
                "lo": res["policy_accuracy"]["lo"],
                "hi": res["policy_accuracy"]["hi"],
                "full_accuracy": res["full_accuracy"]["estimate"],
                "drop": res["drop"]["estimate"],
                "drop_lo": res["drop"]["lo"],
                "drop_hi": res["drop"]["hi"],
                "n_examples": res["n_examples"],
            }
        )
    return pd.DataFrame(rows)


def paired_units(
    examples: pd.DataFrame,
    arm_a: Mapping[str, object],
    arm_b: Mapping[str, object],
    pair_on: Sequence[str] = ("scorer", "budget"),
) -> pd.DataFrame:
    """One row per (example, cell) present in both arms: acc_a, acc_b (fractions) and diff = acc_a - acc_b."""
    keys = ["example_id", *pair_on]
    a = select_rows(examples, arm_a).groupby(keys)["correct"].mean().rename("acc_a")
    b = select_rows(examples, arm_b).groupby(keys)["correct"].mean().rename("acc_b")
    units = pd.concat([a, b], axis=1, join="inner").reset_index()
    units["acc_a"] = units["acc_a"].astype(np.float64)
    units["acc_b"] = units["acc_b"].astype(np.float64)
    units["diff"] = units["acc_a"] - units["acc_b"]
    return units


def paired_accuracy_difference(
    examples: pd.DataFrame,
    arm_a: Mapping[str, object],
    arm_b: Mapping[str, object],
    pair_on: Sequence[str] = ("scorer", "budget"),
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """Mean over paired units of acc_a - acc_b (points) with a paired example-cluster interval, plus per cell."""
    units = paired_units(examples, arm_a, arm_b, pair_on)
    res = paired_means(
        units["acc_a"].to_numpy(),
        units["acc_b"].to_numpy(),
        units["example_id"],
        n_boot,
        seed,
        alpha,
        diff=units["diff"].to_numpy(),
    )
    cells = []
    if len(units):
        for key, group in units.groupby(list(pair_on), sort=True):
            ci = cluster_bootstrap(weighted_mean(group["diff"].to_numpy()), group["example_id"], n_boot, seed, alpha)
            ci = ci.scaled(POINTS)
            cells.append(
                {
                    **dict(zip(pair_on, key if isinstance(key, tuple) else (key,), strict=True)),
                    "diff": ci.estimate,
                    "lo": ci.lo,
                    "hi": ci.hi,
                    "acc_a": POINTS * group["acc_a"].mean(),
                    "acc_b": POINTS * group["acc_b"].mean(),
                    "n_examples": ci.n_clusters,
                }
            )
    return {
        "diff": res["diff"].as_dict(),
        "acc_a": res["a"].as_dict(),
        "acc_b": res["b"].as_dict(),
        "n_units": len(units),
        "n_examples": res["diff"].n_clusters,
        "cells": pd.DataFrame(cells),
    }
