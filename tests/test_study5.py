"""Study 5's pilot rule and analysis on synthetic records whose answers are known by construction."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvcert.studies.study5 import analysis, pilot
from kvcert.studies.study5.signals import agreement_score, cell_rule, ecdf, outcome, within_cell_escalated

TASKS = ("alpha", "beta", "gamma")
LENGTHS = (1024, 2048)


def records(n_per_cell: int = 40, seed: int = 0, good: str = "r3", noise: float = 1.0) -> pd.DataFrame:
    """One row per (example, budget): the full cache right on 70%, draw 0 breaks 40% of those (a cache-induced
    failure). `good`'s disagreement separates failures (shift 3 / noise); the other variants' and confidence are
    weaker; the certificate is noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for task in TASKS:
        for length in LENGTHS:
            for i in range(n_per_cell):
                full = rng.random() < 0.7
                for budget in (0.5, 0.25):
                    broken = full and rng.random() < 0.4
                    correct = full and not broken
                    row = dict(example_id=f"{task}-{length}-{i:03d}", task=task, context_tokens=length, budget=budget,
                               full_correct=full, correct=correct, full_kv_bytes=100.0, kv_one=30.0, kv_split=31.0,
                               certificate=rng.random(), confidence=0.6 * broken + rng.normal(0, noise),
                               draw_answers=["a", "b", "a", "c"],
                               draw_correct=[correct, False, correct, False])  # fmt: skip
                    for v in ("split", "r2", "r3", "r4"):
                        shift = 3.0 if v == good else 0.3
                        row[f"disagreement_{v}"] = shift * broken + rng.normal(0, noise)
                        row[f"differs_{v}"] = float(broken)
                    for r in (2, 3, 4):
                        row[f"kv_r{r}"] = 30.0 + 10 * (r - 1)
                    rows.append(row)
    return pd.DataFrame(rows)


def test_within_cell_escalation_takes_the_top_fifth_of_each_cell():
    frame = records()[lambda f: f["budget"] == 0.5].reset_index(drop=True)
    scores = frame["disagreement_r3"].to_numpy()
    esc = within_cell_escalated(frame, scores, 0.2)
    for _, group in frame.groupby(["task", "context_tokens"]):
        idx = group.index.to_numpy()
        assert esc[idx].sum() == round(0.2 * len(idx))
        assert scores[idx][esc[idx]].min() >= scores[idx][~esc[idx]].max()


def test_cell_rule_fills_cells_by_calibration_gain_with_a_fractional_last_cell():
    cal = pd.DataFrame(dict(task=["a", "a", "b", "b"], context_tokens=[1, 1, 1, 1], full_correct=[1, 1, 1, 0],
                            correct=[0, 0, 1, 0]))  # fmt: skip  # gain: a 1.0, b 0.0
    frame = pd.DataFrame(dict(task=["a"] * 4 + ["b"] * 4, context_tokens=[1] * 8))
    esc = cell_rule(cal, frame, 6.0)
    assert esc.tolist() == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5] and esc.sum() == 6.0


def test_outcome_counts_the_full_cache_where_escalated():
    frame = pd.DataFrame(dict(full_correct=[1, 0], correct=[0, 1], full_kv_bytes=[100, 100], kv_r2=[40, 50]))
    out = outcome(frame, np.array([1.0, 0.0]), "kv_r2")
    assert out["correct"].tolist() == [1, 1] and out["kv"].tolist() == [100, 50]


def test_combined_form_is_the_mean_of_reference_cdf_values():
    frame = pd.DataFrame(dict(disagreement_r2=[0.0, 1.0, 2.0, 3.0], confidence=[3.0, 2.0, 1.0, 0.0]))
    assert agreement_score(frame, "r2", "combined").tolist() == pytest.approx([0.625] * 4)
    assert ecdf(np.array([1.0, 2.0, np.nan]), np.array([1.5, np.nan])).tolist()[0] == 0.5
    with pytest.raises(ValueError, match="variant one of"):
        agreement_score(frame, "r9", "alone")


