"""The four defects an independent recomputation of study 5 found, each with the test that would have
caught it (the tie rule, the answer comparison, the capped oracle; the docs are checked in tests/test_docs.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvcert.core import agreement
from kvcert.studies.study5 import analysis, fragility
from kvcert.studies.study5.signals import above, above_or_drawn, answers_differ_score, threshold, tie_probability


# --------------------------------------------------------------------------------------- 1. ties at the threshold
def _three_valued(n: int, prefix: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.choice([0.0, 0.5, 1.0], size=n, p=[0.4, 0.25, 0.35]), np.array([f"{prefix}-{i}" for i in range(n)])


def test_a_score_of_three_values_escalates_about_the_rate_with_ties_drawn():
    """differs takes 0 / 0.5 / 1 only: its 20% threshold is 1.0 and the strict rule escalates nothing; with ties drawn
    the share is about the rate on another split, the same for the same seed, other rows for another seed."""
    cal, cal_ids = _three_valued(4000, "cal", 0)
    conf, ids = _three_valued(4000, "conf", 1)
    cut = threshold(cal, 0.2)
    assert cut == 1.0 and not above(conf, cut).any()
    p = tie_probability(cal, cut, 0.2)
    assert p == pytest.approx(0.2 * len(cal) / (cal == 1.0).sum())
    assert abs(above_or_drawn(cal, cut, cal, 0.2, cal_ids).mean() - 0.2) < 0.02  # the split it was fitted on
    esc = above_or_drawn(conf, cut, cal, 0.2, ids)
    assert abs(esc.mean() - 0.2) < 0.03 and set(conf[esc]) == {1.0}
    assert (above_or_drawn(conf, cut, cal, 0.2, ids) == esc).all()  # deterministic for a seed
    assert (above_or_drawn(conf[::-1], cut, cal, 0.2, ids[::-1])[::-1] == esc).all()  # per id, not per position
    other = above_or_drawn(conf, cut, cal, 0.2, ids, seed=7)
    assert abs(other.mean() - 0.2) < 0.03 and (other != esc).any()


def test_ties_drawn_leave_a_continuous_score_as_the_strict_rule():
    rng = np.random.default_rng(3)
    cal, conf = rng.random(300), rng.random(500)
    cut = threshold(cal, 0.2)
    ids = [f"x{i}" for i in range(500)]
    assert (above_or_drawn(conf, cut, cal, 0.2, ids) == above(conf, cut)).all()
    assert tie_probability(np.array([1.0, 1.0, 2.0, np.nan]), 1.0, 0.5) == pytest.approx(0.25)  # (1.5 - 1) / 2
    assert tie_probability(np.array([1.0, 2.0]), 1.5, 0.2) == 0.2  # no calibration score at the cut: the rate


# ------------------------------------------------------------------------------------- 2. answers, not end tokens
def test_differs_compares_answers_not_the_token_that_ended_them():
    """Three draws identical up to the stop, ended by different tokens (draw 0 reached the stop string with token 30,
    the others an EOS, 2, or 30 itself): the same answer. A token at the end that does not end the answer, or a
    different answer token, still differs."""
    leader = [216, 35, 40, 30]  # the first token from the prefill, two answer tokens, the token that reached "\n"
    n_answer = 3
    span = agreement.scored_span(n_answer, len(leader), first_from_prefill=True)
    ends = {2, 30}.__contains__  # EOS, or a token that is the stop string itself
    same_answer = [[216, 35, 40, 2], [216, 35, 40, 30]]
    assert agreement.differs(leader, same_answer, span, n_answer=n_answer, ends_answer=ends) == 0.0
    assert agreement.differs(leader, same_answer, span) == 0.5  # the recorded definition: the end token counts
    longer = [[216, 35, 40, 41], [216, 35, 40, 2]]  # the first draw's answer goes on
    assert agreement.differs(leader, longer, span, n_answer=n_answer, ends_answer=ends) == 0.5
    other = [[216, 36, 40, 30], [216, 35, 40, 2]]  # an answer token differs
    assert agreement.differs(leader, other, span, n_answer=n_answer, ends_answer=ends) == 0.5
    assert math.isnan(agreement.differs(leader, [], span, n_answer=n_answer, ends_answer=ends))
    with pytest.raises(ValueError, match="together"):
        agreement.differs(leader, same_answer, span, n_answer=n_answer)
    assert agreement.answers_differ("7085356", ["7085356", "7085356"]) == 0.0
    assert agreement.answers_differ('"Salfelzan', ['"Salfelzan"', '"Salfelzan']) == 0.5
    assert math.isnan(agreement.answers_differ("a", []))


def test_the_reported_flag_reads_the_draws_answers():
    frame = pd.DataFrame(dict(draw_answers=[["7", "7", "7", "8"], ["7", "8", "7", "7"], ["a", "b", "c", "a"]],
                              differs_split=[1.0, 0.0, 0.5]))  # fmt: skip
    assert answers_differ_score(frame, "r3").tolist() == [0.0, 0.5, 1.0]
    assert answers_differ_score(frame, "r4").tolist() == [1 / 3, 1 / 3, 2 / 3]
    assert answers_differ_score(frame, "split").tolist() == [1.0, 0.0, 0.5]  # the halves decode no own answer


def test_on_the_published_records_six_smollm2_rows_change_and_none_of_gemma3():
    from kvcert.studies.study5.common import load_rows

    for tag, n in (("smollm2", 6), ("gemma3", 0)):
        rows = load_rows(f"results/study5/{tag}/answers.jsonl")
        new = answers_differ_score(rows, "r3")
        assert int((new != rows["differs_r3"].to_numpy(float)).sum()) == n
        assert (new <= rows["differs_r3"].to_numpy(float)).all()  # only end tokens were wrongly counted


# ---------------------------------------------------------------------------------------- 3. the oracle's rate
def _study(n_per_cell: int = 30, fail_share: float = 0.5) -> analysis.Study5:
    rows = []
    for task in ("alpha", "beta"):
        for i in range(2 * n_per_cell):
            length = 1024 if i % 2 else 2048
            broken = i < 2 * fail_share * n_per_cell
            rows.append(dict(example_id=f"{task}-{i:03d}", task=task, context_tokens=length, budget=0.5,
                             full_correct=True, correct=not broken, full_kv_bytes=100.0, kv_one=30.0, kv_r2=40.0,
                             confidence=float(broken), certificate=0.0, disagreement_r2=0.0, differs_r2=0.0,
                             draw_answers=["a", "a"], draw_correct=[not broken, not broken]))  # fmt: skip
    design = dict(variant="independent", draws=2, form="alone")
    return analysis.Study5(pd.DataFrame(rows), design, 0.5)


def test_the_oracle_is_reported_capped_at_the_rate_and_uncapped():
    s = _study()
    n, failures = len(s.conf), int(s.conf["cache_failure"].sum())
    assert failures > 0.2 * n  # more cache-induced failures than the rate allows
    uncapped, capped, within = s.oracle(), s.oracle(0.2), s.oracle(0.2, within=True)
    assert uncapped["escalated"].sum() == failures
    assert capped["escalated"].sum() == round(0.2 * n)
    assert capped["correct"].mean() == pytest.approx(s.conf["correct"].mean() + round(0.2 * n) / n)
    for _, group in s.conf.groupby(["task", "context_tokens"]):
        assert within.loc[group.index, "escalated"].sum() == round(0.2 * len(group))
    assert (capped["escalated"][capped["escalated"] > 0].index.isin(s.conf.index[s.conf["cache_failure"]])).all()
    few = _study(fail_share=0.1)  # fewer failures than the cap: every one, below the rate
    assert few.oracle(0.2)["escalated"].sum() == few.conf["cache_failure"].sum() < 0.2 * len(few.conf)


def test_the_report_labels_both_oracles_and_both_differs_rows(tmp_path):
    from test_study5 import records

    design = dict(budgets=[0.5, 0.25], variant="independent", draws=3, form="combined")
    table = analysis.signal_table(records(20), design, 0.5)
    names = table["signal"].tolist()
    assert analysis.ORACLE_UNCAPPED in names and analysis.ORACLE_CAPPED in names and "oracle" not in names
    assert analysis.SIGNAL_ROWS["differs"] in names and analysis.SIGNAL_ROWS["differs_answers"] in names
    assert {"overall_rate", "drawn_rate"} <= set(table.columns)


# ------------------------------------------------------------------------------------- fragility (exploratory)
def test_redoing_the_selection_reproduces_the_claim_at_unit_weights():
    """The reselecting bootstrap's point estimate is the claim's; its intervals differ only in how they resample."""
    from test_study5 import records

    design = dict(budgets=[0.5, 0.25], variant="independent", draws=3, form="combined")
    spec = dict(test="within_cell_gain", budget=0.5, a="agreement", b="confidence", rule="margin", margin=2.0, unit="")
    answers = records(30, seed=4)
    claim = analysis.evaluate_claim(answers, design, spec)
    s = analysis.Study5(answers, design, 0.5)
    again = fragility.reselected(s, spec, 100, 1, analysis.RATE)
    assert again["estimate"] == pytest.approx(claim["estimate"], abs=1e-9)
    assert again["lo"] <= again["estimate"] <= again["hi"]
    seeds = fragility.by_seed(s, spec, 100, seeds=(1, 2))
    assert [r["seed"] for r in seeds] == [1, 2]
    assert all(r["estimate"] == pytest.approx(claim["estimate"]) for r in seeds)


def test_the_published_report_says_which_verdicts_are_fragile():
    """results/study5/report.md (regenerated by make analyze) names SmolLM2's P2 and Gemma 3's P1 as fragile."""
    text = Path("results/study5/report.md").read_text()
    assert "**smollm2 P2 is fragile**" in text and "**gemma3 P1 is fragile**" in text
    assert "6 of 9 other bootstrap seeds" in text and "12 examples where agreement wins against 4" in text
    assert "makes it refuted" in text
    claims = json.loads(Path("results/study5/claims.json").read_text())
    assert claims["smollm2"]["claims"]["P2"]["verdict"] == "supported"
    assert claims["gemma3"]["claims"]["P1"]["verdict"] == "inconclusive"


# ------------------------------------------------------------------------- the same comparison in kvcert.generate
class _Tokenizer:
    """Six tokens: "7", "0", an EOS, "\\n" (the stop string itself), ".\\n" and "8"."""

    vocab = {0: "7", 1: "0", 2: "", 3: "\n", 4: ".\n", 5: "8"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)


def test_generates_draws_compare_answers_not_end_tokens():
    """kvcert.generate's draws (kvcert.hf.draws.agreement_of with answer_end): a draw ending draw 0's answer "70"
    with an EOS where draw 0 reached the stop string agrees; one that adds "." before the stop, or goes on, differs."""
    from kvcert.hf.decode import VariantResult, answer_length
    from kvcert.hf.draws import agreement_of, answer_end
    from kvcert.serve.generate import default_policy

    tok, eos, stops = _Tokenizer(), {2}, ("\n",)
    tokens = [0, 1, 3]
    n, text = answer_length(tok, tokens, eos, stops)
    assert (n, text) == (2, "70")

    def row(own=None):
        return VariantResult(policy=default_policy(0.25), tokens=list(tokens), logprobs=[-0.1] * 3, n_answer=n,
                             answer=text, kept_tokens=1.0, stats={}, own_tokens=own)  # fmt: skip

    leader = row()
    followers = [row([0, 1, 2]), row([0, 1, 4]), row([0, 1, 5])]
    ends = answer_end(tok, eos, stops, leader)
    assert [ends(t) for t in (2, 3, 4, 5)] == [True, True, False, False]
    got = agreement_of(leader, followers, ends)
    assert got.row_differs == [False, True, True] and got.differs == pytest.approx(2 / 3)
    assert agreement_of(leader, followers).row_differs == [True, True, True]  # tokens compared
