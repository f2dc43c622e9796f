"""Published records: what a fresh clone needs to recompute a study's scorecard without the model or the raw steps.

A study's raw step records (one row per example, variant, decode step, layer and head: 10.9 M rows, 330 MB for
study 1) stay git-ignored. What is committed under `results/<study>/published/`:

- `examples.parquet`: the examples table as the runner wrote it (every variant; C2-C7 read only this);
- `cells.parquet`: kvcert.studies.cells.coverage_cells over the C1 rows: cell counts per (example, variant, layer,
  tail-mass bin, p_max bin, standardized-error bin, trusted), with the counts of every secondary radius;
- `exceedances.parquet`: the C1 cells whose standardized error error / sqrt(V_hat) exceeds z(0.95), with their
  error and variance as recorded (float32 in step records): the split-conformal quantile of C1 lives there;
- `meta.json`: the run folder, the numerical floor, the levels and bins used.

`synthetic_steps` turns cells + exceedances back into step rows on which the locked C1 analysis
(kvcert.analysis.claims, coverage) computes byte-identical numbers: a cell whose standardized error lies in
(z_{k-1}, z_k] becomes a row with variance 1 and error at the middle of that interval, which every comparison the
analysis makes (coverage at each calibration level, regime bins, example clusters) classifies as the real cell;
cells above z(0.95) are the real ones. The split-conformal quantile is exact when it lies above z(0.95), i.e. when
the Gaussian radius under-covers the calibration half (study 1: q = 2.70); otherwise `synthetic_steps` refuses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy, coverage
from kvcert.shards import atomic_parquet, atomic_text

CELL_KEYS = ["run", "example_id", "variant", "layer", "tail_bin", "pmax_bin", "ratio_bin", "trusted"]
EXCEEDANCE_LEVEL = 0.95


def _bin_index(values: pd.Series, edges: Sequence[float]) -> np.ndarray:
    """The interval index pd.cut(include_lowest=True) gives each value (as coverage_by_regime bins), -1 for NaN."""
    codes = pd.cut(values.astype(np.float64), bins=list(edges), include_lowest=True).cat.codes
    return codes.to_numpy().astype(np.int8)


def as_strings(column: pd.Series, rows: np.ndarray | None = None) -> pd.api.extensions.ExtensionArray | np.ndarray:
    """column.astype(str) at positions `rows` (all rows by default), in the dtype a DataFrame gives those strings.
    A categorical column (published cells keep categorical keys) goes through its categories: the same strings
    without converting every row on its own, which took seconds per column on study 2's 2.6 M synthetic rows."""
    rows = np.arange(len(column)) if rows is None else rows
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes = column.cat.codes.to_numpy()
        if (codes >= 0).all():
            categories = np.asarray(column.cat.categories.astype(str), dtype=object)
            return pd.array(categories, dtype=pd.Series(categories).dtype).take(codes[rows])
    return column.astype(str).to_numpy()[rows]


def _representative(edges: Sequence[float], index: int) -> float:
    """A value that pd.cut(include_lowest=True) puts in interval `index` (NaN for -1)."""
    if index < 0:
        return float("nan")
    return (float(edges[index]) + float(edges[index + 1])) / 2


def c1_cells(examples: pd.DataFrame, steps: pd.DataFrame, rows: dict) -> pd.DataFrame:
    """The C1 step rows (the rows selection of predictions.yaml, certificate variants), as the locked C1 analysis
    selects them, before excluding non-finite cells."""
    ex = accuracy.select_rows(examples, rows)
    ex = ex[ex["has_certificate"].astype(bool)]
    return coverage.steps_for(ex, steps)


def exceedances(
    steps: pd.DataFrame,
    *,
    level: float = EXCEEDANCE_LEVEL,
    tail_mass_bins: Sequence[float] = coverage.TAIL_MASS_BINS,
    p_max_bins: Sequence[float] = coverage.P_MAX_BINS,
) -> pd.DataFrame:
    """Certified cells with error / sqrt(V_hat) > z(level): keys, regime bins, error and variance as recorded.
    Non-finite cells (excluded by the analysis) are kept too, with a NaN error or variance, so that the exclusion
    counts per group replay."""
    ratio = coverage.standardized_error(steps)
    err = steps["error"].to_numpy(np.float64)
    var = steps["variance"].to_numpy(np.float64)
    finite = np.isfinite(err) & np.isfinite(var) & (var >= 0)
    keep = ~finite | (ratio > coverage.z_value(level))
    sel = steps.loc[keep]
    return pd.DataFrame(
        {
            "run": sel["run"].astype(str).to_numpy(),
            "example_id": sel["example_id"].astype(str).to_numpy(),
            "variant": sel["variant"].astype(str).to_numpy(),
            "layer": sel["layer"].to_numpy().astype(np.int16),
            "tail_bin": _bin_index(sel["tail_mass"], tail_mass_bins),
            "pmax_bin": _bin_index(sel["p_max"], p_max_bins),
            "error": sel["error"].to_numpy(),  # the recorded dtype (float32 in step records): exact on replay
            "variance": sel["variance"].to_numpy(),
        }
    ).reset_index(drop=True)


