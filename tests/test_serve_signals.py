"""The answer-level signal models `kvcert calibrate` stores (kvcert.serve.signals): the plain-number logistic model
equals scikit-learn's own prediction, the calibration file's risk functions read it back, a signal that carries
the failures ranks them, and the tolerance report counts what it says."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression

from kvcert.serve.calibration import Calibration
from kvcert.serve.signals import COMBINED_FEATURES, fit_logistic, fit_signals, predict, tolerance_outcomes


def _answers(n: int = 400, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    probe = rng.uniform(0, 0.5, n)
    failure = rng.uniform(size=n) < 1 / (1 + np.exp(-(probe - 0.25) * 20))  # the probe carries the failures
    return pd.DataFrame(
        dict(
            example_id=[f"e{i // 2}" for i in range(n)],
            budget=np.where(np.arange(n) % 2, 0.25, 0.5),
            full_correct=True,
            correct=~failure,
            certificate=rng.uniform(0, 1, n),  # noise
            logprob=-rng.exponential(1.0, n),  # noise
            probe_error=probe,
        )
    )


def test_the_stored_model_predicts_what_scikit_learn_predicts():
    df = _answers()
    df["cache_failure"] = ~df["correct"]
    model = fit_logistic(df, COMBINED_FEATURES, "cache_failure")
    x = df[list(COMBINED_FEATURES)].to_numpy(np.float64)
    standardized = (x - x.mean(0)) / x.std(0)
    reference = (
        LogisticRegression(C=1.0, max_iter=1000).fit(standardized, df["cache_failure"]).predict_proba(standardized)
    )
    assert np.allclose(predict(model, df), reference[:, 1], atol=1e-6)
    cal = Calibration(model="m", n_layers=1, policy={}, budgets=[0.25], multipliers=[1.0], models={"combined": model})
    row = df.iloc[3]
    risk = cal.combined_risk(row.certificate, row.logprob, row.probe_error, row.budget)
    assert risk == pytest.approx(reference[3, 1], abs=1e-6)
    assert cal.probe_risk(0.1, 0.25) is None  # no probe model in this file
    assert fit_logistic(df.assign(cache_failure=False), COMBINED_FEATURES, "cache_failure") is None


def test_the_signal_that_carries_the_failures_ranks_them_and_the_tolerance_report_counts():
    df = _answers(seed=1)
    ids = sorted(df["example_id"].unique())
    cal_ids, test_ids = ids[::2], ids[1::2]
    out = fit_signals(df, cal_ids, test_ids, rates=(0.1, 0.3))
    auroc = out["report"]["signal_auroc"]
    assert auroc["probe"] > 0.8 and auroc["combined"] > 0.8 and abs(auroc["certificate"] - 0.5) < 0.15
    assert set(out["models"]) == {"probe", "combined"}
    assert out["signal_thresholds"]["probe"]["0.1"] > out["signal_thresholds"]["probe"]["0.3"]
    assert set(out["report"]["signal_auroc_by_budget"]) == {"0.25", "0.5"}


def test_the_tolerance_report_replays_the_rule_example_by_example():
    """Two examples, budgets 0.25 / 0.5: the rule takes the smallest budget within t, else the full cache."""
    answers = pd.DataFrame(
        dict(
            example_id=["a", "a", "b", "b"],
            budget=[0.25, 0.5, 0.25, 0.5],
            probe_error=[0.30, 0.08, 0.05, 0.02],
            correct=[False, True, True, True],
            full_correct=[True, True, False, False],
        )
    )
    out = tolerance_outcomes(answers, tolerances=(0.01, 0.06, 0.5))
    assert out["0.01"] == dict(mean_budget=1.0, share_full=1.0, accuracy=0.5, cache_failure_rate=0.0, n=2)
    assert out["0.06"]["mean_budget"] == pytest.approx((1.0 + 0.25) / 2)  # a: nothing within 0.06 -> full
    assert out["0.5"] == dict(mean_budget=0.25, share_full=0.0, accuracy=0.5, cache_failure_rate=1.0, n=2)
