"""Model dependence between two models' claim estimates (kvcert.studies.model_dependence)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis.bootstrap import percentile_ci
from kvcert.analysis.claims import evaluate_claim, load_predictions
from kvcert.studies import model_dependence as md
from synthetic import NB, ROOT, filled_spec, synthetic_examples, synthetic_steps

CLAIMS = md.CLAIMS


def _records(examples: pd.DataFrame, steps: pd.DataFrame) -> dict:
    return {cid: (examples, steps if cid == "C1" else None) for cid in CLAIMS}


def _verdicts(records: dict, specs: dict) -> dict:
    return {cid: evaluate_claim(cid, *records[cid], specs[cid]) for cid in CLAIMS}


@pytest.fixture(scope="module")
def specs():
    return {cid: filled_spec(cid) for cid in CLAIMS}


@pytest.fixture(scope="module")
def good():
    ex = synthetic_examples(n=200, cert_signal=3.0, conf_signal=0.0)
    return ex, synthetic_steps(ex, inflate=0.8, cells=12)


@pytest.fixture(scope="module")
def bad():
    ex = synthetic_examples(n=200, seed=1, cert_signal=-3.0, conf_signal=3.0, rand_penalty=0.3)
    return ex, synthetic_steps(ex, inflate=1.5, cells=12, seed=1)


@pytest.fixture(scope="module")
def good_results(good, specs):
    return _verdicts(_records(*good), specs)


def test_estimates_and_resamples_are_the_locked_claims(good, specs, good_results):
    """Point estimates equal evaluate_claim's exactly; with the claim's seed and n_boot, the resamples are the
    claim's own (their percentile interval is its CI)."""
    records = _records(*good)
    for cid in CLAIMS:
        spec, res = specs[cid], good_results[cid]
        rs = md.resample_claim(cid, *records[cid], spec, n_boot=NB, seed=int(spec["bootstrap_seed"]))
        assert rs.estimates[spec["primary_metric"]] == res.observed, cid
        for metric in md.METRICS[spec["analysis"]]:
            assert rs.estimates[metric] == res.metrics[metric]["estimate"], (cid, metric)
            lo, hi = percentile_ci(rs.samples[metric])
            assert (lo, hi) == pytest.approx((res.metrics[metric]["lo"], res.metrics[metric]["hi"]), rel=1e-9), cid
        assert rs.n_examples > 0


def test_same_records_differ_by_nothing(good, specs, good_results):
    records = _records(*good)
    df = md.model_dependence(records, records, specs, specs, good_results, good_results, n_boot=NB)
    assert list(df.columns) == md.COLUMNS
    assert list(df["claim"]) == ["C1", "C2", "C3", "C4", "C6", "C6", "C7", "C7"]
    assert list(df["metric"]) == [
        "coverage",
        "diff",
        "drop",
        "auc_diff",
        "auc_diff",
        "auc_cert",
        "diff_random",
        "diff_confidence",
    ]
    assert (df["difference"] == 0).all()
    assert (df["ci_low"] <= 0).all() and (df["ci_high"] >= 0).all()
    # the two resample streams are independent, not one stream twice (C2's unit differences are all zero here)
    varies = df["claim"] != "C2"
    assert (df.loc[varies, "ci_low"] < df.loc[varies, "ci_high"]).all()
    assert (df["reading"] == md.NOT_DISTINGUISHABLE).all()
    for r in df.itertuples():
        assert r.estimate_a == good_results[r.claim].metrics[r.metric]["estimate"]
        assert r.verdict_a == r.verdict_b == good_results[r.claim].verdict
        assert r.n_a == r.n_b > 0


def test_flipped_randomized_correctness_is_model_dependent(good, specs, good_results):
    """Model B: every randomized row wrong, so C2's randomized - deterministic difference collapses."""
    ex_b = good[0].copy()
    randomized = ex_b["design"] == "randomized"
    ex_b.loc[randomized, "correct"] = False
    rec_a, rec_b = _records(*good), _records(ex_b, good[1])
    verdict_b = evaluate_claim("C2", *rec_b["C2"], specs["C2"])
    df = md.model_dependence(rec_a, rec_b, specs, specs, good_results, {"C2": verdict_b}, n_boot=NB, claim_ids=["C2"])
    (row,) = df.to_dict(orient="records")
    assert row["estimate_b"] == verdict_b.observed < row["estimate_a"]
    assert row["difference"] > 0 and row["ci_low"] > 0
    assert row["verdict_a"] == "supported" and row["verdict_b"] == "refuted"
    assert row["reading"] == md.MODEL_DEPENDENT


