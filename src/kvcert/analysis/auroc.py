"""C4 (predicting failure) and C6 (attributing failures to the cache): AUROCs and paired AUROC differences.

The point estimate uses sklearn.roc_auc_score. Bootstrap resamples reuse one sort of the scores: with cluster
weights the AUROC is the weighted Mann-Whitney statistic, computed per resample with bincounts (tested equal to
sklearn with sample_weight).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score, roc_curve

from kvcert.analysis.bootstrap import paired_difference


def degenerate_reason(labels: np.ndarray) -> str | None:
    """Why an AUROC is undefined for these labels, or None when both classes are present."""
    y = np.asarray(labels, dtype=bool)
    if y.size == 0:
        return "no rows"
    if y.all():
        return "no negatives (every row is positive)"
    if not y.any():
        return "no positives (every row is negative)"
    return None


def auroc(labels: np.ndarray, scores: np.ndarray, weights: np.ndarray | None = None) -> float:
    """AUROC of scores for the positive class; NaN when one class is missing."""
    y = np.asarray(labels, dtype=bool)
    if degenerate_reason(y) is not None:
        return float("nan")
    return float(roc_auc_score(y, np.asarray(scores, dtype=np.float64), sample_weight=weights))


def weighted_auroc_stat(labels: np.ndarray, scores: np.ndarray):
    """A bootstrap Stat: weighted AUROC (ties count one half), NaN when a resample lacks a class."""
    y = np.asarray(labels, dtype=bool)
    _, groups = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True)  # ascending score groups
    n_groups = int(groups.max()) + 1 if groups.size else 0
    pos = y.astype(np.float64)
    neg = 1.0 - pos

    def stat(w: np.ndarray) -> float:
        wp = np.bincount(groups, weights=w * pos, minlength=n_groups)
        wn = np.bincount(groups, weights=w * neg, minlength=n_groups)
        total_p, total_n = wp.sum(), wn.sum()
        if total_p <= 0 or total_n <= 0:
            return float("nan")
        below = np.cumsum(wn) - wn
        return float((wp * (below + 0.5 * wn)).sum() / (total_p * total_n))

    return stat


def paired_auroc(
    labels: np.ndarray,
    score_a: np.ndarray,
    score_b: np.ndarray,
    clusters: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """AUROC(a), AUROC(b) and AUROC(a) - AUROC(b) on the same example-cluster resamples.

    Never raises on degenerate input: the estimates are NaN and `reason` says why."""
    y = np.asarray(labels, dtype=bool)
    a = np.asarray(score_a, dtype=np.float64)
    b = np.asarray(score_b, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    reason = degenerate_reason(y)
    if reason is None and not (np.isfinite(a).all() and np.isfinite(b).all()):
        reason = "non-finite scores"
    if reason is not None:
        nan = {
            "estimate": float("nan"),
            "lo": float("nan"),
            "hi": float("nan"),
            "n_clusters": 0,
            "n_boot": n_boot,
            "n_valid": 0,
        }
        return {
            "auc_a": dict(nan),
            "auc_b": dict(nan),
            "diff": dict(nan),
            "n_pos": n_pos,
            "n_neg": n_neg,
            "reason": reason,
        }
    stat_a, stat_b = weighted_auroc_stat(y, a), weighted_auroc_stat(y, b)
    res = paired_difference(stat_a, stat_b, clusters, n_boot, seed, alpha)
    out = {"auc_a": res["a"].as_dict(), "auc_b": res["b"].as_dict(), "diff": res["diff"].as_dict()}
    # sklearn for the reported point estimates; the fast statistic is only for the resamples
    out["auc_a"]["estimate"] = auroc(y, a)
    out["auc_b"]["estimate"] = auroc(y, b)
    out["diff"]["estimate"] = out["auc_a"]["estimate"] - out["auc_b"]["estimate"]
    return {**out, "n_pos": n_pos, "n_neg": n_neg, "reason": None}


def roc_points(labels: np.ndarray, scores: np.ndarray) -> pd.DataFrame:
    """ROC curve (fpr, tpr) for figures; empty when one class is missing."""
    y = np.asarray(labels, dtype=bool)
    if degenerate_reason(y) is not None:
        return pd.DataFrame({"fpr": [], "tpr": []})
    fpr, tpr, _ = roc_curve(y, np.asarray(scores, dtype=np.float64))
    return pd.DataFrame({"fpr": fpr, "tpr": tpr})


def finite_rows(examples: pd.DataFrame, columns: list[str]) -> tuple[pd.DataFrame, int]:
    """Rows whose score columns are all finite, and how many were excluded."""
    ok = np.ones(len(examples), dtype=bool)
    for c in columns:
        ok &= np.isfinite(examples[c].to_numpy(np.float64))
    return examples.loc[ok], int((~ok).sum())


def failure_prediction(examples: pd.DataFrame, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05) -> dict:
    """C4: label failure = not correct; certificate score vs output confidence (-mean log-prob)."""
    ex, excluded = finite_rows(examples, ["cert_score", "logprob_mean"])
    labels = ~ex["correct"].to_numpy(bool)
    cert, conf = ex["cert_score"].to_numpy(np.float64), -ex["logprob_mean"].to_numpy(np.float64)
    res = paired_auroc(labels, cert, conf, ex["example_id"].to_numpy(), n_boot, seed, alpha)
    return {
        **res,
        "n_excluded": excluded,
        "n_rows": len(ex),
        "roc_cert": roc_points(labels, cert),
        "roc_confidence": roc_points(labels, conf),
    }


def failure_attribution(examples: pd.DataFrame, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05) -> dict:
    """C6: among failures, label cache-induced = the full cache was correct; certificate vs confidence."""
    failures = examples[~examples["correct"].astype(bool)]
    ex, excluded = finite_rows(failures, ["cert_score", "logprob_mean"])
    labels = ex["full_correct"].to_numpy(bool)
    cert, conf = ex["cert_score"].to_numpy(np.float64), -ex["logprob_mean"].to_numpy(np.float64)
    res = paired_auroc(labels, cert, conf, ex["example_id"].to_numpy(), n_boot, seed, alpha)
    return {
        **res,
        "n_excluded": excluded,
        "n_rows": len(ex),
        "n_failures": len(failures),
        "roc_cert": roc_points(labels, cert),
        "roc_confidence": roc_points(labels, conf),
    }
