"""The claims registry and verdicts from predictions.yaml entries (kvcert.analysis.claims)."""

from __future__ import annotations

import copy

import pytest

from kvcert.analysis.claims import (
    ClaimResult,
    claim_ids,
    condition_status,
    evaluate_claim,
    evaluate_t1,
    find_tbd,
    load_predictions,
    registry,
)
from synthetic import ROOT, filled_spec, synthetic_examples, synthetic_steps

# --- claims ----------------------------------------------------------------------------------------------------


def test_condition_rules():
    m = {"estimate": 1.0, "lo": 0.5, "hi": 1.5}
    assert condition_status(m, {"direction": ">", "threshold": 0.0}) == "met"
    assert condition_status(m, {"direction": ">", "threshold": 2.0}) == "failed"
    assert condition_status(m, {"direction": ">", "threshold": 1.2}) == "undecided"
    # non-inferiority: point below the margin refutes even when the CI reaches above it
    assert condition_status(m, {"direction": ">", "threshold": 1.2, "refute_on": "point"}) == "failed"
    assert condition_status(m, {"direction": ">=", "threshold": 0.9, "support_on": "point"}) == "met"
    assert condition_status(m, {"direction": "<=", "threshold": 1.6}) == "met"
    assert (
        condition_status(
            {"estimate": float("nan"), "lo": float("nan"), "hi": float("nan")}, {"direction": ">", "threshold": 0}
        )
        == "undecided"
    )


def test_predictions_have_every_claim_and_tbd_blocks_evaluation():
    preds = load_predictions(ROOT / "preregistration" / "predictions.yaml")
    assert set(preds) == {"C1", "C2", "C3", "C4", "C5", "C6", "C7", "T1"}
    for cid, spec in preds.items():
        assert {"claim", "prediction", "primary_metric", "paper_verdict"} <= set(spec), cid
        assert not find_tbd(spec), cid  # the locked file has every pilot value filled in
    ex = synthetic_examples(n=20)
    pending = copy.deepcopy(preds["C4"])
    pending["rows"]["budget"] = "TBD_PILOT"
    with pytest.raises(ValueError, match="TBD_PILOT"):
        evaluate_claim("C4", ex, None, pending)


@pytest.fixture(scope="module")
def good_bad():
    good = synthetic_examples(n=300, cert_signal=3.0, conf_signal=0.0)
    bad = synthetic_examples(n=300, cert_signal=-3.0, conf_signal=3.0, rand_penalty=0.3)
    return good, bad


@pytest.mark.parametrize(
    "cid,expect_good,expect_bad",
    [
        ("C2", "supported", "refuted"),
        ("C4", "supported", "refuted"),
        ("C5", "supported", "refuted"),
        ("C6", "supported", "refuted"),
        ("C7", "supported", "refuted"),
    ],
)
def test_verdicts_flip_with_the_effect(good_bad, cid, expect_good, expect_bad):
    good, bad = good_bad
    spec = filled_spec(cid)
    res_good = evaluate_claim(cid, good, None, spec)
    res_bad = evaluate_claim(cid, bad, None, spec)
    assert res_good.verdict == expect_good, res_good.conditions
    assert res_bad.verdict == expect_bad, res_bad.conditions
    assert res_good.agrees_with_paper == (expect_good == spec["paper_verdict"])
    assert res_good.ci[0] <= res_good.observed <= res_good.ci[1]


def test_nonfinite_rows_are_excluded_and_counted():
    ex = synthetic_examples(n=100)
    ex["nonfinite"] = False
    ex.loc[ex.index[5], "nonfinite"] = True
    ex.loc[ex.index[7], "logprob_mean"] = float("nan")
    res = evaluate_claim("C3", ex, None, filled_spec("C3"))
    assert res.details["excluded_rows"]["excluded"] == 2


def test_c3_drop_verdicts():
    spec = filled_spec("C3")
    costly = synthetic_examples(n=300)  # keep 0.3 / 0.6 at 25% / 50%: large drops
    free = synthetic_examples(n=300, keep={0.25: 1.0, 0.5: 1.0, 0.75: 1.0})
    assert evaluate_claim("C3", costly, None, spec).verdict == "supported"
    res = evaluate_claim("C3", free, None, spec)
    assert res.verdict == "refuted" and res.agrees_with_paper is True


