"""EXPLORATORY, before study 3's lock: why does the certificate cover less on Gemma 3's full-attention layers?

    python -m kvcert.exploratory.gemma_coverage [--out results/exploratory/gemma_coverage]

Reads study 3's pilot records (kvcert.studies.pilot3, seeds 3000; both models, every level) and compares the two
models on C1's cells (window_question randomized, tail fraction 0.75, budgets 0.25 and 0.5): coverage of
1.96 sqrt(V_hat) per layer, by tail mass, by p_max and by the tail's effective sample size; the share of cells whose
error sits at the decode path's numerical floor (the full-cache variant's 99.9% error quantile, S4's tolerance) and
the coverage with that tolerance added; error / sqrt(V_hat) quantiles; and, per layer, the relative size of error
and radius (error / ||o||). Not pre-registered and not part of any scorecard: it informs PLAN.md section 8.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy

C1_ROWS = {"scorer": "window_question", "design": "randomized", "budget": [0.25, 0.5], "tail_fraction": 0.75}
COLUMNS = ["example_id", "variant", "step", "layer", "head", "error", "variance", "out_norm", "tail_mass", "p_max"]
EXTRA = ["ess_tail", "n_tail", "radius95_tight", "certificate_trusted"]
Z95 = 1.959963984540054


def load(run_dirs: Sequence[Path]) -> tuple[pd.DataFrame, float]:
    """The C1 cells of the runs (certified: finite error and variance) and the full-cache 99.9% error quantile."""
    import pyarrow.parquet as pq

    frames, full_errors = [], []
    for d in run_dirs:
        ex = pd.read_parquet(d / "examples.parquet")
        variants = sorted(accuracy.select_rows(ex, C1_ROWS)["variant"].astype(str).unique())
        names = set(pq.ParquetFile(d / "steps.parquet").schema_arrow.names)
        cols = [c for c in COLUMNS + EXTRA if c in names]
        st = pd.read_parquet(d / "steps.parquet", columns=cols, filters=[("variant", "in", [*variants, "full"])])
        full_errors.append(st.loc[st["variant"] == "full", "error"].to_numpy(np.float64))
        st = st[st["variant"] != "full"]
        frames.append(st[np.isfinite(st["error"]) & np.isfinite(st["variance"]) & (st["variance"] >= 0)])
    cells = pd.concat(frames, ignore_index=True)
    err = np.concatenate(full_errors)
    err = err[np.isfinite(err)]
    return cells, float(np.quantile(err, 0.999)) if err.size else float("nan")


def summarize(cells: pd.DataFrame, floor: float) -> dict[str, pd.DataFrame]:
    radius = Z95 * np.sqrt(cells["variance"].to_numpy(np.float64))
    error = cells["error"].to_numpy(np.float64)
    c = cells.assign(
        covered=error <= radius,
        covered_floor=error <= radius + floor,
        at_floor=error <= floor,
        ratio=np.where(radius > 0, error / np.maximum(radius, 1e-300), np.inf),
        rel_error=error / np.maximum(cells["out_norm"].to_numpy(np.float64), 1e-30),
        rel_radius=radius / np.maximum(cells["out_norm"].to_numpy(np.float64), 1e-30),
        tail_bin=pd.cut(cells["tail_mass"].astype(np.float64), [0, 1e-4, 1e-3, 1e-2, 0.1, 1.0], include_lowest=True),
        pmax_bin=pd.cut(cells["p_max"].astype(np.float64), [0, 0.1, 0.3, 0.6, 0.9, 1.0], include_lowest=True),
    )
    agg = {
        "cells": ("covered", "size"),
        "coverage": ("covered", "mean"),
        "coverage_with_floor": ("covered_floor", "mean"),
        "share_at_floor": ("at_floor", "mean"),
        "median_ratio": ("ratio", "median"),
        "q95_ratio": ("ratio", lambda x: float(np.quantile(x, 0.95))),
        "median_rel_error": ("rel_error", "median"),
        "median_rel_radius": ("rel_radius", "median"),
        "median_tail_mass": ("tail_mass", "median"),
        "median_p_max": ("p_max", "median"),
    }
    out = {
        "pooled": c.assign(all="all").groupby("all").agg(**agg).reset_index(),
        "by_layer": c.groupby("layer").agg(**agg).reset_index(),
        "by_tail_mass": c.groupby("tail_bin", observed=True).agg(**agg).reset_index(),
        "by_p_max": c.groupby("pmax_bin", observed=True).agg(**agg).reset_index(),
    }
    if "ess_tail" in c:
        ess = pd.cut(c["ess_tail"].astype(np.float64), [0, 2, 5, 10, 30, np.inf], include_lowest=True)
        out["by_ess_tail"] = c.assign(ess_bin=ess).groupby("ess_bin", observed=True).agg(**agg).reset_index()
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - run by hand on the pilot's records
    from kvcert.studies.pilot3 import markdown_table, run_dirs

    parser = argparse.ArgumentParser(
        prog="python -m kvcert.exploratory.gemma_coverage", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("results/exploratory/gemma_coverage"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["# EXPLORATORY: certificate coverage on the two models' pilot records (study 3, seeds 3000)", ""]
    by_model: dict[str, list[Path]] = {}
    for (model, _), d in sorted(run_dirs().items()):
        if (d / "steps.parquet").exists():
            by_model.setdefault(model, []).append(d)
    for model, dirs in by_model.items():
        cells, floor = load(dirs)
        tables = summarize(cells, floor)
        lines += [f"## {model} ({len(dirs)} pilot cells, numerical floor {floor:.3g})", ""]
        for name, table in tables.items():
            table.to_csv(args.out / f"{model}_{name}.csv", index=False)
            lines += [f"### {name}", "", markdown_table(table), ""]
    (args.out / "gemma_coverage.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