def test_opposite_effects_exclude_zero_with_the_right_sign(good, bad, specs, good_results):
    rec_a, rec_b = _records(*good), _records(*bad)
    df = md.model_dependence(rec_a, rec_b, specs, specs, good_results, _verdicts(rec_b, specs), n_boot=NB)
    primary = df.drop_duplicates("claim").set_index("claim")
    # A covers more (errors x0.8 vs x1.5), loses no accuracy to randomizing, and its certificate carries the signal
    for cid in ("C1", "C2", "C4", "C6", "C7"):
        r = primary.loc[cid]
        assert r["difference"] > 0 and r["ci_low"] > 0, cid
        assert r["ci_low"] <= r["difference"] <= r["ci_high"], cid
        assert r["reading"] == (md.MODEL_DEPENDENT if r["verdict_a"] != r["verdict_b"] else md.SAME_VERDICT), cid


def test_reading_rule():
    assert md.reading(0.1, 0.5, "supported", "refuted") == md.MODEL_DEPENDENT
    assert md.reading(-0.5, -0.1, "supported", "inconclusive") == md.MODEL_DEPENDENT
    assert md.reading(0.1, 0.5, "supported", "supported") == md.SAME_VERDICT
    assert md.reading(-0.5, -0.1, "refuted", "refuted") == md.SAME_VERDICT
    assert md.reading(-0.1, 0.2, "supported", "refuted") == md.NOT_DISTINGUISHABLE
    assert md.reading(0.0, 0.2, "supported", "refuted") == md.NOT_DISTINGUISHABLE  # closed: zero is included
    assert md.reading(-0.3, 0.0, "supported", "supported") == md.NOT_DISTINGUISHABLE
    assert md.reading(math.nan, math.nan, "supported", "refuted") == md.NOT_DISTINGUISHABLE
    assert set(md.READINGS) == {md.MODEL_DEPENDENT, md.SAME_VERDICT, md.NOT_DISTINGUISHABLE}


def test_difference_interval_needs_half_the_resamples():
    a = np.arange(10.0)
    assert md.difference_interval(a, np.zeros(10)) == pytest.approx(percentile_ci(a))
    mostly_nan = np.full(10, np.nan)
    mostly_nan[:4] = 1.0
    assert all(math.isnan(x) for x in md.difference_interval(mostly_nan, np.zeros(10)))


def test_undefined_auroc_is_nan_and_not_distinguishable(good, specs, good_results):
    ex_b = good[0].copy()
    ex_b["correct"] = True  # no failures: C4's AUROC has no positives
    rec_a, rec_b = _records(*good), _records(ex_b, good[1])
    df = md.model_dependence(
        rec_a, rec_b, specs, specs, good_results, {"C4": "inconclusive"}, n_boot=NB, claim_ids=["C4"]
    )
    (row,) = df.to_dict(orient="records")
    assert math.isnan(row["estimate_b"]) and math.isnan(row["ci_low"]) and math.isnan(row["ci_high"])
    assert row["reading"] == md.NOT_DISTINGUISHABLE


def test_write_csv_and_markdown(tmp_path):
    df = pd.DataFrame(
        [["C2", "diff", 1.0, -2.0, 3.0, 1.5, 4.5, "supported", "refuted", md.MODEL_DEPENDENT, 10, 12]],
        columns=md.COLUMNS,
    )
    df.attrs |= {"n_boot": 2000, "seed": 20260101, "alpha": 0.05}
    paths = md.write_model_dependence(df, tmp_path / "out", names=("SmolLM2", "Gemma"))
    back = pd.read_csv(paths["csv"])
    assert list(back.columns) == md.COLUMNS and back.loc[0, "difference"] == 3.0
    text = paths["md"].read_text()
    assert "SmolLM2 - Gemma" in text and "[1.5000, 4.5000]" in text and md.MODEL_DEPENDENT in text


def test_study2_published_examples_reproduce_the_claim_tables():
    """Study 2's published examples as both models: the estimates are the published claim tables' `observed`
    (C2-C7 read the examples only; C1 needs the 2.6 M rebuilt step rows, too slow here, and is checked on synthetic
    records above)."""
    published = ROOT / "results" / "study2" / "published" / "examples.parquet"
    tables = ROOT / "results" / "study2" / "tables"
    if not published.exists() or not tables.exists():
        pytest.skip("study 2's published records are not here")
    examples = pd.read_parquet(published)
    preds = load_predictions(ROOT / "preregistration" / "study2" / "predictions.yaml")
    ids = [c for c in CLAIMS if c != "C1"]
    claim_json = {cid: json.loads((tables / f"claim_{cid.lower()}.json").read_text()) for cid in ids}
    verdicts = {cid: d["verdict"] for cid, d in claim_json.items()}
    records = {cid: (examples, None) for cid in ids}
    df = md.model_dependence(records, records, preds, preds, verdicts, verdicts, n_boot=20, claim_ids=ids)
    for r in df.itertuples():
        published_metric = claim_json[r.claim]["metrics"][r.metric]["estimate"]
        assert r.estimate_a == pytest.approx(published_metric, rel=1e-9, abs=1e-12), (r.claim, r.metric)
        assert r.difference == 0
    primaries = df.drop_duplicates("claim").set_index("claim")["estimate_a"]
    for cid in ids:
        assert primaries[cid] == pytest.approx(claim_json[cid]["observed"], rel=1e-9, abs=1e-12), cid
