"""The answer-level signals `kvcert calibrate` fits beside the certificate's multipliers: the prefill probe's model,
the combined model, their escalation thresholds, held-out discrimination, and what a tolerance means.

Each answer of the calibration data carries four signals: its largest token certificate (`certificate`), its lowest
token log-probability (`logprob`, the model's own confidence), the prefill probe's error (`probe_error`,
kvcert.serve.probe) and the budget. On the calibration half, among answers the full cache got right, two logistic
models (scikit-learn, standardized features) are fitted for a cache-induced failure (the full cache right, the policy
wrong): "probe" on (probe_error, budget), available before decoding, and "combined" on all four. Both are stored
as plain numbers in the calibration file, so using them needs no scikit-learn. On the other half the file reports each
signal's AUROC for cache-induced failures (pooled over budgets, and within each budget, since the budget alone
separates failures), the thresholds that escalate a share r of answers (quantiles on the calibration half) and, for
a grid of tolerances t, what `generate(..., tolerance=t)` does on those examples: each takes the smallest fitted
budget whose probe error is within t (else the full cache), and the report gives the mean budget taken, the share
sent to the full cache, the accuracy and the cache-induced failure rate among examples the full cache got right.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

PROBE_FEATURES = ("probe_error", "budget")
COMBINED_FEATURES = ("certificate", "logprob", "probe_error", "budget")
TOLERANCES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
# the score each signal ranks answers by (larger: more likely a cache-induced failure)
SCORES = {"certificate": "certificate", "confidence": "neg_logprob", "probe": "probe_error", "combined": "combined"}


def fit_logistic(frame: pd.DataFrame, features: tuple[str, ...], label: str) -> dict | None:
    """A standardized logistic regression as plain numbers (None when the labels are all one class)."""
    from sklearn.linear_model import LogisticRegression

    data = frame.dropna(subset=[*features, label])
    y = data[label].to_numpy(bool)
    if len(data) < 4 or y.all() or not y.any():
        return None
    x = data[list(features)].to_numpy(np.float64)
    mean, scale = x.mean(0), x.std(0)
    scale = np.where(scale > 0, scale, 1.0)
    fit = LogisticRegression(C=1.0, max_iter=1000).fit((x - mean) / scale, y)
    return dict(
        features=list(features),
        mean=mean.tolist(),
        scale=scale.tolist(),
        coef=fit.coef_[0].tolist(),
        intercept=float(fit.intercept_[0]),
        n=int(len(data)),
        n_failures=int(y.sum()),
    )


def predict(model: dict, frame: pd.DataFrame) -> np.ndarray:
    x = frame[model["features"]].to_numpy(np.float64)
    z = model["intercept"] + ((x - np.array(model["mean"])) / np.array(model["scale"])) @ np.array(model["coef"])
    return 1.0 / (1.0 + np.exp(-z))


def tolerance_outcomes(answers: pd.DataFrame, tolerances=TOLERANCES) -> dict:
    """What the tolerance rule does on these examples: per example the smallest budget whose probe error is within t
    (else the full cache, whose answer is the full cache's); mean budget, share at the full cache, accuracy and the
    cache-induced failure rate among examples the full cache got right."""
    out = {}
    for t in tolerances:
        chosen = []
        for _, group in answers.sort_values("budget").groupby("example_id", sort=True):
            within = group[group["probe_error"] <= t]
            if len(within):
                row = within.iloc[0]
                chosen.append((float(row["budget"]), bool(row["correct"]), bool(row["full_correct"])))
            else:
                full = bool(group["full_correct"].iloc[0])
                chosen.append((1.0, full, full))
        frame = pd.DataFrame(chosen, columns=["budget", "correct", "full_correct"])
        right = frame[frame["full_correct"]]
        out[f"{t:g}"] = dict(
            mean_budget=float(frame["budget"].mean()) if len(frame) else math.nan,
            share_full=float((frame["budget"] >= 1.0).mean()) if len(frame) else math.nan,
            accuracy=float(frame["correct"].mean()) if len(frame) else math.nan,
            cache_failure_rate=float((~right["correct"]).mean()) if len(right) else math.nan,
            n=int(len(frame)),
        )
    return out


def fit_signals(answers: pd.DataFrame, cal_ids, test_ids, rates) -> dict:
    """Models, thresholds and the held-out report (see the module docstring). answers: one row per (example,
    budget) with example_id, budget, correct, full_correct, certificate, logprob, probe_error."""
    from kvcert.analysis.auroc import auroc

    df = answers.copy()
    df["cache_failure"] = df["full_correct"] & ~df["correct"]
    df["neg_logprob"] = -df["logprob"]
    cal = df[df["example_id"].isin(cal_ids)]
    right = cal[cal["full_correct"]]
    models = {}
    for name, features in (("probe", PROBE_FEATURES), ("combined", COMBINED_FEATURES)):
        model = fit_logistic(right, features, "cache_failure")
        if model is not None:
            models[name] = model
    if "combined" in models:
        ok = df[list(COMBINED_FEATURES)].notna().all(axis=1)
        df.loc[ok, "combined"] = predict(models["combined"], df[ok])
    else:
        df["combined"] = np.nan
    cal = df[df["example_id"].isin(cal_ids)]
    thresholds = {}
    for signal in ("probe", "combined"):
        scores = cal[SCORES[signal]].dropna().to_numpy()
        if len(scores):
            thresholds[signal] = {f"{r:g}": float(np.quantile(scores, 1 - r)) for r in rates}
    held = df[df["example_id"].isin(test_ids) & df["full_correct"]]
    aurocs = {}
    # collected with draws (kvcert calibrate --draws): the draws' disagreement is a signal too
    scores_of = {**SCORES, "agreement": "disagreement"} if "disagreement" in df.columns else SCORES
    for signal, column in scores_of.items():
        ok = held[column].notna()
        labels, scores = held.loc[ok, "cache_failure"].to_numpy(bool), held.loc[ok, column].to_numpy()
        aurocs[signal] = float(auroc(labels, scores)) if 0 < labels.sum() < len(labels) else math.nan
    by_budget = {}
    for budget, group in held.groupby("budget"):
        by_budget[f"{budget:g}"] = {}
        for signal, column in scores_of.items():
            ok = group[column].notna()
            labels, scores = group.loc[ok, "cache_failure"].to_numpy(bool), group.loc[ok, column].to_numpy()
            value = auroc(labels, scores) if 0 < labels.sum() < len(labels) else math.nan
            by_budget[f"{budget:g}"][signal] = float(value)
    test = df[df["example_id"].isin(test_ids)]
    report = dict(
        signal_auroc=aurocs,
        signal_auroc_by_budget=by_budget,
        tolerance=tolerance_outcomes(test),
        tolerance_unit="relative attention error of the window's queries (kvcert.serve.probe)",
        probe_error_by_budget={f"{b:g}": float(g["probe_error"].median()) for b, g in df.groupby("budget")},
    )
    return dict(models=models, signal_thresholds=thresholds, report=report, answers=df)
