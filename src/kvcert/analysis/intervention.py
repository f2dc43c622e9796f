"""C5 and C7: one ranked-intervention analysis, parameterised by a (base, improved) pair of outcome columns.

An intervention turns a row's `base` outcome into its `improved` outcome; a ranking (a score column, highest
first) decides which rows get it, at a matched fraction of the rows. Selection is fractional: ties at the cut, and
bootstrap duplicates, share the remaining fraction, which is the expectation over random tie-breaking. Random
ranking is computed exactly (every row intervened with probability = fraction), not by sampling; the oracle ranks
by the gain itself (an upper bound).

C5, budget escalation: a unit is one example under one policy (scorer, design, seed, design parameters) logged at
both budgets; base = correct at the low budget, improved = correct at the high budget, rankings by the low-budget
certificate and confidence, at matched escalation rates.

C7, recomputation with the full cache: base = correct, improved = full_correct, over recompute budgets 0..0.5.
Each ranking gives an accuracy-recovery curve; its area (trapezoid over the budget grid, divided by the grid's
width, so: the mean accuracy over the range, in points) summarizes it. The oracle puts cache-induced failures first
and rows that recomputation would break last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from kvcert.analysis.accuracy import POINTS, select_rows
from kvcert.analysis.auroc import finite_rows
from kvcert.analysis.bootstrap import bootstrap_many

POLICY_KEYS = (
    "example_id",
    "task",
    "scorer",
    "design",
    "seed",
    "tail_fraction",
    "floor",
    "score_power",
    "question_aware",
)
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5)
DEFAULT_BUDGETS = tuple(np.round(np.linspace(0.0, 0.5, 11), 4).tolist())


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


class RankedIntervention:
    """Rows with a base and an improved outcome, and the rankings that choose which rows are intervened on.

    `scores` maps a ranking name to its score column (highest first); 'random' (in exact expectation) and
    'oracle' (ranked by the gain) are always added after them."""

    def __init__(self, rows: pd.DataFrame, *, base: str, improved: str, scores: Mapping[str, str]):
        self.base = rows[base].to_numpy(np.float64)
        self.gain = rows[improved].to_numpy(np.float64) - self.base
        self.clusters = rows["example_id"]
        self.groups: dict[str, np.ndarray | None] = {
            **{name: descending_groups(rows[column].to_numpy(np.float64)) for name, column in scores.items()},
            "random": None,
            "oracle": descending_groups(self.gain),
        }

    def __len__(self) -> int:
        return len(self.base)

    def curve(self, ranking: str | None, fractions: Sequence[float]) -> Callable[[np.ndarray], np.ndarray]:
        """Weights -> mean outcome (fraction) after intervening on each fraction of the rows, best first under
        `ranking` (None: every row with probability = fraction, as random ranking does)."""
        groups = None if ranking is None else self.groups[ranking]
        fractions = np.asarray(fractions, dtype=np.float64)
        base, gain = self.base, self.gain

        def curve(w: np.ndarray) -> np.ndarray:
            total = w.sum()
            if total <= 0:
                return np.full(len(fractions), np.nan)
            out = np.empty(len(fractions))
            for i, f in enumerate(fractions):
                sel = np.full(len(w), f) if groups is None else fractional_top(groups, w, f)
                out[i] = w @ (base + sel * gain) / total
            return out

        return curve

    def curves(self, fractions: Sequence[float]) -> dict[str, np.ndarray]:
        """Mean outcome (fraction) per ranking at each fraction, at unit weights."""
        ones = np.ones(len(self))
        return {name: self.curve(name, fractions)(ones) for name in self.groups}

    def bootstrap(
        self,
        stats: Mapping[str, Callable[[np.ndarray], float]],
        derived: Mapping[str, Callable[[dict[str, float]], float]],
        n_boot: int,
        seed: int,
        alpha: float,
    ) -> dict[str, dict]:
        """Every stat (weights -> float) on the same example-cluster resamples, in points."""
        res = bootstrap_many(dict(stats), self.clusters, n_boot, seed, alpha, derived=dict(derived))
        return {name: ci.scaled(POINTS).as_dict() for name, ci in res.items()}


DIFFERENCES = {
    "random": lambda v: v["certificate"] - v["random"],
    "confidence": lambda v: v["certificate"] - v["confidence"],
}


# --------------------------------------------------------------------------------------------- C5: escalation
def escalation_units(
    examples: pd.DataFrame, low: Mapping[str, object], high: Mapping[str, object]
) -> tuple[pd.DataFrame, int]:
    """Units logged at both budgets: correct_lo, correct_hi, cert (low budget), confidence (-logprob, low budget).

    Units with a non-finite score are excluded and counted; repeated runs of one unit are averaged."""
    keys = [k for k in POLICY_KEYS if k in examples.columns]
    lo = select_rows(examples, low)
    hi = select_rows(examples, high)
    lo = lo.groupby(keys, dropna=False).agg(
        correct_lo=("correct", "mean"),
        cert=("cert_score", "mean"),
        logprob=("logprob_mean", "mean"),
        full_correct=("full_correct", "mean"),
    )
    hi = hi.groupby(keys, dropna=False).agg(correct_hi=("correct", "mean"))
    units = lo.join(hi, how="inner").reset_index()
    units["confidence"] = -units["logprob"].astype(np.float64)
    for c in ("correct_lo", "correct_hi", "cert", "full_correct"):
        units[c] = units[c].astype(np.float64)
    ok = np.isfinite(units["cert"].to_numpy()) & np.isfinite(units["confidence"].to_numpy())
    return units.loc[ok].reset_index(drop=True), int((~ok).sum())


def escalation(units: pd.DataFrame) -> RankedIntervention:
    """Escalation from the low to the high budget, ranked by the low-budget certificate and confidence."""
    return RankedIntervention(
        units, base="correct_lo", improved="correct_hi", scores={"certificate": "cert", "confidence": "confidence"}
    )


def escalation_curves(units: pd.DataFrame, rates: Sequence[float] = DEFAULT_RATES) -> pd.DataFrame:
    """Accuracy (points) after escalation per policy and rate."""
    curves = escalation(units).curves(rates)
    return pd.DataFrame(
        [
            {"policy": name, "rate": float(rate), "accuracy": POINTS * float(acc)}
            for name, curve in curves.items()
            for rate, acc in zip(rates, curve, strict=True)
        ]
    )


def escalation_gain(units: pd.DataFrame, rate: float, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05) -> dict:
    """At one rate: accuracy per policy and the paired gains certificate - random, certificate - confidence."""
    esc = escalation(units)

    def at(ranking: str | None, fraction: float) -> Callable[[np.ndarray], float]:
        curve = esc.curve(ranking, [fraction])
        return lambda w: float(curve(w)[0])

    stats = {name: at(name, rate) for name in esc.groups} | {"low": at(None, 0.0), "high": at(None, 1.0)}
    derived = {f"gain_{name}": fn for name, fn in DIFFERENCES.items()}
    return esc.bootstrap(stats, derived, n_boot, seed, alpha) | {
        "rate": rate,
        "n_units": len(units),
        "n_examples": int(units["example_id"].nunique()),
    }


# ------------------------------------------------------------------------------------------ C7: recomputation
def recomputation(examples: pd.DataFrame) -> tuple[RankedIntervention, pd.DataFrame, int]:
    """Recomputation with the full cache over the rows with finite scores (and how many were excluded)."""
    ex, excluded = finite_rows(examples, ["cert_score", "logprob_mean"])
    ranked = ex.assign(confidence=-ex["logprob_mean"].to_numpy(np.float64))
    return (
        RankedIntervention(
            ranked,
            base="correct",
            improved="full_correct",
            scores={"certificate": "cert_score", "confidence": "confidence"},
        ),
        ex,
        excluded,
    )


def normalized_area(budgets: Sequence[float], accuracy: np.ndarray) -> float:
    """Trapezoid area under accuracy(budget), divided by the budget range."""
    b = np.asarray(budgets, dtype=np.float64)
    y = np.asarray(accuracy, dtype=np.float64)
    return float(np.sum((y[1:] + y[:-1]) * np.diff(b)) / 2 / (b[-1] - b[0]))


def recompute_curves(examples: pd.DataFrame, budgets: Sequence[float] = DEFAULT_BUDGETS) -> pd.DataFrame:
    """Accuracy (points) per ranking and recompute budget, with the full-cache accuracy for reference."""
    rec, ex, _ = recomputation(examples)
    full = POINTS * ex["full_correct"].to_numpy(np.float64).mean() if len(ex) else float("nan")
    return pd.DataFrame(
        [
            {"policy": name, "budget": float(b), "accuracy": POINTS * a, "full_accuracy": full}
            for name, curve in rec.curves(budgets).items()
            for b, a in zip(budgets, curve, strict=True)
        ]
    )


def recompute_areas(
    examples: pd.DataFrame,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """Normalized area per ranking (points) and the paired differences certificate - random, - confidence."""
    rec, ex, excluded = recomputation(examples)

    def area(ranking: str | None) -> Callable[[np.ndarray], float]:
        curve = rec.curve(ranking, budgets)
        return lambda w: normalized_area(budgets, curve(w))

    stats = {name: area(name) for name in rec.groups}
    derived = {f"diff_{name}": fn for name, fn in DIFFERENCES.items()}
    return rec.bootstrap(stats, derived, n_boot, seed, alpha) | {
        "budgets": list(budgets),
        "n_rows": len(ex),
        "n_excluded": excluded,
        "n_examples": int(ex["example_id"].nunique()),
        "n_cache_induced": int((ex["full_correct"].astype(bool) & ~ex["correct"].astype(bool)).sum()),
    }
