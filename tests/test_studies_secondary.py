"""kvcert.studies.secondary: S1-S5 on hand-built examples and cell tables; statuses follow PLAN.md section 5."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kvcert.analysis import claim_metrics, coverage
from kvcert.studies import cells as C
from kvcert.studies import secondary as S
from kvcert.studies import secondary_common as common

RUN = "run-a"
DESIGN = {"tail_fraction": 0.75, "floor": 0.2, "score_power": 1.0}
C1_ROWS = {**DESIGN, "design": "randomized", "scorer": "window_question", "budget": [0.25, 0.5]}
RAND = "window_question/randomized/b{b}/t0.75/f0.2/p1/s0"
BOOT = {"n_boot": 300, "bootstrap_seed": 5, "alpha": 0.05}
SPEC = {**BOOT, "rows": C1_ROWS}
STUDY2 = Path(__file__).resolve().parents[1] / "preregistration" / "study2" / "predictions.yaml"
TOKENS = {1000: 1038, 2000: 2071, 4000: 4102}


def _row(eid, task, length, variant, design, budget, *, correct, full_correct, cert, lp):
    has_cert = design == "randomized"
    return {
        "run": RUN,
        "example_id": eid,
        "task": task,
        "context_tokens": TOKENS[length],
        "variant": variant,
        "scorer": "none" if design == "full" else "window_question",
        "design": design,
        "budget": budget,
        "tail_fraction": 0.75 if has_cert else 0.0,
        "floor": 0.2,
        "score_power": 1.0,
        "seed": 0,
        "correct": bool(correct),
        "full_correct": bool(full_correct),
        "n_answer_tokens": 3,
        "logprob_mean": float(lp),
        "has_certificate": has_cert,
        "cert_score": float(cert) if has_cert else np.nan,
        "nonfinite": False,
    }


def make_examples(n_per=24, tasks=("a", "b"), lengths=(1000, 2000, 4000), seed=0, flip_task=None):
    """Per example: full, topk 0.25 / 0.5, randomized 0.25 / 0.5 / 0.75. The certificate score rises with failure
    (and with cache-induced failure) in every task but flip_task, where it falls."""
    rng = np.random.default_rng(seed)
    rows = []
    for task in tasks:
        sign = -1.0 if task == flip_task else 1.0
        for length in lengths:
            for i in range(n_per):
                eid = f"{task}-{length // 1000}k-s0-{i:04d}"
                full_ok = rng.random() < 0.7
                rows.append(
                    _row(eid, task, length, "full", "full", 1.0, correct=full_ok, full_correct=full_ok, cert=0, lp=-0.3)
                )
                for b in (0.25, 0.5):
                    ok = full_ok and rng.random() < 0.6
                    rows.append(
                        _row(eid, task, length, f"window_question/topk/b{b}", "topk", b, correct=ok,
                             full_correct=full_ok, cert=0, lp=-0.5)
                    )  # fmt: skip
                for b in (0.25, 0.5, 0.75):
                    ok = full_ok and rng.random() < 0.5
                    cert = sign * ((not ok) + 0.5 * ((not ok) and full_ok)) + rng.normal(0, 0.3)
                    rows.append(
                        _row(eid, task, length, RAND.format(b=b), "randomized", b, correct=ok, full_correct=full_ok,
                             cert=cert, lp=-rng.gamma(2, 0.3))
                    )  # fmt: skip
    return pd.DataFrame(rows)


def make_cells(examples, counts):
    """One cell group per C1 row; counts(example_index, length, row) -> dict of count columns (n_cells default 100)."""
    c1 = examples[(examples["design"] == "randomized") & examples["budget"].isin([0.25, 0.5])].reset_index(drop=True)
    rows = []
    for i, r in c1.iterrows():
        length = common.nominal_length([r["context_tokens"]])[0]
        base = {
            "run": r["run"],
            "example_id": r["example_id"],
            "variant": r["variant"],
            "layer": i % 3,
            "tail_bin": 2,
            "pmax_bin": 1,
            "ratio_bin": 6,
            "trusted": True,
            "n_cells": 100,
            "tight_defined": 100,
            "tight95": 95,
            "conformal_tight": 100,
            "conformal_gauss": 100,
            "floor95": 100,
        }
        rows.append(base | counts(i, length, r))
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def examples():
    return make_examples()


def test_nominal_length():
    assert common.nominal_length([1038, 2091, 1500, 3900, 4102]).tolist() == [1000, 2000, 1000, 4000, 4000]


def test_band_status():
    assert common.band_status({"lo": 0.94, "hi": 0.96}, (0.93, 0.97)) == "met"
    assert common.band_status({"lo": 0.971, "hi": 0.99}, (0.93, 0.97)) == "failed"
    assert common.band_status({"lo": 0.90, "hi": 0.929}, (0.93, 0.97)) == "failed"
    assert common.band_status({"lo": 0.92, "hi": 0.95}, (0.93, 0.97)) == "undecided"
    assert common.band_status({"lo": 0.92, "hi": 0.98}, (0.93, 0.97)) == "undecided"
    assert common.band_status({"lo": float("nan"), "hi": 0.95}, (0.93, 0.97)) == "undecided"


def test_s1_statuses(examples):
    inside = S.s1(examples, make_cells(examples, lambda i, n, r: {}), SPEC)
    assert inside["estimate"] == pytest.approx(0.95) and inside["status"] == "met"
    above = S.s1(examples, make_cells(examples, lambda i, n, r: {"tight95": 100}), SPEC)
    assert above["estimate"] == 1.0 and above["lo"] == 1.0 and above["status"] == "failed"
    # half the examples at 0.90, half at 0.96: the CI straddles 0.93
    mixed = S.s1(
        examples, make_cells(examples, lambda i, n, r: {"tight95": 90 if int(r["example_id"][-4:]) % 2 else 96}), SPEC
    )
    assert mixed["lo"] < 0.93 < mixed["hi"] and mixed["status"] == "undecided"
    # untrusted cells at 0.5 move neither the trusted coverage nor its status; they show in the other outcomes
    half = make_cells(examples, lambda i, n, r: {"trusted": i % 2 == 0, "tight95": 95 if i % 2 == 0 else 50})
    res = S.s1(examples, half, SPEC)
    assert res["estimate"] == pytest.approx(0.95) and res["status"] == "met"
    assert res["metrics"]["trusted_share"]["estimate"] == pytest.approx(0.5)
    assert res["metrics"]["coverage_tight_untrusted"]["estimate"] == pytest.approx(0.5)
    assert res["metrics"]["coverage_tight_all"]["estimate"] == pytest.approx(0.725)
    assert [r["length"] for r in res["by_length"]] == [1000, 2000, 4000]


def test_s2_statuses(examples):
    ok = S.s2(examples, make_cells(examples, lambda i, n, r: {"conformal_tight": 96}), SPEC)
    assert ok["status"] == "met" and [c["status"] for c in ok["conditions"]] == ["met", "met"]
    bad4k = S.s2(examples, make_cells(examples, lambda i, n, r: {"conformal_tight": 96 if n < 4000 else 80}), SPEC)
    assert bad4k["status"] == "failed" and [c["status"] for c in bad4k["conditions"]] == ["met", "failed"]
    # the Gaussian kind is reported beside the decided one, and can be made the decided one
    gauss = make_cells(examples, lambda i, n, r: {"conformal_tight": 96, "conformal_gauss": 50})
    res = S.s2(examples, gauss, SPEC)
    assert res["status"] == "met" and res["by_kind"]["gaussian"]["all_lengths"]["estimate"] == pytest.approx(0.5)
    assert S.s2(examples, gauss, SPEC, primary="gaussian")["status"] == "failed"
    # by layer, worst layer; no 4k examples -> that condition is undecided
    worst = S.s2(examples, make_cells(examples, lambda i, n, r: {"conformal_tight": 90 if i % 3 == 1 else 99}), SPEC)
    assert worst["worst_layer"]["layer"] == 1 and len(worst["by_layer"]) == 3
    short = examples[examples["context_tokens"] < 3000]
    res = S.s2(short, make_cells(short, lambda i, n, r: {"conformal_tight": 99}), SPEC)
    assert [c["status"] for c in res["conditions"]] == ["met", "undecided"] and res["status"] == "undecided"


def test_s2_refuses_a_table_without_multipliers(examples):
    cells = make_cells(examples, lambda i, n, r: {})
    cells.attrs["multipliers"] = False
    with pytest.raises(ValueError, match="multipliers"):
        S.s2(examples, cells, SPEC)


def test_s4_statuses(examples):
    same = make_cells(examples, lambda i, n, r: {"floor95": 100, "ratio_bin": 0})
    assert S.s4(examples, same, SPEC)["status"] == "met"
    # every cell's ratio beyond z95 (bin 7) but the floor covers 1 in 100: difference 0.01 -> failed
    off = make_cells(examples, lambda i, n, r: {"floor95": 1, "ratio_bin": 7})
    res = S.s4(examples, off, SPEC)
    assert res["estimate"] == pytest.approx(0.01) and res["status"] == "failed"
    assert res["coverage_c1"]["estimate"] == 0.0
    # two of 288 cell groups uncovered at 0.95, half of them covered with the floor: difference 1000 / 288000
    near = make_cells(
        examples,
        lambda i, n, r: {"n_cells": 1000, "floor95": 1000 if i % 200 else 500, "ratio_bin": 5 if i % 200 else 7},
    )
    res = S.s4(examples, near, SPEC)
    assert 0 < res["estimate"] < 0.005 and res["status"] == "met"


def test_s1_s2_s4_from_steps_match_the_locked_code():
    """Built through coverage_cells from step rows: C1 in S4 equals coverage.pooled_coverage, interval included."""
    rng = np.random.default_rng(3)
    ex = make_examples(n_per=5, tasks=("a",), lengths=(1000, 4000))
    c1 = ex[(ex["design"] == "randomized") & ex["budget"].isin([0.25, 0.5])]
    frames = []
    for _, r in c1.iterrows():
        n = 24
        var = rng.gamma(2.0, 0.01, n)
        frames.append(
            pd.DataFrame(
                {
                    "run": RUN,
                    "example_id": r["example_id"],
                    "variant": r["variant"],
                    "layer": np.tile(np.arange(3), 8).astype(np.int16),
                    "error": np.abs(rng.normal(0, 1.1, n)) * np.sqrt(var),
                    "variance": var,
                    "tail_mass": rng.uniform(0, 1, n),
                    "p_max": rng.uniform(0, 1, n),
                    "radius95_tight": np.sqrt(var) * rng.uniform(1.5, 2.2, n),
                    "certificate_trusted": rng.random(n) < 0.5,
                }
            )
        )
    steps = pd.concat(frames, ignore_index=True)
    mult = C.fit_layer_multipliers(ex, steps, C1_ROWS)
    cells, _ = C.coverage_cells(ex, steps, rows=C1_ROWS, multipliers=mult, numerical_floor=1e-3)
    res = S.s4(ex, cells, SPEC)
    ref = coverage.pooled_coverage(coverage.steps_for(c1, steps), 0.95, n_boot=300, seed=5, alpha=0.05)
    assert (res["coverage_c1"]["estimate"], res["coverage_c1"]["lo"], res["coverage_c1"]["hi"]) == (
        ref["coverage"],
        ref["lo"],
        ref["hi"],
    )
    trusted = steps["certificate_trusted"].to_numpy()
    s1 = S.s1(ex, cells, SPEC)
    direct = (steps["error"] <= steps["radius95_tight"]).to_numpy()
    assert s1["estimate"] == pytest.approx(direct[trusted].mean())
    s2 = S.s2(ex, cells, SPEC)
    assert s2["by_kind"]["tight"]["all_lengths"]["estimate"] >= 0.95  # in sample


def test_s3_matches_claim_code_and_checks_signs(examples):
    c4 = {**BOOT, "rows": {**DESIGN, "design": "randomized", "scorer": "window_question", "budget": 0.75}}
    c6 = {**BOOT, "rows": {**DESIGN, "design": "randomized", "scorer": "window_question", "budget": 0.25}}
    res = S.s3(examples, c4, c6)
    assert [r["task"] for r in res["by_task"]] == ["a", "b"]
    metrics, details, _ = claim_metrics._auroc_failure(examples[examples["task"] == "a"], None, c4)
    assert res["by_task"][0]["C4"]["auc_diff"] == metrics["auc_diff"]
    assert res["by_task"][0]["C4"]["n_pos"] == details["n_pos"]
    assert res["check"] == "consistent" and res["check_tasks"] == ["a", "b"]
    flipped = S.s3(make_examples(flip_task="b"), c4, c6)
    assert flipped["check"] == "not consistent"
    assert S.s3(examples, c4, c6, min_class_rows=10_000)["check"] == "no task qualifies"


def test_s5_by_length(examples):
    c3 = {**BOOT, "rows": {"scorer": "window_question", "design": "topk", "budget": [0.25, 0.5]}}
    c6 = {**BOOT, "rows": {**DESIGN, "design": "randomized", "scorer": "window_question", "budget": 0.25}}
    cells = make_cells(examples, lambda i, n, r: {"ratio_bin": 6 if n == 1000 else 7})
    res = S.s5(examples, cells, SPEC, c3, c6)
    assert [r["length"] for r in res["by_length"]] == [1000, 2000, 4000]
    assert [r["C1_coverage"]["estimate"] for r in res["by_length"]] == [1.0, 0.0, 0.0]
    sub = examples[examples["context_tokens"] == TOKENS[2000]]
    drop = claim_metrics._drop_vs_full(sub, None, c3)[0]["drop"]["estimate"]
    assert res["by_length"][1]["C3_drop"]["estimate"] == drop


def test_evaluate_secondary_with_study2_predictions(examples):
    doc = yaml.safe_load(STUDY2.read_text())
    for spec in [*doc["claims"].values(), *doc["secondary"].values()]:
        if isinstance(spec, dict) and "n_boot" in spec:
            spec["n_boot"] = 200
    cells = make_cells(examples, lambda i, n, r: {"conformal_tight": 97})
    cells.attrs["levels"] = list(coverage.DEFAULT_LEVELS)
    out = S.evaluate_secondary(examples, cells, doc)
    assert set(out) == {"S1", "S2", "S3", "S4", "S5"}
    assert out["S1"]["status"] == "met" and out["S2"]["status"] == "met" and out["S4"]["status"] == "met"
    assert out["S1"]["conditions"][0]["band"] == [0.93, 0.97]
    assert out["S2"]["seen_lengths"] == [1000, 2000] and out["S2"]["new_lengths"] == [4000]
    assert out["S3"]["status"] is None and out["S5"]["status"] is None
