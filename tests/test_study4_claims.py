"""Study 4's locked machinery: the level rule, the decision rules, the tolerance and KV-matched choices against hand
computations, the collector against `kvcert.generate` (an independent path), and the lock-before-records guard."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest

from kvcert.studies.study4.analysis import kv_matched_threshold
from kvcert.studies.study4.claims import tolerance_choice, verdict
from kvcert.studies.study4.cli import choose_level


def test_the_level_rule_takes_the_eligible_level_closest_to_055_with_declared_ties():
    assert choose_level({0: 0.9, 1: 0.6, 2: 0.2}, default=2) == 1
    assert choose_level({0: 0.95, 1: 0.25, 2: 0.1}, default=2) is None  # nothing in [0.3, 0.8]: dropped
    assert choose_level({0: 0.45, 1: 0.65, 2: 0.45}, default=2) == 2  # a tie goes to the default
    assert choose_level({0: 0.45, 1: 0.65, 3: 0.9}, default=3) == 0  # then to the lower level
    assert choose_level({0: math.nan, 1: 0.3}, default=0) == 1


@pytest.mark.parametrize(
    ("rule", "result", "expected"),
    [
        ("margin", dict(estimate=4.0, lo=0.5, hi=8.0), "supported"),
        ("margin", dict(estimate=2.0, lo=0.5, hi=4.0), "inconclusive"),  # above 0 but under the margin
        ("margin", dict(estimate=0.0, lo=-2.5, hi=2.5), "refuted"),  # the margin is excluded
        ("positive", dict(estimate=1.0, lo=0.1, hi=2.0), "supported"),
        ("positive", dict(estimate=-1.0, lo=-2.0, hi=-0.1), "refuted"),
        ("positive", dict(estimate=math.nan, lo=-2.0, hi=1.0), "inconclusive"),
        ("less_kv", dict(estimate=0.8, lo=0.7, hi=0.9, accuracy_lo=-1.0), "supported"),
        ("less_kv", dict(estimate=0.8, lo=0.7, hi=0.9, accuracy_lo=-4.0), "inconclusive"),  # too much accuracy lost
        ("less_kv", dict(estimate=1.1, lo=1.0, hi=1.2, accuracy_lo=0.0), "refuted"),
    ],
)
def test_the_decision_rules(rule, result, expected):
    assert verdict(rule, result, margin=3.0) == expected


def _ladder_rows(example_id, errors, correct, full_correct=True):
    return [
        dict(
            example_id=example_id,
            budget=b,
            probe_error=e,
            correct=c,
            full_correct=full_correct,
            kv_bytes=100 * b,
            full_kv_bytes=100,
        )
        for b, e, c in zip((0.125, 0.25, 0.5), errors, correct)
    ]


def test_the_tolerance_rule_takes_the_smallest_rung_within_tolerance_else_the_full_cache():
    frame = pd.DataFrame(
        _ladder_rows("a", (0.3, 0.08, 0.02), (False, True, True))
        + _ladder_rows("b", (0.05, 0.03, 0.01), (True, True, True))
        + _ladder_rows("c", (0.5, 0.4, 0.2), (False, False, False), full_correct=True)
    )
    chosen = tolerance_choice(frame, 0.1).set_index("example_id")
    assert chosen.loc["a", "budget"] == 0.25 and chosen.loc["a", "correct"]
    assert chosen.loc["b", "budget"] == 0.125 and chosen.loc["b", "kv_bytes"] == 12.5
    # above every rung: the full cache, whose answer is the full cache's
    assert chosen.loc["c", "budget"] == 1.0 and chosen.loc["c", "correct"] and chosen.loc["c", "kv_bytes"] == 100


def test_the_kv_matched_threshold_spends_no_more_memory_than_random_at_the_rate():
    cal = pd.DataFrame(
        dict(score_certificate=[0.9, 0.8, 0.1, 0.2], kv_bytes=[10, 10, 10, 10], full_kv_bytes=[100, 20, 20, 20])
    )

    def escalated_scores(rate: float) -> list[float]:
        t = kv_matched_threshold(cal, "certificate", rate)
        return sorted(cal.loc[cal["score_certificate"] > t, "score_certificate"].tolist())

    # random at 25%: 0.75 * 10 + 0.25 * 40 = 17.5 mean bytes; escalating the top example alone costs 32.5: none
    assert escalated_scores(0.25) == []
    # at 75%: 0.25 * 10 + 0.75 * 40 = 32.5; the top example (32.5) fits, adding the next (35) does not
    assert escalated_scores(0.75) == [0.9]
    # at 100%: 40 bytes, everything fits
    assert escalated_scores(1.0) == [0.1, 0.2, 0.8, 0.9]


def test_the_collector_equals_generate_on_every_budget(tiny_smol):
    """One read and one batched decode give what `kvcert.generate` gives per budget: answers, KV bytes and the
    answer's largest certificate (an independent path: one read and one decode per call)."""
    from kvcert.bench.common import no_eos
    from kvcert.policy import FULL
    from kvcert.serve.generate import generate
    from kvcert.studies.study4.collect import MAX_NEW_TOKENS, example_rows
    from kvcert.tasks import make_examples

    model, tok = tiny_smol
    example = make_examples("needle_reworded", 1, 300, tok, seed=8901)[0]
    kw = dict(
        context=example.context,
        question=example.question,
        answer_prefix=example.answer_prefix,
        max_new_tokens=MAX_NEW_TOKENS,
        calibration=None,
        prompt_format="chat",
    )
    with no_eos(model), warnings.catch_warnings():  # "no calibration" (warned once per process, maybe already)
        warnings.simplefilter("ignore")
        rows = example_rows(model, tok, example, [0.5, 0.25], model_name="tiny")
        full = generate(model, tok, policy=FULL, **kw)
        for row in rows:
            out = generate(model, tok, budget=row["budget"], **kw)
            n = row["n_answer"]
            assert row["answer"] == out.text and n == len(out.steps) and row["full_answer"] == full.text
            assert row["kv_bytes"] == out.kv_bytes
            certs = [c for c in out.certificate[:n] if math.isfinite(c)]
            assert row["certificate"] == pytest.approx(max(certs), rel=1e-4)
            assert row["logprob"] == pytest.approx(min(out.logprobs[:n]), abs=1e-4)
            assert row["probe_error"] == pytest.approx(out.probe.error, rel=1e-5)
    assert rows[0]["full_kv_bytes"] == full.kv_bytes


