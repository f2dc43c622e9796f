"""Study 4's exploratory addendum: each quantity against a hand computation on small synthetic frames, and one run
over the published records (when they are present) into tmp_path."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvcert.exploratory import study4_addendum as add


def _frame(cells: list[str], full: list[int], comp: list[int], **cols: list) -> pd.DataFrame:
    n = len(cells)
    base = dict(
        example_id=[f"e{i:03d}" for i in range(n)],
        cell=cells,
        full_correct=np.array(full, bool),
        correct=np.array(comp, bool),
        kv_bytes=np.full(n, 10.0),
        full_kv_bytes=np.full(n, 30.0),
    )
    return pd.DataFrame(base | cols)


def test_confidence_without_first_token() -> None:
    assert add.confidence_without_first([-0.5, -0.1, -0.3]) == pytest.approx(0.3)
    assert add.confidence_without_first([-2.0, -0.1]) == pytest.approx(0.1)  # the first token's -2.0 is ignored
    assert add.confidence_without_first([-0.2]) == 0.0
    assert np.isnan(add.confidence_without_first([]))
    assert add.first_is_lowest([-2.0, -0.1]) and not add.first_is_lowest([-0.1, -2.0]) and not add.first_is_lowest([])


def test_prepare_scores_and_cache_failure() -> None:
    answers = pd.DataFrame(
        dict(
            example_id=["a", "b"],
            task=["t", "u"],
            context_tokens=[1024, 2048],
            full_correct=[True, False],
            correct=[False, False],
            certificate=[0.4, 0.1],
            logprob=[-2.0, -0.3],
            token_logprobs=[[-2.0, -0.5], [-0.1, -0.3]],
        )
    )
    out = add.prepare(answers)
    assert out["cell"].tolist() == ["t@1024", "u@2048"]
    assert out["cache_failure"].tolist() == [True, False]
    assert out["score_confidence"].tolist() == [2.0, 0.3]
    assert out["score_confidence_nofirst"].tolist() == [0.5, 0.3]
    assert out["first_is_lowest"].tolist() == [True, False]
    assert out["split"].tolist() == ["calibration" if add.in_calibration_split(i) else "confirmatory" for i in "ab"]


def test_threshold_and_random_escalation() -> None:
    cal = pd.DataFrame(dict(score_certificate=np.arange(1.0, 11.0)))
    conf = pd.DataFrame(dict(score_certificate=[9.0, 8.0, np.nan, 10.0]))
    # the 0.8-quantile of 1..10 is 8.2: 9 and 10 escalate, 8 does not, NaN never does
    assert add.threshold_escalation(conf, cal, "certificate", 0.2).tolist() == [1.0, 0.0, 0.0, 1.0]
    esc = add.random_escalation(10, 0.2)
    assert esc.sum() == 2 and np.array_equal(esc, add.random_escalation(10, 0.2))


def test_cell_rule_fills_whole_cells_then_part_of_one() -> None:
    # calibration gains per example: A 1.0, B 0.5, C 0.0
    cal = _frame(["A", "A", "B", "B", "C"], [1, 1, 1, 0, 1], [0, 0, 0, 0, 1])
    assert add.cell_gains(cal).to_dict() == {"A": 1.0, "B": 0.5, "C": 0.0}
    conf = _frame(["C"] * 4 + ["B"] * 4 + ["A"] * 2 + ["D"], [1] * 11, [0] * 11)
    esc = add.cell_rule_escalation(conf, cal, 4)
    # A's 2 whole, then 2 of B's 4 (probability 0.5 each), nothing in C or D (D is absent from calibration: last)
    assert esc.tolist() == [0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 1, 1, 0]
    assert esc.sum() == 4
    assert add.cell_rule_escalation(conf, cal, 11).tolist() == [1.0] * 11


def test_outcome_and_escalation_kinds() -> None:
    conf = _frame(["A"] * 4, [1, 0, 1, 0], [0, 0, 1, 1])
    esc = np.array([1.0, 1.0, 0.5, 1.0])
    out = add.outcome(conf, esc)
    # escalated: full's answer; half-escalated both-right stays right; the loss (comp right, full wrong) turns wrong
    assert out["correct"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["kv_bytes"].tolist() == [30.0, 30.0, 20.0, 30.0]
    kinds = add.escalation_kinds(conf, esc)
    assert kinds == dict(cache_induced=1.0, full_also_wrong=1.0, both_right=0.5, lost=1.0)


def test_weighted_auroc_within_cells_and_pooled() -> None:
    labels = np.array([True, True, False, True, False, False])
    scores = np.array([0.9, 0.2, 0.5, 0.3, 0.3, 0.1])
    cells = np.array(["X", "X", "X", "Y", "Y", "Y"])
    ones = np.ones(6)
    # X: 0.9 > 0.5 (1), 0.2 < 0.5 (0); Y: 0.3 = 0.3 (0.5), 0.3 > 0.1 (1): 2.5 of 4 pairs
    assert add.weighted_auroc(labels, scores, cells)(ones) == pytest.approx(2.5 / 4)
    # pooled: 0.9 beats 3, 0.2 beats 1, 0.3 beats 1 and ties 1: 5.5 of 9
    assert add.weighted_auroc(labels, scores, np.zeros(6))(ones) == pytest.approx(5.5 / 9)
    # a resample count weighs an example as if repeated: drawing the first example twice
    w = np.array([2.0, 1, 1, 1, 1, 1])
    rep = np.repeat(np.arange(6), w.astype(int))
    expected = add.weighted_auroc(labels[rep], scores[rep], cells[rep])(np.ones(len(rep)))
    assert add.weighted_auroc(labels, scores, cells)(w) == pytest.approx(expected)
    assert expected == pytest.approx(3.5 / 5)


def _answers(n: int = 60, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        task, length = ("a", "b")[i % 2], (1024, 2048)[(i // 2) % 2]
        full = bool(rng.random() < 0.7)
        first = float(-rng.random())
        for budget in (0.5, 0.25):
            logprobs = [first, *(-rng.random(int(rng.integers(0, 3)))).tolist()]
            rows.append(
                dict(
                    example_id=f"{task}-{length}-s0-{i:04d}", task=task, context_tokens=length, budget=budget,
                    full_correct=full, correct=full and bool(rng.random() < budget + 0.2),
                    certificate=float(rng.random()), logprob=min(logprobs), token_logprobs=logprobs,
                    kv_bytes=budget * 100.0, full_kv_bytes=100.0,
                )
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_analyse_budget_against_hand_computation() -> None:
    frame = add.prepare(_answers())
    res = add.analyse_budget(frame, 0.5, n_boot=50)
    at = frame[(frame["budget"] == 0.5) & (frame["split"] == "confirmatory")].sort_values("example_id")
    full, comp = at["full_correct"].to_numpy(float), at["correct"].to_numpy(float)
    pol = {p["policy"]: p for p in res["policies"]}
    assert res["n"] == len(at)
    assert pol["none"]["accuracy"] == pytest.approx(100 * comp.mean())
    assert pol["none"]["mean_kv_mib"] == pytest.approx(50.0 / 2**20)
    oracle_correct = np.maximum(comp, full * (1 - comp))  # the cache-induced failures turn right
    assert pol["oracle"]["accuracy"] == pytest.approx(100 * oracle_correct.mean())
    assert pol["oracle"]["realized_rate"] == pytest.approx(at["cache_failure"].mean())
    assert pol["oracle"]["share_of_oracle_gain"] == pytest.approx(1.0)
    assert pol["cell_rule"]["escalated"] == pytest.approx(pol["certificate"]["escalated"])
    cal = frame[(frame["budget"] == 0.5) & (frame["split"] == "calibration")]
    threshold = np.quantile(cal["certificate"], 0.8)
    esc = (at["certificate"] > threshold).to_numpy()
    cert_correct = np.where(esc, full, comp)
    assert pol["certificate"]["accuracy"] == pytest.approx(100 * cert_correct.mean())
    assert pol["certificate"]["share_of_oracle_gain"] == pytest.approx(
        (cert_correct.mean() - comp.mean()) / (oracle_correct.mean() - comp.mean())
    )
    diff = {(d["a"], d["b"]): d for d in res["differences"]}
    conf_esc = (-at["logprob"] > np.quantile(-cal["logprob"], 0.8)).to_numpy()
    expected = 100 * (cert_correct - np.where(conf_esc, full, comp)).mean()
    d = diff["certificate", "confidence"]
    assert d["estimate"] == pytest.approx(expected)
    assert d["lo"] <= d["estimate"] <= d["hi"]
    auroc = {(r["scope"], r["auroc"]): r for r in res["auroc"]}
    right = at[at["full_correct"]]
    expected_auc = add.weighted_auroc(
        right["cache_failure"].to_numpy(bool), right["certificate"].to_numpy(float), right["cell"].to_numpy()
    )(np.ones(len(right)))
    assert auroc["within cells", "certificate"]["estimate"] == pytest.approx(expected_auc)
    assert auroc["within cells", "certificate - confidence"]["estimate"] == pytest.approx(
        expected_auc - auroc["within cells", "confidence"]["estimate"]
    )


def test_run_writes_report_and_json(tmp_path) -> None:
    for key, seed in (("smollm2", 1), ("gemma3", 2)):
        (tmp_path / "in" / key).mkdir(parents=True)
        _answers(seed=seed).to_json(tmp_path / "in" / key / "answers.jsonl", orient="records", lines=True)
    add.main(["--results", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--n-boot", "20"])
    text = (tmp_path / "out" / "exploratory_addendum.md").read_text()
    assert text.splitlines()[0].startswith("**EXPLORATORY")
    assert "nothing locked changed" in text.splitlines()[0]
    payload = json.loads((tmp_path / "out" / "exploratory_addendum.json").read_text())
    assert set(payload["models"]) == {"smollm2", "gemma3"}


@pytest.mark.skipif(
    not all((add.RESULTS / m / "answers.jsonl").exists() for m in add.MODELS), reason="published records absent"
)
def test_runs_on_published_records(tmp_path) -> None:
    results = add.run(add.RESULTS, tmp_path, n_boot=100)
    assert (tmp_path / "exploratory_addendum.md").read_text().startswith("**EXPLORATORY")
    for key, res in results.items():
        claims = add.RESULTS / key / "claims.json"
        p1 = {(d["a"], d["b"]): d for d in res["budgets"][0]["differences"]}["certificate", "confidence"]
        if claims.exists():  # point estimates do not depend on the resamples
            assert p1["estimate"] == pytest.approx(json.loads(claims.read_text())["claims"]["P1"]["estimate"])
        pol = {p["policy"]: p for p in res["budgets"][0]["policies"]}
        assert pol["cell_rule"]["escalated"] == pytest.approx(pol["certificate"]["escalated"])
