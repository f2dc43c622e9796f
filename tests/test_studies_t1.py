"""Study 2's T1 adds the retained-data check to study 1's evaluation."""

from kvcert.analysis.claims import evaluate_t1
from kvcert.studies.t1 import evaluate_t1_study2

SPEC = {"ratio_band": [0.8, 1.25], "paper_verdict": "supported"}
GOOD = {
    "lambda": [0.0, 1.0, 10.0],
    "true_error_deterministic": [0.1, 0.2, 1.0],
    "estimate_deterministic": [0.0, 0.0, 0.0],
    "mse_randomized": [0.01, 0.011, 0.02],
    "mean_vhat_randomized": [0.01, 0.0105, 0.021],
    "retained_identical": [True, True, True],
}


def test_same_verdict_as_study1_when_retained_data_are_identical():
    r = evaluate_t1_study2(GOOD, SPEC)
    assert r.verdict == evaluate_t1(GOOD, SPEC).verdict == "supported"
    assert r.details["checks"]["retained_identical"] is True
    assert r.agrees_with_paper is True


def test_changed_retained_data_refute_t1():
    r = evaluate_t1_study2({**GOOD, "retained_identical": [True, False, True]}, SPEC)
    assert evaluate_t1({**GOOD, "retained_identical": [True, False, True]}, SPEC).verdict == "supported"
    assert r.verdict == "refuted" and r.agrees_with_paper is False
    assert r.details["checks"]["retained_identical"] is False


def test_missing_flag_is_inconclusive():
    data = {k: v for k, v in GOOD.items() if k != "retained_identical"}
    r = evaluate_t1_study2(data, SPEC)
    assert r.verdict == "inconclusive" and r.details["checks"]["retained_identical"] is None
