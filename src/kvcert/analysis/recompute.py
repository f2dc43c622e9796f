"""C7: recompute the most suspicious examples with the full cache, over recompute budgets 0..0.5.

A recomputed row takes its full_correct, the others keep correct. Each ranking gives an accuracy-recovery curve;
its area (trapezoid over the budget grid, divided by the grid's width, so: the mean accuracy over the range, in
points) summarizes it. Random ranking is computed in expectation; the oracle puts cache-induced failures first
and rows that recomputation would break last.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvcert.analysis.accuracy import POINTS
from kvcert.analysis.auroc import finite_rows
from kvcert.analysis.bootstrap import bootstrap_many
from kvcert.analysis.gating import descending_groups, fractional_top

DEFAULT_BUDGETS = tuple(np.round(np.linspace(0.0, 0.5, 11), 4).tolist())


def _rankings(examples: pd.DataFrame) -> dict[str, np.ndarray | None]:
    gain = examples["full_correct"].to_numpy(np.float64) - examples["correct"].to_numpy(np.float64)
    return {
        "certificate": descending_groups(examples["cert_score"].to_numpy(np.float64)),
        "confidence": descending_groups(-examples["logprob_mean"].to_numpy(np.float64)),
        "random": None,
        "oracle": descending_groups(gain),
    }


def _curve_fn(examples: pd.DataFrame, groups: np.ndarray | None, budgets: Sequence[float]):
    """Weights -> accuracy (fraction) at each recompute budget."""
    correct = examples["correct"].to_numpy(np.float64)
    gain = examples["full_correct"].to_numpy(np.float64) - correct
    budgets = np.asarray(budgets, dtype=np.float64)

    def curve(w: np.ndarray) -> np.ndarray:
        total = w.sum()
        if total <= 0:
            return np.full(len(budgets), np.nan)
        out = np.empty(len(budgets))
        for i, b in enumerate(budgets):
            sel = np.full(len(w), b) if groups is None else fractional_top(groups, w, b)
            out[i] = w @ (correct + sel * gain) / total
        return out

    return curve


def normalized_area(budgets: Sequence[float], accuracy: np.ndarray) -> float:
    """Trapezoid area under accuracy(budget), divided by the budget range."""
    b = np.asarray(budgets, dtype=np.float64)
    y = np.asarray(accuracy, dtype=np.float64)
    return float(np.sum((y[1:] + y[:-1]) * np.diff(b)) / 2 / (b[-1] - b[0]))


def recompute_curves(examples: pd.DataFrame, budgets: Sequence[float] = DEFAULT_BUDGETS) -> pd.DataFrame:
    """Accuracy (points) per ranking and recompute budget, with the full-cache accuracy for reference."""
    ex, _ = finite_rows(examples, ["cert_score", "logprob_mean"])
    ones = np.ones(len(ex))
    full = POINTS * ex["full_correct"].to_numpy(np.float64).mean() if len(ex) else float("nan")
    rows = []
    for name, groups in _rankings(ex).items():
        acc = _curve_fn(ex, groups, budgets)(ones)
        rows += [{"policy": name, "budget": float(b), "accuracy": POINTS * a, "full_accuracy": full}
                 for b, a in zip(budgets, acc, strict=True)]
    return pd.DataFrame(rows)


def recompute_areas(
    examples: pd.DataFrame,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """Normalized area per ranking (points) and the paired differences certificate - random, - confidence."""
    ex, excluded = finite_rows(examples, ["cert_score", "logprob_mean"])
    curves = {name: _curve_fn(ex, groups, budgets) for name, groups in _rankings(ex).items()}
    area = {name: (lambda w, f=f: normalized_area(budgets, f(w))) for name, f in curves.items()}
    derived = {
        "diff_random": lambda v: v["certificate"] - v["random"],
        "diff_confidence": lambda v: v["certificate"] - v["confidence"],
    }
    res = bootstrap_many(area, ex["example_id"], n_boot, seed, alpha, derived=derived)
    return {name: ci.scaled(POINTS).as_dict() for name, ci in res.items()} | {
        "budgets": list(budgets),
        "n_rows": len(ex),
        "n_excluded": excluded,
        "n_examples": int(ex["example_id"].nunique()),
        "n_cache_induced": int((ex["full_correct"].astype(bool) & ~ex["correct"].astype(bool)).sum()),
    }