def test_c1_coverage_verdicts_and_details():
    spec = filled_spec("C1")
    ex = synthetic_examples(n=80, budgets=(0.25, 0.5), keep={0.25: 0.3, 0.5: 0.6})
    tight = evaluate_claim("C1", ex, synthetic_steps(ex, inflate=0.8, cells=30), spec)
    loose = evaluate_claim("C1", ex, synthetic_steps(ex, inflate=1.5, cells=30), spec)
    assert tight.verdict == "supported" and loose.verdict == "refuted"
    d = tight.details
    assert {r["budget"] for r in d["by_budget"]} == {0.25, 0.5} and len(d["by_layer"]) == 6
    assert d["conformal"]["multiplier"] < 1.0  # errors were shrunk by 0.8: a smaller multiplier suffices
    fallback = evaluate_claim("C1", ex, None, spec)  # examples-only route (steps95/steps_total, all covered)
    assert fallback.details["source"].startswith("examples") and fallback.observed == 1.0


def test_t1_verdicts():
    spec = load_predictions(ROOT / "preregistration" / "predictions.yaml")["T1"]
    lam = [0.0, 1.0, 2.0, 4.0]
    good = {
        "lambda": lam,
        "true_error_deterministic": [0.1, 0.5, 1.0, 2.0],
        "estimate_deterministic": [0.05] * 4,
        "mse_randomized": [0.01, 0.02, 0.04, 0.09],
        "mean_vhat_randomized": [0.0098, 0.021, 0.039, 0.092],
    }
    res = evaluate_t1(good, spec)
    assert res.verdict == "supported" and res.agrees_with_paper is True
    bad = dict(good, mean_vhat_randomized=[0.0098, 0.01, 0.01, 0.01])
    assert evaluate_t1(bad, spec).verdict == "refuted"
    assert evaluate_t1(dict(good, lambda_=None, mse_randomized=[0.1]), spec).verdict == "inconclusive"


# --- registry and results --------------------------------------------------------------------------------------


def test_registry_reads_ids_from_predictions_and_finds_each_experiment():
    reg = registry()
    assert tuple(reg) == claim_ids() == tuple(load_predictions(ROOT / "preregistration" / "predictions.yaml"))
    assert tuple(reg) == ("C1", "C2", "C3", "C4", "C5", "C6", "C7", "T1")
    for cid, entry in reg.items():
        assert (ROOT / "conf" / "claim" / f"{entry.experiment}.yaml").is_file(), cid
        assert entry.experiment.startswith(cid.lower() + "_")
    assert reg["T1"].analysis == "t1" and reg["C1"].analysis == "coverage"


def test_registry_refuses_a_claim_without_experiment(tmp_path):
    (tmp_path / "c1.yaml").write_text("claim:\n  id: C1\n")
    preds = tmp_path / "predictions.yaml"
    preds.write_text("claims:\n  C1: {analysis: coverage}\n  C2: {analysis: paired_accuracy}\n")
    with pytest.raises(ValueError, match="C2"):
        registry(preds, tmp_path)


def test_claim_result_json_forms():
    missing = ClaimResult.not_evaluated("C3").as_dict()
    assert list(missing) == [
        "id",
        "claim",
        "prediction",
        "observed",
        "ci",
        "verdict",
        "paper_verdict",
        "agrees_with_paper",
        "evaluated",
        "details",
    ]
    t1 = ClaimResult(id="T1", observed=1.0, details={"x": 1}).as_dict()
    assert list(t1)[-1] == "details" and "conditions" not in t1 and t1["n_examples"] is None
    full = ClaimResult(id="C2", conditions=[], secondary=[], metrics={}).as_dict()
    assert list(full)[-4:] == ["conditions", "secondary", "metrics", "details"]
    with pytest.raises(TypeError):
        ClaimResult("C1")  # keyword-only
