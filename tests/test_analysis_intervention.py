"""C5, C7 ranked interventions (kvcert.analysis.intervention) with known answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis import intervention
from synthetic import NB, row, synthetic_examples

# --- gating (C5) -----------------------------------------------------------------------------------------------


def _gating_units(n: int = 400) -> pd.DataFrame:
    """A quarter of the units are fixable (wrong at low, right at high); the certificate ranks exactly them first."""
    rows = []
    for i in range(n):
        kind = i % 4  # 0 fixable, 1 right at both, 2, 3 wrong at both
        lo_ok, hi_ok = kind == 1, kind in (0, 1)
        cert = 10.0 + i * 1e-3 if kind == 0 else i * 1e-3
        for b, ok in ((0.5, lo_ok), (0.75, hi_ok)):
            rows.append(row(example_id=f"e{i}", budget=b, correct=ok, cert_score=cert, logprob_mean=-1.0))
    return pd.DataFrame(rows)


def test_perfect_certificate_escalation_beats_random_by_known_amount():
    units, excluded = intervention.escalation_units(_gating_units(), {"budget": 0.5}, {"budget": 0.75})
    assert excluded == 0 and len(units) == 400
    res = intervention.escalation_gain(units, 0.25, n_boot=NB)
    # cert: 25% + 25% fixed = 50%; random: 25% + 0.25 * 25% = 31.25%; gain 18.75 points
    assert res["certificate"]["estimate"] == pytest.approx(50.0)
    assert res["random"]["estimate"] == pytest.approx(31.25)
    assert res["gain_random"]["estimate"] == pytest.approx(18.75)
    assert res["confidence"]["estimate"] == pytest.approx(31.25)  # all confidences tied -> shared = random
    assert res["gain_random"]["lo"] > 10
    curves = intervention.escalation_curves(units)
    assert curves.query("policy == 'oracle' and rate == 0.25")["accuracy"].item() == pytest.approx(50.0)


def test_fractional_top_shares_ties():
    groups = intervention.descending_groups(np.array([3.0, 2.0, 2.0, 1.0]))
    sel = intervention.fractional_top(groups, np.ones(4), 0.5)
    assert sel.tolist() == [1.0, 0.5, 0.5, 0.0]


# --- recompute (C7) --------------------------------------------------------------------------------------------


def test_oracle_recompute_reaches_full_cache_at_the_cache_induced_fraction():
    ex = synthetic_examples(n=200, budgets=(0.5,), keep={0.5: 0.75})
    sel = ex[(ex["design"] == "randomized")]
    induced = (sel["full_correct"] & ~sel["correct"]).mean()
    budgets = sorted({0.0, 0.5, round(float(induced), 6)})
    curves = intervention.recompute_curves(sel, budgets)
    oracle = curves[curves["policy"] == "oracle"].set_index("budget")["accuracy"]
    full = 100 * sel["full_correct"].mean()
    assert oracle.loc[0.0] == pytest.approx(100 * sel["correct"].mean())
    assert oracle.loc[round(float(induced), 6)] == pytest.approx(full)
    assert oracle.loc[0.5] == pytest.approx(full)  # no row loses by recomputation here
    res = intervention.recompute_areas(sel, n_boot=NB)
    assert res["diff_random"]["lo"] > 0  # certificate is informative (cert_signal 3)
    assert res["oracle"]["estimate"] >= res["certificate"]["estimate"] >= res["random"]["estimate"]


def test_normalized_area_of_constant_curve():
    assert intervention.normalized_area([0, 0.25, 0.5], np.array([0.4, 0.4, 0.4])) == pytest.approx(0.4)
