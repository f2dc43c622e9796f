"""Study 3's pilot selection rule (preregistration/study3/PILOT.md), its secondary predictions S6 / C5 and its
registration beside studies 1 and 2."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from kvcert.analysis import claims
from kvcert.studies.pilot3 import select, summarize
from kvcert.studies.study3 import evaluate_study3_secondary
from synthetic import NB, ROOT, synthetic_examples, synthetic_steps

DEFAULTS = {"single_needle": 7, "multikey_needle": 3, "fact_qa": 3}


def _summary(rows: list[tuple[str, str, int, float]]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"model": m, "task": t, "level": lv, "full_accuracy": a} for m, t, lv, a in rows],
    )


def test_selection_rule_closest_to_055_in_range_else_dropped() -> None:
    chosen = select(
        _summary(
            [
                ("m", "single_needle", 7, 0.95),  # out of range
                ("m", "single_needle", 12, 0.80),  # eligible (inclusive), 0.25 from 0.55
                ("m", "single_needle", 20, 0.35),  # eligible, 0.20 from 0.55: chosen
                ("m", "multikey_needle", 1, 0.90),
                ("m", "multikey_needle", 3, 0.95),
                ("m", "multikey_needle", 9, 0.25),  # nothing in [0.3, 0.8]: dropped
                ("m", "fact_qa", 3, 0.45),  # 0.10 from 0.55, tie with 9: 3 is the default -> chosen
                ("m", "fact_qa", 9, 0.65),
                ("m", "fact_qa", 19, 0.20),
            ]
        ),
        DEFAULTS,
    ).set_index("task")
    assert chosen.loc["single_needle", "level"] == 20
    assert pd.isna(chosen.loc["multikey_needle", "level"])
    assert chosen.loc["multikey_needle", "reason"] == "no level in range"
    assert chosen.loc["fact_qa", "level"] == 3


def test_selection_tie_away_from_default_goes_to_the_lower_level() -> None:
    chosen = select(_summary([("m", "single_needle", 12, 0.50), ("m", "single_needle", 20, 0.60)]), DEFAULTS)
    assert chosen.loc[0, "level"] == 12  # both 0.05 from 0.55, both 5+ from the default 7: the lower


def test_summary_weighs_lengths_equally() -> None:
    ids = ["fact_qa-1k-s3000-0000", "fact_qa-1k-s3000-0001", "fact_qa-2k-s3000-0000", "fact_qa-4k-s3000-0000"]
    ex = pd.DataFrame(
        {
            "example_id": ids,
            "task": "fact_qa",
            "variant": "full",
            "design": "full",
            "budget": 1.0,
            "correct": [True, False, True, False],
        }
    )
    row = summarize({("m", 0): ex}, {0: {"fact_qa": 3}}).iloc[0]
    assert row["full_accuracy"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)  # not 2 / 4
    assert row["n"] == 4


def _records() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Synthetic records with study 3's variants: randomized t0.75 loses 20% of its keep rate; t0.25 rows equal
    top-k's answers (a small tail costs nothing), their cells cover like t0.75's."""
    ex = synthetic_examples(n=200, rand_penalty=0.2)
    small = ex[(ex["design"] == "randomized")].copy()
    topk = ex[ex["design"] == "topk"].set_index(["example_id", "scorer", "budget"])["correct"]
    small["correct"] = topk.loc[list(zip(small["example_id"], small["scorer"], small["budget"]))].to_numpy()
    small["tail_fraction"] = 0.25
    ex = pd.concat([ex, small], ignore_index=True)
    ex["variant"] = (
        ex["scorer"] + "/" + ex["design"] + "/" + ex["budget"].astype(str) + "/t" + ex["tail_fraction"].astype(str)
    )
    steps = synthetic_steps(ex)
    return ex, steps


def test_s6_and_c5_by_the_locked_claim_code() -> None:
    document = yaml.safe_load((ROOT / "preregistration" / "study3" / "predictions_smollm2.yaml").read_text())
    for spec in [*document["claims"].values(), *document["secondary"].values()]:
        if isinstance(spec, dict):
            spec["n_boot"] = NB
    ex, steps = _records()
    out = evaluate_study3_secondary(ex, steps, document)
    assert out["S6a"]["estimate"] > 10 and out["S6a"]["status"] == "met"  # t0.25 beats t0.75 by ~20 points
    assert out["S6b"]["estimate"] == pytest.approx(0.0) and out["S6b"]["status"] == "met"
    assert out["S6b_t075"]["estimate"] < -10 and out["S6b_t075"]["status"] == "failed"
    direct = claims.evaluate_claim("S6a", ex, None, document["secondary"]["S6a"])
    assert out["S6a"]["estimate"] == direct.observed and [out["S6a"]["lo"], out["S6a"]["hi"]] == direct.ci
    c1 = claims.evaluate_claim("C1", ex, steps, document["claims"]["C1"])
    assert out["S6c"]["coverage_t075"] == c1.observed
    assert out["S6c"]["coverage_gap"] == pytest.approx(out["S6c"]["estimate"] - c1.observed)
    assert out["S6c"]["status"] == ("met" if abs(out["S6c"]["coverage_gap"]) <= 0.03 else "failed")
    assert np.isfinite(out["S6c"]["rel_error_mean_t025"])
    assert out["C5"]["status"] == "undecidable at this scale"  # reported, never decided (PLAN.md section 5)


def test_study3_is_registered_beside_studies_1_and_2() -> None:
    from kvcert.prereg import STUDIES as LOCKS
    from kvcert.reproduce import STUDIES, settings

    for model in ("smollm2", "gemma3"):
        st = settings(f"study3_{model}")
        assert st["lock"] == "study3" and st["overrides"][-1] == "threads=1"
        assert set(claims.registry(st["predictions"], st["claims"])) == {"C1", "C2", "C3", "C4", "C6", "C7"}
    assert "requirements.lock" in LOCKS["study3"].required  # the environment's lock file is hashed
    assert {"study1", "study2"} < set(STUDIES)
