"""kvcert.studies.cells: the per-cell table reproduces the locked coverage code's counts exactly."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvcert.analysis import coverage
from kvcert.studies import cells as C

RUN = "run-a"
DESIGN = {"tail_fraction": 0.75, "floor": 0.2, "score_power": 1.0}
C1_ROWS = {**DESIGN, "design": "randomized", "scorer": "window_question", "budget": [0.25, 0.5]}
RAND = "window_question/randomized/b{b}/t0.75/f0.2/p1/s0"


def example_row(eid: str, variant: str, design: str, budget: float, *, task="t0", tokens=1040, **kw) -> dict:
    cert = design == "randomized"
    return {
        "run": RUN,
        "example_id": eid,
        "task": task,
        "context_tokens": tokens,
        "variant": variant,
        "scorer": "none" if design == "full" else "window_question",
        "design": design,
        "budget": budget,
        "tail_fraction": 0.75 if cert else 0.0,
        "floor": 0.2,
        "score_power": 1.0,
        "seed": 0,
        "correct": True,
        "full_correct": True,
        "n_answer_tokens": 3,
        "logprob_mean": -0.5,
        "has_certificate": cert,
        "cert_score": 0.1 if cert else np.nan,
        "nonfinite": False,
        **kw,
    }


def synthetic(n_examples=6, n_steps=4, n_layers=3, n_heads=2, seed=0):
    """Examples (full, topk 0.25, randomized 0.25 / 0.5 / 0.75) and their step rows, with edge cases planted."""
    rng = np.random.default_rng(seed)
    ex_rows, step_frames = [], []
    for i in range(n_examples):
        eid = f"t0-1k-s0-{i:04d}"
        ex_rows.append(example_row(eid, "full", "full", 1.0))
        ex_rows.append(example_row(eid, "window_question/topk/b0.25", "topk", 0.25))
        for b in (0.25, 0.5, 0.75):
            ex_rows.append(example_row(eid, RAND.format(b=b), "randomized", b))
        for variant, has_var in (("full", False), *((RAND.format(b=b), True) for b in (0.25, 0.5, 0.75))):
            idx = np.indices((n_steps, n_layers, n_heads)).reshape(3, -1)
            n = idx.shape[1]
            var = rng.gamma(2.0, 0.01, n) if has_var else np.full(n, np.nan)
            err = (
                np.abs(rng.normal(0, 1.2, n)) * np.sqrt(np.nan_to_num(var, nan=1e-10))
                if has_var
                else rng.gamma(2, 1e-6, n)
            )
            tight = np.sqrt(var) * rng.uniform(1.2, 2.2, n) if has_var else np.full(n, np.nan)
            step_frames.append(
                pd.DataFrame(
                    {
                        "run": RUN,
                        "example_id": eid,
                        "variant": variant,
                        "step": idx[0].astype(np.int16),
                        "layer": idx[1].astype(np.int16),
                        "head": idx[2].astype(np.int16),
                        "error": err,
                        "variance": var,
                        "tail_mass": rng.choice([0.0, 5e-4, 1e-3, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0], n),
                        "p_max": rng.choice([0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.9, 1.0], n),
                        "radius95_tight": tight,
                        "certificate_trusted": rng.random(n) < 0.6 if has_var else np.zeros(n, bool),
                    }
                )
            )
    steps = pd.concat(step_frames, ignore_index=True)
    # planted edge cases on C1 rows: ratio exactly z(0.95) and z(0.5), zero variance with zero / positive error,
    # non-finite or negative variance (excluded), NaN regime values, NaN tight radius, NaN trusted flag
    c1 = steps.index[steps["variant"] == RAND.format(b=0.25)]
    z95, z50 = coverage.z_value(0.95), coverage.z_value(0.5)
    steps.loc[c1[0], ["error", "variance"]] = [z95, 1.0]
    steps.loc[c1[1], ["error", "variance"]] = [z50 * 2.0, 4.0]
    steps.loc[c1[2], ["error", "variance"]] = [0.0, 0.0]
    steps.loc[c1[3], ["error", "variance"]] = [1e-3, 0.0]
    steps.loc[c1[4], "variance"] = np.nan
    steps.loc[c1[5], "variance"] = -1e-4
    steps.loc[c1[6], "error"] = np.inf
    steps.loc[c1[7], ["tail_mass", "p_max"]] = [np.nan, np.nan]
    steps.loc[c1[8], "radius95_tight"] = np.nan
    steps.loc[c1[9], ["error", "radius95_tight"]] = [0.5, 0.5]
    steps["certificate_trusted"] = steps["certificate_trusted"].astype(object)
    steps.loc[c1[10], "certificate_trusted"] = None
    return pd.DataFrame(ex_rows), steps


def c1_steps(examples, steps):
    ex = examples[(examples["design"] == "randomized") & examples["budget"].isin([0.25, 0.5])]
    return coverage.steps_for(ex, steps)


def multipliers(n_layers=3):
    return pd.DataFrame(
        {
            "layer": np.arange(n_layers),
            "multiplier_gaussian": np.linspace(0.8, 1.3, n_layers),
            "multiplier_tight": np.linspace(1.0, 1.5, n_layers),
            "n_cells": 1,
        }
    )


@pytest.fixture(scope="module")
def data():
    examples, steps = synthetic()
    cells, n_excluded = C.coverage_cells(
        examples, steps, rows=C1_ROWS, multipliers=multipliers(), numerical_floor=0.003
    )
    return examples, steps, cells, n_excluded


def test_ratio_bins_edges():
    levels = coverage.DEFAULT_LEVELS
    z = np.array([coverage.z_value(lv) for lv in levels])
    ratio = np.array([0.0, z[0], np.nextafter(z[0], np.inf), z[6], np.nextafter(z[6], np.inf), z[-1], np.inf, 1e9])
    bins = C.ratio_bins(ratio, levels)
    assert bins.tolist() == [0, 0, 1, 6, 7, 8, 9, 9]
    for j, zj in enumerate(z):  # covered at levels[j] iff bin <= j
        assert np.array_equal(bins <= j, ratio <= zj)
    with pytest.raises(ValueError):
        C.ratio_bins(ratio, [0.9, 0.5])


def test_ratio_bin_reproduces_pooled_coverage(data):
    examples, steps, cells, n_excluded = data
    st = c1_steps(examples, steps)
    certified, excluded = coverage.certified_cells(st)
    assert n_excluded == excluded == 3 and cells.attrs["excluded_cells"] == 3
    assert int(cells["n_cells"].sum()) == len(certified)
    ratio = coverage.standardized_error(certified)
    for j, level in enumerate(coverage.DEFAULT_LEVELS):
        covered = int(cells.loc[cells["ratio_bin"] <= j, "n_cells"].sum())
        assert covered == int((ratio <= coverage.z_value(level)).sum())
        pooled = coverage.pooled_coverage(st, level, n_boot=50, seed=1)
        assert covered / int(cells["n_cells"].sum()) == pooled["coverage"]
    # the planted cells: ratio == z95 is covered at 0.95, not at 0.90; 0/0 everywhere; x/0 nowhere
    assert (ratio == coverage.z_value(0.95)).sum() >= 1 and np.isinf(ratio).sum() >= 1


def test_regime_bins_reproduce_coverage_by_regime(data):
    examples, steps, cells, _ = data
    st = c1_steps(examples, steps)
    table = coverage.coverage_by_regime(st, 0.95, n_boot=20, seed=0)
    j95 = coverage.DEFAULT_LEVELS.index(0.95)
    for regime, col, edges in (
        ("tail_mass", "tail_bin", coverage.TAIL_MASS_BINS),
        ("p_max", "pmax_bin", coverage.P_MAX_BINS),
    ):
        ref = table[table["regime"] == regime].reset_index(drop=True)
        got = cells[cells[col] >= 0].groupby(col)
        n = got["n_cells"].sum()
        cov = cells[(cells[col] >= 0) & (cells["ratio_bin"] <= j95)].groupby(col)["n_cells"].sum().reindex(n.index)
        assert n.tolist() == ref["n_cells"].tolist()
        assert (cov / n).tolist() == ref["coverage"].tolist()
        assert [edges[k + 1] for k in n.index] == ref["bin_hi"].tolist()
    assert (cells["tail_bin"] == -1).any()


def test_counts_match_numpy(data):
    examples, steps, cells, _ = data
    certified, _ = coverage.certified_cells(c1_steps(examples, steps))
    err = certified["error"].to_numpy(np.float64)
    var = certified["variance"].to_numpy(np.float64)
    tight = certified["radius95_tight"].to_numpy(np.float64)
    layer = certified["layer"].to_numpy()
    m = multipliers()
    z = coverage.z_value(0.95)
    sd = np.sqrt(var)
    with np.errstate(divide="ignore", invalid="ignore"):
        g_ratio = np.where(sd > 0, err / (z * sd), np.where(err <= 0, 0.0, np.inf))
        t_ratio = np.where(
            tight > 0, err / tight, np.where(np.isfinite(tight), np.where(err <= 0, 0.0, np.inf), np.nan)
        )
    expected = {
        "n_cells": len(err),
        "tight_defined": int(np.isfinite(tight).sum()),
        "tight95": int((err <= tight).sum()),
        "conformal_tight": int((t_ratio <= m["multiplier_tight"].to_numpy()[layer]).sum()),
        "conformal_gauss": int((g_ratio <= m["multiplier_gaussian"].to_numpy()[layer]).sum()),
        "floor95": int((err <= z * sd + 0.003).sum()),
    }
    assert {k: int(cells[k].sum()) for k in expected} == expected
    trusted = certified["certificate_trusted"].fillna(False).astype(bool).to_numpy()
    assert int(cells.loc[cells["trusted"], "n_cells"].sum()) == int(trusted.sum())
    # per layer too
    for lay in range(3):
        here = layer == lay
        assert int(cells.loc[cells["layer"] == lay, "tight95"].sum()) == int((err[here] <= tight[here]).sum())


def test_table_shape_and_dtypes(data):
    _, _, cells, _ = data
    assert list(cells.columns) == C.CELL_KEYS + C.COUNT_COLUMNS
    assert cells["layer"].dtype == np.int16
    assert all(cells[c].dtype == np.int8 for c in ("tail_bin", "pmax_bin", "ratio_bin"))
    assert cells["trusted"].dtype == bool
    assert all(cells[c].dtype == np.int64 for c in C.COUNT_COLUMNS)
    assert all(isinstance(cells[c].dtype, pd.CategoricalDtype) for c in ("run", "example_id", "variant"))
    keys = cells[C.CELL_KEYS].astype({k: str for k in ("run", "example_id", "variant")})
    assert keys.equals(keys.sort_values(C.CELL_KEYS).reset_index(drop=True))
    assert not cells.duplicated(C.CELL_KEYS).any()


def test_no_multipliers_and_missing_layer():
    examples, steps = synthetic(n_examples=2)
    cells, _ = C.coverage_cells(examples, steps, rows=C1_ROWS, multipliers=None, numerical_floor=0.0)
    assert cells["conformal_tight"].sum() == 0 and cells["conformal_gauss"].sum() == 0
    assert cells.attrs["multipliers"] is False
    with pytest.raises(ValueError, match="layer"):
        C.coverage_cells(examples, steps, rows=C1_ROWS, multipliers=multipliers(2), numerical_floor=0.0)


def test_numerical_floor(data):
    examples, steps, _, _ = data
    full = steps[steps["variant"] == "full"]["error"].to_numpy()
    assert C.numerical_floor_from_steps(examples, steps) == float(np.quantile(full, 0.999))
    assert C.numerical_floor_from_steps(examples, steps, 0.5) == float(np.quantile(full, 0.5))


def test_fit_layer_multipliers(data):
    examples, steps, _, _ = data
    fitted = C.fit_layer_multipliers(examples, steps, C1_ROWS)
    assert list(fitted.columns) == C.MULTIPLIER_COLUMNS
    certified, _ = coverage.certified_cells(c1_steps(examples, steps))
    z = coverage.z_value(0.95)
    for _, row in fitted.iterrows():
        here = certified[certified["layer"] == row["layer"]]
        g = coverage.standardized_error(here) / z
        t = C.radius_ratio(here["error"].to_numpy(), here["radius95_tight"].to_numpy())
        assert row["n_cells"] == len(here)
        assert row["multiplier_gaussian"] == coverage.conformal_quantile(g, 0.95)
        assert row["multiplier_tight"] == coverage.conformal_quantile(t[~np.isnan(t)], 0.95)
    # in sample, every layer covers at >= 0.95 with its own multiplier
    cells, _ = C.coverage_cells(examples, steps, rows=C1_ROWS, multipliers=fitted, numerical_floor=0.0)
    per_layer = cells.groupby("layer")[["conformal_gauss", "conformal_tight", "n_cells", "tight_defined"]].sum()
    assert (per_layer["conformal_gauss"] / per_layer["n_cells"] >= 0.95).all()
    assert (per_layer["conformal_tight"] / per_layer["tight_defined"] >= 0.95).all()


def test_cli_fit(tmp_path, data):
    examples, steps, _, _ = data
    run = tmp_path / "run"
    run.mkdir()
    examples.to_parquet(run / "examples.parquet", index=False)
    steps.astype({"certificate_trusted": "boolean"}).to_parquet(run / "steps.parquet", index=False)
    predictions = tmp_path / "predictions.yaml"
    predictions.write_text(
        "claims:\n  C1:\n    rows: {tail_fraction: 0.75, floor: 0.2, score_power: 1.0, design: randomized,"
        " scorer: window_question, budget: [0.25, 0.5]}\n"
    )
    out = tmp_path / "m.csv"
    assert C.main(["fit", str(out), str(run), "--predictions", str(predictions)]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(out), C.fit_layer_multipliers(examples, steps, C1_ROWS))
    table = tmp_path / "cells.parquet"
    assert C.main(["table", str(table), str(run), "--predictions", str(predictions), "--multipliers", str(out)]) == 0
    assert int(pd.read_parquet(table)["n_cells"].sum()) == len(coverage.certified_cells(c1_steps(examples, steps))[0])