def test_the_run_refuses_before_the_lock(tmp_path):
    from kvcert.studies.study4.cli import run

    with pytest.raises(SystemExit, match="LOCK.json is missing: lock the study first"):
        run("smollm2", root=tmp_path)


def test_claims_reach_the_scorecard_only_from_complete_records(tmp_path):
    """An incomplete study-4 record set decides nothing (no card, analyze writes only an interim report); complete
    records give a card per model with each claim's verdict and interval."""
    import json
    import shutil
    from pathlib import Path

    import yaml

    from kvcert.studies.study4.cli import analyze, complete, scorecard_cards

    prereg = tmp_path / "preregistration/study4"
    prereg.mkdir(parents=True)
    shutil.copy(Path("preregistration/study4/predictions_smollm2.yaml"), prereg)
    design = dict(
        seed=8000,
        lengths=[1024],
        budgets=[0.5, 0.25, 0.125],
        models={"smollm2": dict(model="smollm2-135m-instruct", tasks={"word_needle": 1}, n_per_cell=40)},
    )
    (prereg / "design.yaml").write_text(yaml.safe_dump(design))
    out = tmp_path / "results/study4/smollm2"
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        full_kv, cert, full_ok = 1000.0, float(rng.random()), bool(rng.random() < 0.7)
        for b in (0.5, 0.25, 0.125):
            rows.append(
                dict(
                    example_id=f"word_needle-1024-s8000-{i:04d}",
                    task="word_needle",
                    context_tokens=1024,
                    budget=b,
                    correct=full_ok and cert < 0.6,
                    full_correct=full_ok,
                    certificate=cert,
                    logprob=-float(rng.random()),
                    probe_error=cert * b,
                    kv_bytes=full_kv * b,
                    full_kv_bytes=full_kv,
                    prompt_tokens=1100,
                )
            )
    lines = [json.dumps(r) for r in rows]
    (out / "answers.jsonl").write_text("\n".join(lines[:60]) + "\n")  # 20 of 40 examples
    assert not complete("smollm2", tmp_path)
    assert analyze(tmp_path) == {} and scorecard_cards(tmp_path) == {}
    assert analyze(tmp_path, partial=True) and (out / "interim_report.md").is_file()
    assert not (out / "claims.json").exists()
    (out / "answers.jsonl").write_text("\n".join(lines) + "\n")
    claims = analyze(tmp_path)["smollm2"]
    card = scorecard_cards(tmp_path)["study4_smollm2"]
    assert {c["id"] for c in card["claims"]} == set(claims) >= {"P1", "C5", "P5"}
    c5 = next(c for c in card["claims"] if c["id"] == "C5")
    assert c5["verdict"] in ("supported", "refuted", "inconclusive") and c5["ci"][0] <= c5["observed"] <= c5["ci"][1]


@pytest.fixture(scope="module")
def smollm2():
    from kvcert.hf import load_model

    return load_model("smollm2-135m-instruct")


def test_the_token_level_answer_continues_with_the_full_cache(smollm2):
    """On the packaged model: an empty kept prefix gives the full cache's answer of the batched read, and kept tokens
    that are the full cache's own first tokens continue into the same answer (greedy decoding is consistent)."""
    from kvcert.studies.study4.collect import example_rows, token_level_answer
    from kvcert.tasks import make_examples

    model, tok = smollm2
    example = make_examples("needle_reworded", 1, 300, tok, seed=8902)[0]
    row = example_rows(model, tok, example, [0.5], model_name="smollm2-135m-instruct")[0]
    full = token_level_answer(model, tok, example, [], model_name="smollm2-135m-instruct")
    assert full["answer"] == row["full_answer"] and full["correct"] == row["full_correct"]
    assert len(full["tokens"]) >= 3
    cont = token_level_answer(model, tok, example, full["tokens"][:2], model_name="smollm2-135m-instruct")
    assert cont["answer"] == full["answer"] and cont["kept"] == 2