def synthetic_steps(
    cells: pd.DataFrame,
    exceed: pd.DataFrame,
    *,
    levels: Sequence[float] = coverage.DEFAULT_LEVELS,
    tail_mass_bins: Sequence[float] = coverage.TAIL_MASS_BINS,
    p_max_bins: Sequence[float] = coverage.P_MAX_BINS,
    level: float = EXCEEDANCE_LEVEL,
) -> pd.DataFrame:
    """Step rows (run, example_id, variant, layer, error, variance, tail_mass, p_max) equivalent, for the locked C1
    analysis, to the raw rows that produced `cells` and `exceed` (module docstring)."""
    z = [coverage.z_value(lv) for lv in levels]
    if level not in levels:
        raise ValueError(f"the exceedance level {level} must be one of the calibration levels {list(levels)}")
    first_exceeding = list(levels).index(level) + 1  # ratio_bin >= this: ratio > z(level), taken from `exceed`
    below = cells[cells["ratio_bin"] < first_exceeding]
    n = below["n_cells"].to_numpy().astype(np.int64)
    mids = np.array([0.0] + [(z[k - 1] + z[k]) / 2 for k in range(1, len(z))])
    take = np.repeat(np.arange(len(below)), n)  # row of `below` behind each synthetic row

    def col(name: str) -> np.ndarray:
        return below[name].to_numpy()[take]

    tail_rep = np.array([_representative(tail_mass_bins, i) for i in range(-1, len(tail_mass_bins) - 1)])
    pmax_rep = np.array([_representative(p_max_bins, i) for i in range(-1, len(p_max_bins) - 1)])
    synthetic = pd.DataFrame(
        {
            "run": as_strings(below["run"], take),
            "example_id": as_strings(below["example_id"], take),
            "variant": as_strings(below["variant"], take),
            "layer": col("layer").astype(np.int16),
            "error": mids[col("ratio_bin").astype(np.int64)],
            "variance": np.ones(len(take)),
            "tail_mass": tail_rep[col("tail_bin").astype(np.int64) + 1],
            "p_max": pmax_rep[col("pmax_bin").astype(np.int64) + 1],
        }
    )
    real = pd.DataFrame(
        {
            "run": as_strings(exceed["run"]),
            "example_id": as_strings(exceed["example_id"]),
            "variant": as_strings(exceed["variant"]),
            "layer": exceed["layer"].to_numpy().astype(np.int16),
            "error": exceed["error"].to_numpy(np.float64),
            "variance": exceed["variance"].to_numpy(np.float64),
            "tail_mass": tail_rep[exceed["tail_bin"].to_numpy().astype(np.int64) + 1],
            "p_max": pmax_rep[exceed["pmax_bin"].to_numpy().astype(np.int64) + 1],
        }
    )
    expected = int(cells.loc[cells["ratio_bin"] >= first_exceeding, "n_cells"].sum())
    finite = np.isfinite(real["error"]) & np.isfinite(real["variance"]) & (real["variance"] >= 0)
    if int(finite.sum()) != expected:
        raise ValueError(
            f"published records disagree: {int(finite.sum())} exceedances but the cells count {expected} cells above "
            f"z({level}); regenerate results/<study>/published with `python -m kvcert.reproduce publish`"
        )
    return pd.concat([synthetic, real], ignore_index=True)


def check_conformal_exact(steps: pd.DataFrame, split_seed: int, level: float = EXCEEDANCE_LEVEL) -> None:
    """Refuse when the split-conformal quantile on the calibration half would fall at or below z(level): it is then
    a representative value, not a recorded one."""
    cells, _ = coverage.certified_cells(steps)
    cal, _ = coverage.split_examples(cells["example_id"].to_numpy(), split_seed)
    in_cal = cells["example_id"].isin(cal).to_numpy()
    q = coverage.conformal_quantile(coverage.standardized_error(cells)[in_cal], level)
    if not q > coverage.z_value(level):
        raise ValueError(
            f"the split-conformal quantile ({q:.4f}) is not above z({level}): the published cells cannot replay it "
            "exactly; analyze from the raw step records (results/runs) instead"
        )


# ------------------------------------------------------------------------------------------------------ files
def write_published(
    out_dir: Path,
    *,
    examples: pd.DataFrame,
    cells: pd.DataFrame,
    exceed: pd.DataFrame,
    meta: dict,
) -> dict[str, Path]:
    """Write the four published files atomically (each replaced whole; a failure leaves the old ones)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.parquet" for name in ("examples", "cells", "exceedances")}
    atomic_parquet(examples.reset_index(drop=True), paths["examples"])
    atomic_parquet(cells.reset_index(drop=True), paths["cells"])
    atomic_parquet(exceed.reset_index(drop=True), paths["exceedances"])
    paths["meta"] = out / "meta.json"
    atomic_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", paths["meta"])
    return paths


def load_published(out_dir: Path) -> dict:
    """{"examples", "cells", "exceedances": DataFrame, "meta": dict}; one clear error when a file is missing."""
    out = Path(out_dir)
    missing = [
        f for f in ("examples.parquet", "cells.parquet", "exceedances.parquet", "meta.json") if not (out / f).exists()
    ]
    if missing:
        raise FileNotFoundError(
            f"published records incomplete in {out} (missing {', '.join(missing)}); run `make reproduce` to regenerate"
        )
    return {
        "examples": pd.read_parquet(out / "examples.parquet"),
        "cells": pd.read_parquet(out / "cells.parquet"),
        "exceedances": pd.read_parquet(out / "exceedances.parquet"),
        "meta": json.loads((out / "meta.json").read_text()),
    }
