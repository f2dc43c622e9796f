"""The pilot summary (kvcert.analysis.pilot); its values on real records are pinned by tests/test_golden.py."""

from __future__ import annotations

import pandas as pd

from kvcert.analysis.pilot import pilot_summary, write_pilot_summary
from synthetic import synthetic_examples, synthetic_steps


def test_pilot_summary_one_row_per_variant_and_both_files(tmp_path):
    ex = synthetic_examples(n=20, budgets=(0.5,), keep={0.5: 0.6})
    table = pilot_summary(ex, synthetic_steps(ex, cells=12))
    # one row per variant with design parameters: top-k and full-cache rows (tail_fraction NaN) are grouped away
    assert table["variant"].tolist() == sorted(ex.loc[ex["tail_fraction"].notna(), "variant"].unique())
    assert table["coverage"].between(0, 1).all() and (table["n"] == 20).all()
    paths = write_pilot_summary(table, tmp_path / "pilot")
    assert pd.read_csv(paths["csv"]).shape == table.shape
    assert "randomized" in paths["md"].read_text()