def test_pilot_rule_takes_the_clearly_better_variant_and_else_the_cheapest():
    frames = {"m1": records(8, 1, good="r3"), "m2": records(8, 2, good="r3")}
    choice = pilot.choose(frames)
    assert (choice["variant"], choice["draws"]) == ("independent", 3)
    assert choice["report"]["within_cell_auroc"]["r3/alone"] == choice["report"]["best"] or choice["form"] == "combined"
    # every variant equally good: the cheapest (split halves, alone) wins
    same = {k: f.assign(**{f"disagreement_{v}": f["disagreement_split"] for v in ("r2", "r3", "r4")})
            for k, f in {"m1": records(8, 1, good="split"), "m2": records(8, 2, good="split")}.items()}  # fmt: skip
    choice = pilot.choose(same)
    assert (choice["variant"], choice["draws"], choice["form"]) == ("split", 2, "alone")
    assert all(n * 6 >= pilot.N_MIN and (n - 1) * 6 < pilot.N_MAX for n in choice["n_per_cell"].values())


def test_n_per_cell_from_the_paired_sd():
    assert pilot.n_per_cell(0.28, 6) == 115  # (1.96 * 0.28 / 0.025)^2 / 0.7 = 688.4 -> 689, / 6 cells
    assert pilot.n_per_cell(0.1, 6) == 80  # 110 -> the floor 480
    assert pilot.n_per_cell(0.5, 6) == 120  # capped at 720
    assert pilot.n_per_cell(float("nan"), 8) == 90


@pytest.mark.parametrize("good, verdict", [("r2", "supported"), ("r4", "refuted")])
def test_claims_decide_as_the_records_say(good, verdict):
    """With R = 2 chosen: its disagreement separates the failures (supported), or it is as weak as confidence."""
    answers = records(60, 3, good=good, noise=0.5)
    design = dict(variant="independent", draws=2, form="alone", budgets=[0.5, 0.25])
    spec = dict(test="within_cell_gain", budget=0.5, a="agreement", b="confidence", rule="margin", margin=2.0,
                unit="points")  # fmt: skip
    res = analysis.evaluate_claim(answers, design, spec)
    assert res["verdict"] == verdict, res
    oracle = analysis.Study5(answers, design, 0.5).oracle()
    assert oracle["correct"].mean() == pytest.approx(answers.query("budget == 0.5")["full_correct"].mean(), abs=0.05)


def test_majority_of_draws_by_hand():
    frame = pd.DataFrame(dict(draw_answers=[["x", "y", "y"], ["x", "y", "z"]], draw_correct=[[1, 0, 0], [1, 0, 0]]))
    assert analysis.majority_correct(frame, 3).tolist() == [0.0, 1.0]  # y wins; a three-way tie keeps draw 0


def test_claims_and_scorecard_columns_from_complete_records(tmp_path):
    """A complete synthetic study 5 in a scratch root: analyze decides every pre-registered claim and the combined
    scorecard's columns carry them as S5.P1-S5.P5 (never as study 4's P1-P5)."""
    import shutil

    import yaml

    from kvcert.studies.study5 import cli
    from kvcert.studies.study5.common import PREREG, RESULTS

    prereg = tmp_path / PREREG
    prereg.mkdir(parents=True)
    for name in ("PLAN.md", "predictions_smollm2.yaml", "predictions_gemma3.yaml"):
        shutil.copy(PREREG / name, prereg / name)
    tasks = {t: 1 for t in TASKS}
    design = dict(seed=1, lengths=list(LENGTHS), budgets=[0.5, 0.25], variant="independent", draws=2, form="alone",
                  models={m: dict(model=m, tasks=tasks, n_per_cell=60) for m in ("smollm2", "gemma3")})  # fmt: skip
    (prereg / "design.yaml").write_text(yaml.safe_dump(design))
    for k, tag in enumerate(("smollm2", "gemma3")):
        out = tmp_path / RESULTS / tag
        out.mkdir(parents=True)
        records(60, 10 + k, good="r2", noise=0.5).to_json(out / "answers.jsonl", orient="records", lines=True)
    analysis.analyze(tmp_path, n_boot=200)
    assert cli.complete("smollm2", tmp_path)
    cards = cli.scorecard_cards(tmp_path)
    assert set(cards) == {"study5_smollm2", "study5_gemma3"}
    rows = {c["id"]: c for c in cards["study5_smollm2"]["claims"]}
    assert set(rows) == {"S5.P1", "S5.P2", "S5.P3", "S5.P4", "S5.P5"}
    assert rows["S5.P1"]["verdict"] == "supported" and rows["S5.P1"]["ci"][0] > 0
    assert "cells" in rows["S5.P1"]["claim"]
    assert (tmp_path / RESULTS / "report.md").read_text().startswith("# Study 5 report")


