"""kvcert.studies.published: published records replay the locked C1 analysis byte for byte."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcert.analysis.claims import evaluate_claim, load_predictions
from kvcert.analysis.scorecard import jsonable
from kvcert.reproduce import PREDICTIONS
from kvcert.studies import published
from kvcert.studies.cells import coverage_cells
from test_studies_cells import C1_ROWS, synthetic


def records(**kw):
    examples, steps = synthetic(**kw)
    return examples, steps.astype({"error": np.float32, "variance": np.float32})  # as the step records store them


def _publish(examples, steps):
    cells, _ = coverage_cells(examples, steps, rows=C1_ROWS, multipliers=None, numerical_floor=0.0)
    exceed = published.exceedances(published.c1_cells(examples, steps, C1_ROWS))
    return cells, exceed


@pytest.fixture(scope="module")
def c1_spec():
    spec = dict(load_predictions(PREDICTIONS)["C1"])
    spec["rows"] = C1_ROWS
    spec["n_boot"] = 200
    return spec


@pytest.mark.parametrize("seed", [0, 1])
def test_replayed_cells_give_the_locked_c1_result_byte_for_byte(c1_spec, seed):
    examples, steps = records(n_examples=8, seed=seed)
    cells, exceed = _publish(examples, steps)
    replay = published.synthetic_steps(cells, exceed)
    raw = evaluate_claim("C1", examples, steps, c1_spec).as_dict()
    again = evaluate_claim("C1", examples, replay, c1_spec).as_dict()
    assert json.dumps(jsonable(again)) == json.dumps(jsonable(raw))
    assert raw["details"]["pooled"]["n_excluded_cells"] > 0  # the planted non-finite cells are excluded in both
    assert raw["details"]["conformal"]["q"] > 1.96  # the quantile is a recorded cell, kept exactly


def test_only_cells_above_z95_are_stored_exactly(c1_spec):
    examples, steps = records(n_examples=4)
    cells, exceed = _publish(examples, steps)
    finite = np.isfinite(exceed["error"]) & np.isfinite(exceed["variance"]) & (exceed["variance"] >= 0)
    ratio = exceed["error"][finite].to_numpy(np.float64) / np.sqrt(exceed["variance"][finite].to_numpy(np.float64))
    assert np.all(ratio > 1.959963984540054)
    assert int(finite.sum()) == int(cells.loc[cells["ratio_bin"] >= 7, "n_cells"].sum())
    with pytest.raises(ValueError, match="published records disagree"):
        published.synthetic_steps(cells, exceed.iloc[1:])


def test_a_conformal_quantile_below_z95_is_refused(c1_spec):
    examples, steps = records(n_examples=6)
    steps["error"] = steps["error"] * 0.2  # the Gaussian radius now over-covers: q < z(0.95) is not recorded
    cells, exceed = _publish(examples, steps)
    replay = published.synthetic_steps(cells, exceed)
    with pytest.raises(ValueError, match="not above z"):
        published.check_conformal_exact(replay, int(c1_spec["conformal_seed"]))


def test_write_and_load_round_trip(tmp_path):
    examples, steps = records(n_examples=3)
    cells, exceed = _publish(examples, steps)
    published.write_published(tmp_path / "pub", examples=examples, cells=cells, exceed=exceed, meta={"run": "r"})
    back = published.load_published(tmp_path / "pub")
    assert back["meta"] == {"run": "r"} and len(back["cells"]) == len(cells)
    assert back["exceedances"]["error"].dtype == np.float32  # the records' dtype, kept
    (tmp_path / "pub" / "cells.parquet").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing cells\.parquet"):
        published.load_published(tmp_path / "pub")
