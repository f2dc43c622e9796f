"""C1 coverage (kvcert.analysis.coverage) on synthetic steps with known coverage."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis import coverage
from synthetic import NB, synthetic_examples, synthetic_steps

# --- coverage (C1) ---------------------------------------------------------------------------------------------


def test_coverage_of_exactly_0_9_by_construction():
    rows = []
    for i in range(40):
        n_bad = 2 if i % 2 else 0  # half the examples cover 8/10, half 10/10: pooled exactly 0.9
        for c in range(10):
            rows.append(
                {
                    "run": "r",
                    "example_id": f"e{i}",
                    "variant": "v",
                    "step": c,
                    "layer": 0,
                    "head": 0,
                    "variance": 4.0,
                    "error": 10.0 if c < n_bad else 1.0,
                    "tail_mass": 0.01,
                    "p_max": 0.2,
                }
            )
    res = coverage.pooled_coverage(pd.DataFrame(rows), 0.95, NB, 0)
    assert res["coverage"] == pytest.approx(0.9)
    assert res["lo"] < 0.9 < res["hi"] and res["n_examples"] == 40


def test_zero_variance_covers_only_zero_error_and_nonfinite_cells_are_excluded():
    st = pd.DataFrame({"example_id": ["a"] * 4, "error": [0.0, 1e-3, 1.0, np.nan], "variance": [0.0, 0.0, 1.0, 1.0]})
    res = coverage.pooled_coverage(st, 0.95, 50, 0)
    assert res["coverage"] == pytest.approx(2 / 3) and res["n_excluded_cells"] == 1


def test_calibration_monotone_and_gaussian_conformal_multiplier_near_one():
    ex = synthetic_examples(n=150, budgets=(0.5,), keep={0.5: 0.6})
    st = synthetic_steps(ex, inflate=1.0, cells=60)
    cal = coverage.calibration_curve(st, n_boot=NB)
    assert np.all(np.diff(cal["coverage"]) >= 0)
    assert cal.loc[cal["nominal"] == 0.95, "coverage"].item() == pytest.approx(0.95, abs=0.01)
    conf = coverage.conformal_multiplier(st, 0.95, split_seed=1, n_boot=NB)
    assert conf["multiplier"] == pytest.approx(1.0, abs=0.05)
    assert conf["coverage_test"]["estimate"] == pytest.approx(0.95, abs=0.01)
    assert conf["n_cal_examples"] + conf["n_test_examples"] == 150


def test_regime_table_exposes_a_bin_that_under_covers():
    ex = synthetic_examples(n=60, budgets=(0.5,), keep={0.5: 0.6})
    st = synthetic_steps(ex, inflate=0.5, cells=30)
    peaked = st["p_max"] > 0.6
    st.loc[peaked, "error"] *= 4.0  # the peaked regime breaks the radius
    table = coverage.coverage_by_regime(st, n_boot=NB)
    pm = table[table["regime"] == "p_max"].set_index("bin_hi")["coverage"]
    assert pm.loc[1.0] < 0.8 < pm.loc[0.6]
