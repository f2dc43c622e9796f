"""C5: escalate the most uncertain examples from a low to a high budget, at matched escalation rates.

A unit is one example under one policy (scorer, design, seed, design parameters) logged at both budgets. Escalating
a unit replaces its low-budget correctness by its high-budget correctness. Selection is fractional: ties at the
cut, and bootstrap duplicates, share the remaining budget, which is the expectation over random tie-breaking.
Random escalation is computed exactly (every unit escalated with probability = rate), not by sampling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from kvcert.analysis.accuracy import POINTS, select_rows
from kvcert.analysis.bootstrap import bootstrap_many

POLICY_KEYS = ("example_id", "task", "scorer", "design", "seed", "tail_fraction", "floor", "score_power",
               "question_aware")
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5)


def descending_groups(scores: np.ndarray) -> np.ndarray:
    """Tie-group code per row, 0 for the highest score."""
    _, inverse = np.unique(-np.asarray(scores, dtype=np.float64), return_inverse=True)
    return inverse.ravel()


def fractional_top(groups: np.ndarray, weights: np.ndarray, fraction: float) -> np.ndarray:
    """Per-row selected fraction so that the selected weight is `fraction` of the total, best groups first."""
    if groups.size == 0:
        return np.zeros(0)
    n_groups = int(groups.max()) + 1
    gw = np.bincount(groups, weights=weights, minlength=n_groups)
    before = np.cumsum(gw) - gw
    target = fraction * gw.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        take = np.clip((target - before) / gw, 0.0, 1.0)
    take = np.where(gw > 0, take, 0.0)
    return take[groups]


def escalation_units(
    examples: pd.DataFrame, low: Mapping[str, object], high: Mapping[str, object]
) -> tuple[pd.DataFrame, int]:
    """Units logged at both budgets: correct_lo, correct_hi, cert (low budget), confidence (-logprob, low budget).

    Units with a non-finite score are excluded and counted; repeated runs of one unit are averaged."""
    keys = [k for k in POLICY_KEYS if k in examples.columns]
    lo = select_rows(examples, low)
    hi = select_rows(examples, high)
    lo = lo.groupby(keys, dropna=False).agg(
        correct_lo=("correct", "mean"), cert=("cert_score", "mean"), logprob=("logprob_mean", "mean"),
        full_correct=("full_correct", "mean"))
    hi = hi.groupby(keys, dropna=False).agg(correct_hi=("correct", "mean"))
    units = lo.join(hi, how="inner").reset_index()
    units["confidence"] = -units["logprob"].astype(np.float64)
    for c in ("correct_lo", "correct_hi", "cert", "full_correct"):
        units[c] = units[c].astype(np.float64)
    ok = np.isfinite(units["cert"].to_numpy()) & np.isfinite(units["confidence"].to_numpy())
    return units.loc[ok].reset_index(drop=True), int((~ok).sum())


def _rankings(units: pd.DataFrame) -> dict[str, np.ndarray | None]:
    """Tie groups per gating score; None for random (computed in expectation)."""
    gain = units["correct_hi"].to_numpy() - units["correct_lo"].to_numpy()
    return {
        "certificate": descending_groups(units["cert"].to_numpy()),
        "confidence": descending_groups(units["confidence"].to_numpy()),
        "random": None,
        "oracle": descending_groups(gain),  # upper bound: escalate exactly the units that gain
    }


def _accuracy_stat(units: pd.DataFrame, groups: np.ndarray | None, rate: float):
    c_lo = units["correct_lo"].to_numpy()
    gain = units["correct_hi"].to_numpy() - c_lo

    def stat(w: np.ndarray) -> float:
        total = w.sum()
        if total <= 0:
            return float("nan")
        sel = np.full(len(w), rate) if groups is None else fractional_top(groups, w, rate)
        return float(w @ (c_lo + sel * gain) / total)

    return stat


def escalation_curves(units: pd.DataFrame, rates: Sequence[float] = DEFAULT_RATES) -> pd.DataFrame:
    """Accuracy (points) after escalation per policy and rate."""
    ranks = _rankings(units)
    ones = np.ones(len(units))
    rows = [
        {"policy": name, "rate": float(rate), "accuracy": POINTS * _accuracy_stat(units, groups, rate)(ones)}
        for name, groups in ranks.items()
        for rate in rates
    ]
    return pd.DataFrame(rows)


def escalation_gain(
    units: pd.DataFrame, rate: float, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> dict:
    """At one rate: accuracy per policy and the paired gains certificate - random, certificate - confidence."""
    ranks = _rankings(units)
    acc = {name: _accuracy_stat(units, groups, rate) for name, groups in ranks.items()}
    stats = {
        **acc,
        "low": _accuracy_stat(units, None, 0.0),
        "high": _accuracy_stat(units, None, 1.0),
    }
    derived = {
        "gain_random": lambda v: v["certificate"] - v["random"],
        "gain_confidence": lambda v: v["certificate"] - v["confidence"],
    }
    res = bootstrap_many(stats, units["example_id"], n_boot, seed, alpha, derived=derived)
    return {name: ci.scaled(POINTS).as_dict() for name, ci in res.items()} | {
        "rate": rate,
        "n_units": len(units),
        "n_examples": int(units["example_id"].nunique()),
    }