def test_random_control_means_the_same_on_both_splits():
    """A threshold fitted on one set of ids escalates about the same share of another (the rank-based score did not)."""
    from kvcert.studies.study5.signals import random_score, threshold

    cal = pd.DataFrame(dict(example_id=[f"a-{i}" for i in range(300)]))
    conf = pd.DataFrame(dict(example_id=[f"b-{i}" for i in range(700)]))
    cut = threshold(random_score(cal), 0.2)
    assert abs((random_score(conf) > cut).mean() - 0.2) < 0.05
    assert random_score(conf.iloc[::-1])[::-1].tolist() == random_score(conf).tolist()  # per id, not per position


# ------------------------------------------------------------------------------------------- make reproduce's check
def _study5_tree(tmp_path):
    """A copy of study 5's design, predictions and SmolLM2's published records under tmp_path."""
    import shutil

    for name in ("design.yaml", "predictions_smollm2.yaml"):
        (tmp_path / "preregistration/study5").mkdir(parents=True, exist_ok=True)
        shutil.copy(f"preregistration/study5/{name}", tmp_path / "preregistration/study5" / name)
    (tmp_path / "results/study5/smollm2/regenerated").mkdir(parents=True)
    shutil.copy("results/study5/smollm2/answers.jsonl", tmp_path / "results/study5/smollm2/answers.jsonl")
    return [json.loads(line) for line in open("results/study5/smollm2/answers.jsonl")]


def test_the_full_regeneration_check_judges_answers_signals_and_verdicts(tmp_path, monkeypatch):
    """make reproduce's study-5 step on the published records: an identical regeneration passes with a row per signal
    and per claim; a disagreement moved by 3e-3 on one row fails (tolerance 2e-3); a different answer on 6% of rows
    fails; a regeneration missing examples is refused in one line."""
    from kvcert.studies.study5 import analysis
    from kvcert.studies.study5.regeneration import full_regeneration_check

    monkeypatch.setattr(analysis, "N_BOOT", 200)
    rows = _study5_tree(tmp_path)
    regen = tmp_path / "results/study5/smollm2/regenerated/answers.jsonl"

    def write(rs):
        regen.write_text("".join(json.dumps(r) + "\n" for r in rs))

    write(rows)
    passed, text = full_regeneration_check("smollm2", tmp_path)
    table = _report_rows(text)
    assert passed and "all 480 examples regenerated: **PASS**" in text
    assert table["identical answers (draw 0, full cache, every draw)"]["value"] == f"{len(rows)} / {len(rows)}"
    for signal in ("certificate (rel", "confidence (abs", "disagreement_r3 (abs", "disagreement_split (abs"):
        assert table[f"{signal} difference, identical answers)"]["result"] == "pass"
    assert sum(k.endswith(" verdict") for k in table) == 5
    write([dict(r, disagreement_r3=r["disagreement_r3"] + 3e-3) if i == 11 else r for i, r in enumerate(rows)])
    passed, text = full_regeneration_check("smollm2", tmp_path)
    row = _report_rows(text)["disagreement_r3 (abs difference, identical answers)"]
    assert not passed and row["result"] == "FAIL" and float(row["value"]) == pytest.approx(3e-3, rel=1e-3)
    n_bad = int(0.06 * len(rows))
    write([dict(r, answer=r["answer"] + "x") if i < n_bad else r for i, r in enumerate(rows)])
    passed, text = full_regeneration_check("smollm2", tmp_path)
    assert not passed and _report_rows(text)["identical answers (draw 0, full cache, every draw)"]["result"] == "FAIL"
    write(rows[:-2])
    with pytest.raises(SystemExit, match="lacks 1 examples"):
        full_regeneration_check("smollm2", tmp_path)


def _report_rows(text: str) -> dict[str, dict[str, str]]:
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return {row[0]: dict(zip(cells[0], row)) for row in cells[1:]}