def _write_study(root, n_examples: int = 40) -> list[dict]:
    """A complete synthetic study-4 record set for smollm2 under root (design, predictions, answers.jsonl)."""
    import json
    import shutil
    from pathlib import Path

    import yaml

    prereg = root / "preregistration/study4"
    prereg.mkdir(parents=True)
    shutil.copy(Path("preregistration/study4/predictions_smollm2.yaml"), prereg)
    design = dict(seed=8000, lengths=[1024], budgets=[0.5, 0.25, 0.125],
                  models={"smollm2": dict(model="smollm2-135m-instruct", tasks={"word_needle": 1},
                                          n_per_cell=n_examples)})  # fmt: skip
    (prereg / "design.yaml").write_text(yaml.safe_dump(design))
    rng = np.random.default_rng(1)
    rows = []
    for i in range(n_examples):
        cert, full_ok = float(rng.random()), bool(rng.random() < 0.7)
        for b in (0.5, 0.25, 0.125):
            rows.append(dict(example_id=f"word_needle-1024-s8000-{i:04d}", task="word_needle", context_tokens=1024,
                             budget=b, correct=full_ok and cert < 0.6, full_correct=full_ok, certificate=cert,
                             logprob=-float(rng.random()), probe_error=cert * b, kv_bytes=1000.0 * b,
                             full_kv_bytes=1000.0, prompt_tokens=1100, answer=f"a{i}",
                             full_answer=f"f{i}"))  # fmt: skip
    out = root / "results/study4/smollm2"
    out.mkdir(parents=True)
    (out / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_the_full_regeneration_check_compares_every_row_and_every_verdict(tmp_path):
    """make reproduce's study-4 step: an identical regeneration passes with a verdict row per claim; a signal off by
    more than its tolerance on one row fails; a regeneration missing examples is refused in one line."""
    import json

    from kvcert.studies.study4.regeneration import full_regeneration_check

    rows = _write_study(tmp_path)
    regen = tmp_path / "results/study4/smollm2/regenerated"
    regen.mkdir()
    with pytest.raises(SystemExit, match="no complete regeneration"):
        full_regeneration_check("smollm2", tmp_path)
    (regen / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    passed, text = full_regeneration_check("smollm2", tmp_path)
    assert passed and "all 40 examples regenerated: **PASS**" in text
    table = _report_rows(text)
    assert table["identical answers"]["value"] == "120 / 120" and table["P1 verdict"]["result"] == "pass"
    assert {k for k in table if k.endswith(" verdict")} == {f"{c} verdict" for c in _claim_ids()}
    off = [dict(r, certificate=r["certificate"] * 1.01) if i == 7 else r for i, r in enumerate(rows)]
    (regen / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in off))
    passed, text = full_regeneration_check("smollm2", tmp_path)
    row = _report_rows(text)["certificate (rel difference, identical answers)"]
    assert not passed and row["result"] == row["locked_result"] == "FAIL"
    assert float(row["value"]) == pytest.approx(0.01, rel=0.02)
    # a derived tolerance (study4 derive) above the change passes it, and the locked tolerance's FAIL stays beside it
    derived = {"models": {"smollm2": {"derived": {"certificate": 0.02, "logprob": 1e-9, "probe_error": 0.0}}}}
    (tmp_path / "preregistration/study4/regeneration_tolerances.json").write_text(json.dumps(derived))
    passed, text = full_regeneration_check("smollm2", tmp_path)
    row = _report_rows(text)["certificate (rel difference, identical answers)"]
    assert passed and (row["result"], row["locked_result"], row["tolerance"]) == ("pass", "FAIL", "<= 0.02")
    assert _report_rows(text)["logprob (abs difference, identical answers)"]["tolerance"] == "<= 0.001"  # the larger
    (regen / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-3]))
    with pytest.raises(SystemExit, match="lacks 1 examples"):
        full_regeneration_check("smollm2", tmp_path)


def _report_rows(text: str) -> dict[str, dict[str, str]]:
    """{item: {column: cell}} of a regeneration report's table."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return {row[0]: dict(zip(cells[0], row)) for row in cells[1:]}


def _claim_ids() -> set[str]:
    import yaml

    return set(yaml.safe_load(open("preregistration/study4/predictions_smollm2.yaml"))["claims"])


def test_the_package_keeps_its_command_line():
    """`python -m kvcert.studies.study4` (the package's __main__) still offers every subcommand, and the package
    re-exports what the combined scorecard reads."""
    import subprocess
    import sys

    import kvcert.studies.study4 as study4
    from kvcert.studies.study4 import cli, common

    out = subprocess.run(
        [sys.executable, "-m", "kvcert.studies.study4", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for cmd in ("select", "run", "analyze", "token-reference", "regenerate-check", "thresholds", "derive"):
        assert cmd in out.stdout
    assert study4.scorecard_cards is cli.scorecard_cards and study4.MODELS is common.MODELS
