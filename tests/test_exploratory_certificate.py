"""kvcert.exploratory.certificate on synthetic step records with known answers."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from kvcert.exploratory.certificate import (
    add_strata,
    calibration_curve,
    certificate_trusted,
    conformal_quantile,
    coverage_table,
    multiplier_for_coverage,
    nominal_level_of_multiplier,
    plot_calibration,
    radii,
    split_conformal,
)


def _gaussian_steps(n=40000, seed=0):
    """Cells whose error is the norm of a Gaussian with isotropic covariance of dimension h (V_hat = tr C = 1)."""
    rng = np.random.default_rng(seed)
    h = rng.choice([1, 4, 16, 64], n)
    err = np.sqrt(rng.chisquare(h) / h)
    return pd.DataFrame(
        {
            "error": err,
            "variance": 1.0,
            "trace_c2": 1.0 / h,
            "ess_tail": 1e9,
            "tail_mass": 0.5,
            "example_id": rng.integers(0, 200, n),
            "layer": rng.integers(0, 3, n),
        }
    )


def test_radii_reduce_to_each_other_at_their_limits():
    df = pd.DataFrame({"error": [1.0, 1.0], "variance": [4.0, 4.0], "eff_dim": [1.0, 64.0], "ess_tail": [1e9, 3.0]})
    rf = radii(df, 0.95)
    assert np.isclose(rf["r_conservative"][0], 1.959964 * 2, rtol=1e-6)
    assert np.isclose(rf["r_tight"][0], rf["r_conservative"][0])  # rank one: the normal radius
    assert np.isclose(rf["r_tight"][1], np.sqrt(4 * stats.chi2.ppf(0.95, 64) / 64))
    assert np.isclose(rf["r_tight_ess"][0], rf["r_tight"][0], rtol=1e-6)  # infinite dof: F -> chi2 / h
    assert np.isclose(rf["r_conservative_ess"][1], stats.t.ppf(0.975, 2) * 2)
    assert np.isclose(rf["r_tight_ess"][1], np.sqrt(4 * stats.f.ppf(0.95, 64, 2)))
    # without trace_c2 / eff_dim / ess_tail the radii that need them are NaN, not guessed
    bare = radii(df[["error", "variance"]], 0.95)
    assert bare["r_tight"].isna().all() and bare["r_tight_ess"].isna().all() and bare["r_conservative"].notna().all()


def test_coverage_table_on_known_counts():
    # variance 1: conservative radius 1.96; errors 0.5 (covered) x 9 and 3.0 (not) x 1 in stratum a; all 3.0 in b
    df = pd.DataFrame({"error": [0.5] * 9 + [3.0] + [3.0] * 5, "variance": 1.0, "g": ["a"] * 10 + ["b"] * 5})
    t = coverage_table(df, "g").set_index("g")
    assert t.loc["a", "coverage_conservative"] == pytest.approx(0.9)
    assert t.loc["b", "coverage_conservative"] == 0.0
    assert t.loc["a", "n"] == 10
    assert t.loc["a", "median_r_over_err_conservative"] == pytest.approx(1.959964 / 0.5, rel=1e-6)
    pooled = coverage_table(df)
    assert len(pooled) == 1 and pooled["coverage_conservative"][0] == pytest.approx(9 / 15)
    assert "coverage_tight" not in pooled  # no trace_c2: the tight radius is not reported


def test_tight_radius_is_calibrated_and_conservative_over_covers_on_gaussian_records():
    df = _gaussian_steps()
    curve = calibration_curve(df, levels=(0.5, 0.8, 0.9, 0.95, 0.99)).set_index(["radius", "level"])
    for level in (0.5, 0.8, 0.9, 0.95, 0.99):
        assert abs(curve.loc[("tight", level), "coverage"] - level) < 0.01
    assert curve.loc[("conservative", 0.95), "coverage"] > 0.98
    by_h = coverage_table(df.assign(h=(1 / df["trace_c2"]).round()), "h").set_index("h")
    assert abs(by_h.loc[1, "coverage_conservative"] - 0.95) < 0.01  # rank one: z sqrt(V_hat) is exact
    assert by_h.loc[64, "coverage_conservative"] == 1.0


def test_split_conformal_recovers_a_known_multiplier_per_layer():
    rng = np.random.default_rng(1)
    n = 30000
    layer = rng.integers(0, 2, n)
    c = np.where(layer == 0, 1.0, 2.5)  # error / (1.96 sqrt(V)) = c |N(0,1)| / 1.96 -> 0.95 quantile c
    df = pd.DataFrame(
        {
            "error": c * np.abs(rng.standard_normal(n)),
            "variance": 1.0,
            "layer": layer,
            "example_id": rng.integers(0, 300, n),
        }
    )
    pooled = split_conformal(df, "conservative", n_boot=50)
    assert len(pooled) == 2 and set(pooled["fit_half"]) == {"A", "B"}
    for _, row in pooled.iterrows():
        assert abs(row["heldout_coverage"] - 0.95) < 0.01
        assert row["multiplier_lo"] <= row["multiplier"] <= row["multiplier_hi"]
    per = split_conformal(df, "conservative", per="layer", n_boot=50)
    m = per.groupby("stratum")["multiplier"].mean()
    assert m[0] == pytest.approx(1.0, abs=0.05) and m[1] == pytest.approx(2.5, abs=0.12)
    for _, row in per.iterrows():
        assert abs(row["heldout_coverage"] - 0.95) < 0.015
        assert row["multiplier_lo"] < [1.0, 2.5][row["stratum"]] * 1.05 < row["multiplier_hi"] * 1.1
    assert (per.loc[per["stratum"] == 1, "heldout_coverage_raw"] < 0.7).all()


def test_conformal_quantile_and_multiplier_helpers():
    assert conformal_quantile(np.arange(1, 20, dtype=float), 0.95) == 19.0  # ceil(20 * 0.95) = 19th
    assert conformal_quantile(np.arange(1, 10, dtype=float), 0.95) == float("inf")
    assert nominal_level_of_multiplier(1.0) == pytest.approx(0.95)
    assert nominal_level_of_multiplier(1.38) > 0.99
    rng = np.random.default_rng(2)
    df = pd.DataFrame({"error": 2.0 * np.abs(rng.standard_normal(200000)), "variance": 1.0})
    assert multiplier_for_coverage(df, 0.97) == pytest.approx(2.0 * stats.norm.ppf(0.985) / 1.959964, rel=0.02)


def test_strata_and_trusted_flag():
    df = pd.DataFrame(
        {"error": 0.1, "variance": 1.0, "tail_mass": [5e-4, 5e-3, 0.05, 0.5], "ess_tail": [1.0, 3.0, 12.0, 40.0]}
    )
    s = add_strata(df)
    assert list(s["tail_mass_bin"].astype(str)) == ["<1e-3", "[1e-3,1e-2)", "[1e-2,0.1)", ">=0.1"]
    assert list(s["ess_bin"].astype(str)) == ["<2", "[2,5)", "[10,30)", ">=30"]
    assert list(certificate_trusted(df)) == [False, False, True, True]
    assert list(certificate_trusted(df, ess_min=30, tail_mass_min=0)) == [False, False, False, True]
    assert certificate_trusted(df[["error", "variance"]]).all()  # nothing recorded, nothing checked


def test_plot_calibration_writes_a_png(tmp_path):
    curve = calibration_curve(_gaussian_steps(2000), levels=(0.5, 0.9, 0.95))
    path = plot_calibration(curve, tmp_path / "fig" / "cal.png")
    assert path.exists() and path.stat().st_size > 1000


def test_ess_ratio_flag_and_bins():
    df = pd.DataFrame(
        {"error": 0.1, "variance": 1.0, "tail_mass": 0.5, "ess_tail": [15.0, 15.0, 3.0], "n_tail": [30, 300, 0]}
    )
    assert list(certificate_trusted(df, ess_ratio_min=0.3)) == [True, False, False]
    bins = add_strata(df)["ess_ratio_bin"]
    assert list(bins[:2].astype(str)) == [">=0.3", "[0.05,0.1)"] and pd.isna(bins[2])


def test_certificate_mc_smoke():
    from kvcert.exploratory.certificate_mc import accuracy_cost, candidate_table, simulate_cells

    cells = simulate_cells(draws=20, seeds=range(1, 3), budgets=(0.5,))
    assert {"error", "variance", "trace_c2", "trace_c2_sketch", "ess_tail", "regime", "floor"} <= set(cells)
    summary, long = candidate_table(cells)
    assert {"conservative", "tight", "tight_ess", "conformal_tight"} <= set(summary["radius"])
    assert summary["coverage_pooled"].between(0, 1).all()
    cost = accuracy_cost(cells)
    # one row per (regime, budget, floor): RMSE of the draws' errors, and its ratio to floor 0.2's, by hand
    assert set(cost["floor"]) == {0.2, 0.5} and len(cost) == 2 * cells["regime"].nunique()
    for _, r in cost.iterrows():
        same = cells[(cells["regime"] == r["regime"]) & (cells["budget"] == r["budget"])]

        def rmse(floor, same=same):
            return float(np.sqrt(np.mean(same.loc[same["floor"] == floor, "error"].to_numpy() ** 2)))

        assert r["rmse"] == pytest.approx(rmse(r["floor"]), rel=1e-12)
        assert r["rmse_ratio_to_floor0.2"] == pytest.approx(rmse(r["floor"]) / rmse(0.2), rel=1e-12)
    assert (cost.loc[cost["floor"] == 0.5, "rmse_ratio_to_floor0.2"] != 1).all()  # the floors' draws differ


def test_record_time_radius_equals_the_torch_one():
    import torch

    from kvcert.core.certificate import tight_radius

    rng = np.random.default_rng(3)
    v = rng.uniform(0.01, 2, 50)
    h = rng.uniform(1, 64, 50)
    df = pd.DataFrame({"error": 1.0, "variance": v, "trace_c2": v**2 / h})
    for level in (0.5, 0.9, 0.95, 0.99):
        ref = tight_radius(torch.tensor(v), torch.tensor(v**2 / h), level).numpy()
        assert np.allclose(radii(df, level)["r_tight"], ref, rtol=1e-8)
