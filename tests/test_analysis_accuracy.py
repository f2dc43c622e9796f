"""C2, C3 accuracies and paired differences (kvcert.analysis.accuracy)."""

from __future__ import annotations

import pytest

from kvcert.analysis import accuracy
from synthetic import NB, synthetic_examples

# --- accuracy (C2, C3) -----------------------------------------------------------------------------------------


def test_paired_accuracy_known_difference():
    ex = synthetic_examples(n=200, rand_penalty=0.0)
    same = accuracy.paired_accuracy_difference(ex, {"design": "randomized"}, {"design": "topk"}, n_boot=NB)
    assert same["diff"]["estimate"] == 0.0 and same["diff"]["lo"] == 0.0 and same["diff"]["hi"] == 0.0
    ex2 = ex.copy()
    rnd = ex2["design"] == "randomized"
    ex2.loc[rnd, "correct"] = False  # randomized loses every example topk had
    worse = accuracy.paired_accuracy_difference(ex2, {"design": "randomized"}, {"design": "topk"}, n_boot=NB)
    expected = -100 * ex.loc[ex["design"] == "topk", "correct"].mean()
    assert worse["diff"]["estimate"] == pytest.approx(expected)
    assert len(worse["cells"]) == 3


def test_drop_vs_full_and_accuracy_vs_budget():
    ex = synthetic_examples(n=200)
    sel = accuracy.select_rows(ex, {"design": "topk", "budget": [0.25]})
    res = accuracy.drop_vs_full(sel, n_boot=NB)
    assert res["drop"]["estimate"] == pytest.approx(100 * (sel["full_correct"].mean() - sel["correct"].mean()))
    table = accuracy.accuracy_vs_budget(ex, n_boot=50)
    assert set(table["design"]) == {"topk", "randomized"} and len(table) == 6
    assert (table.sort_values("budget").groupby("design")["accuracy"].apply(lambda s: s.is_monotonic_increasing)).all()
