"""`publish` -> `analyze` end to end (kvcert.reproduce) on a small raw run: the golden fixture's runner records
(tests/fixtures/golden/runs: 30 examples x 21 variants, step rows of 4 layers x 3 heads), copied where study 1's C1
experiment looks for them, published to files, analysed from those files only. The claims that come out are
checked against numbers computed here by hand from the RAW examples and steps (not from the published cells).

The study's paths point into a temporary folder (and `reproduce.ROOT` with them, see the xfail test below); the
lock status is pinned as in tests/test_golden.py; n_boot is lowered to 100 in a copy of predictions.yaml (bootstrap
intervals only: point estimates and cell counts do not depend on it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import kvcert.prereg
import kvcert.reproduce as rep
from kvcert.analysis.claims import evaluate_claim, load_predictions
from kvcert.config import result_name

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "fixtures" / "golden"
RAW = next((GOLDEN / "runs").iterdir())
Z95 = 1.959963984540054


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reproduce")
    text = rep.PREDICTIONS.read_text()
    assert text.count("n_boot: 2000") == 1  # the common block every claim merges
    predictions = tmp / "predictions.yaml"
    predictions.write_text(text.replace("n_boot: 2000", "n_boot: 100"))
    entry = {
        **rep.STUDIES["study1"],
        "predictions": predictions,
        "out": tmp / "out",
        "published": tmp / "out" / "published",
        "scorecard": tmp / "out" / "study1",
        "overrides": [*rep.STUDIES["study1"]["overrides"], f"results_dir={tmp / 'runs'}"],
    }
    lock = json.loads((GOLDEN / "lock_status.json").read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rep.STUDIES, "study1", entry)
        mp.setattr(rep, "ROOT", tmp)  # the published meta names the run relative to the root (see the xfail)
        mp.setattr(kvcert.prereg, "verify", lambda root, study="study1": lock)
        st = rep.settings("study1")
        c1 = rep._c1_entry(rep.registry(st["predictions"], st["claims"]))
        cfg = rep.compose_claim(c1.experiment, st["overrides"])
        run_dir = Path(cfg.results_dir) / result_name(cfg)
        run_dir.mkdir(parents=True)
        for name in ("examples.parquet", "steps.parquet"):
            shutil.copy(RAW / name, run_dir / name)
        published = rep.publish(study="study1")
        card = rep.analyze(study="study1")
        yield {
            "tmp": tmp,
            "entry": entry,
            "run_dir": run_dir,
            "published": published,
            "card": card,
            "tables": tmp / "out" / "tables",
            "predictions": load_predictions(predictions),
            "c1_rows": dict(c1.spec["rows"]),
        }


def _raw():
    return pd.read_parquet(RAW / "examples.parquet"), pd.read_parquet(RAW / "steps.parquet")


def _c1_raw_cells(c1_rows: dict) -> pd.DataFrame:
    """The C1 step rows by hand: the example rows matching every filter of the spec, certified, their steps."""
    examples, steps = _raw()
    mask = np.ones(len(examples), dtype=bool)
    for column, value in c1_rows.items():
        values = value if isinstance(value, list) else [value]
        mask &= examples[column].isin(values).to_numpy()
    rows = examples[mask & examples["has_certificate"].astype(bool).to_numpy()]
    assert set(rows["budget"]) == {0.25, 0.5} and set(rows["design"]) == {"randomized"}
    keys = set(zip(rows["run"], rows["example_id"], rows["variant"]))
    on = [k in keys for k in zip(steps["run"], steps["example_id"], steps["variant"])]
    return steps[np.array(on, dtype=bool)]


def test_published_files_hold_exactly_the_raw_c1_cells(pipeline):
    pub = pipeline["published"]
    assert sorted(p.name for p in pub.iterdir()) == [
        "cells.parquet",
        "examples.parquet",
        "exceedances.parquet",
        "meta.json",
    ]
    cells_raw = _c1_raw_cells(pipeline["c1_rows"])
    err = cells_raw["error"].to_numpy(np.float64)
    var = cells_raw["variance"].to_numpy(np.float64)
    finite = np.isfinite(err) & np.isfinite(var) & (var >= 0)
    cells = pd.read_parquet(pub / "cells.parquet")
    exceed = pd.read_parquet(pub / "exceedances.parquet")
    meta = json.loads((pub / "meta.json").read_text())
    assert int(cells["n_cells"].sum()) == meta["n_c1_cells"] == int(finite.sum()) > 0
    assert meta["excluded_cells"] == int((~finite).sum())
    above = finite & (err > Z95 * np.sqrt(var))
    ex_err, ex_var = exceed["error"].to_numpy(np.float64), exceed["variance"].to_numpy(np.float64)
    ex_finite = np.isfinite(ex_err) & np.isfinite(ex_var) & (ex_var >= 0)
    assert meta["n_exceedances"] == len(exceed) == int(above.sum()) + int((~finite).sum())
    assert sorted(ex_err[ex_finite]) == sorted(err[above]) and int(above.sum()) > 0
    examples, _ = _raw()
    pd.testing.assert_frame_equal(pd.read_parquet(pub / "examples.parquet"), examples)  # unchanged
    # the full-cache error quantile (S4's numerical floor) from the raw full-cache steps
    _, steps = _raw()
    full_err = steps.loc[steps["variant"] == "full", "error"].to_numpy(np.float64)
    assert meta["numerical_floor"] == pytest.approx(float(np.quantile(full_err[np.isfinite(full_err)], 0.999)))


def test_c1_coverage_from_published_cells_equals_the_raw_steps(pipeline):
    """The pooled 95% coverage that analyze reports from the published files is the share of raw C1 cells with
    ||o_hat - o|| <= 1.96 sqrt(V_hat), computed here from the raw step rows."""
    c1 = json.loads((pipeline["tables"] / "claim_c1.json").read_text())
    cells_raw = _c1_raw_cells(pipeline["c1_rows"])
    err = cells_raw["error"].to_numpy(np.float64)
    var = cells_raw["variance"].to_numpy(np.float64)
    finite = np.isfinite(err) & np.isfinite(var) & (var >= 0)
    covered = err[finite] <= Z95 * np.sqrt(var[finite])
    by_hand = float(covered.mean())
    assert c1["primary_metric"] == "coverage"
    assert c1["observed"] == pytest.approx(by_hand, rel=1e-9)
    assert 0.5 < by_hand < 1.0  # neither vacuous nor empty: a wrong cell selection would move it
    assert c1["ci"][0] <= c1["observed"] <= c1["ci"][1]
    # per budget as well (the published cells keep the variant, hence the budget)
    examples, _ = _raw()
    budget_of = dict(zip(examples["variant"], examples["budget"]))
    budgets = cells_raw["variant"].map(budget_of).to_numpy()[finite]
    for b in (0.25, 0.5):
        assert 0 < (budgets == b).sum() < len(budgets)
    card_c1 = next(c for c in pipeline["card"]["claims"] if c["id"] == "C1")
    assert card_c1["observed"] == pytest.approx(by_hand, rel=1e-9)


def test_every_claim_from_published_files_equals_the_raw_analysis(pipeline):
    """analyze (published files) and evaluate_claim on the raw records agree on every claim's point estimate and
    verdict inputs; C1 through the synthetic step rows, C2-C7 through the unchanged examples."""
    examples, steps = _raw()
    seen = []
    for cid, spec in pipeline["predictions"].items():
        if spec.get("analysis") == "t1":
            continue
        published = json.loads((pipeline["tables"] / f"claim_{cid.lower()}.json").read_text())
        raw = evaluate_claim(cid, examples, steps if spec["analysis"] == "coverage" else None, spec).as_dict()
        assert published["observed"] == pytest.approx(raw["observed"], rel=1e-9, nan_ok=True), cid
        assert published["verdict"] == raw["verdict"], cid
        seen.append(cid)
    assert seen == ["C1", "C2", "C3", "C4", "C5", "C6", "C7"]
    scorecard = json.loads((pipeline["entry"]["scorecard"] / "scorecard.json").read_text())
    assert [c["id"] for c in scorecard["claims"]][:7] == seen
    assert pipeline["card"]["n_examples"] == examples["example_id"].nunique() == 30


def test_publish_accepts_a_results_dir_outside_the_repository(pipeline, monkeypatch):
    monkeypatch.setattr(rep, "ROOT", REPO)  # the real root: the temporary results_dir is outside it
    monkeypatch.setitem(rep.STUDIES, "study1", pipeline["entry"])
    out = rep.publish(study="study1")
    meta = json.loads((out / "meta.json").read_text())
    assert Path(meta["run"]).is_absolute() and Path(meta["run"]).is_dir()  # named as given, outside the repository
