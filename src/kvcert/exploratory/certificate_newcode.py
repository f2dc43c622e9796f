"""EXPLORATORY: the certificate's candidate radii on real records that carry tr(C^2) (this version's decode).

    python -m kvcert.run +claim=c1_coverage task.n_examples=3 name=c1-subset-newcode \\
        results_dir=results/exploratory/runs threads=1
    python -m kvcert.exploratory.certificate_newcode results/exploratory/runs/c1-subset-newcode

The C1 rows (window_question, randomized, budgets 0.25 / 0.5) of a 30-example rerun of study 1's confirmatory cell
(seed 0: the first 3 examples per task and length), not a pre-registered analysis: coverage at 0.95 (pooled, worst
layer, worst tail-mass bin), tightness (median radius / error), on all and on `certificate_trusted` cells, the
split-conformal multiplier (pooled and per layer, fitted on half the examples, checked on the other half), and the
two-radius calibration figure over levels 0.5-0.99.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.exploratory.certificate import calibration_curve, plot_calibration
from kvcert.exploratory.certificate_records import _md

RADII = {"conservative": "radius95", "tight": "radius95_tight"}
TAIL_MASS_EDGES = [0, 1e-3, 1e-2, 0.1, 1.01]


def c1_cells(examples: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    meta = examples.drop_duplicates("variant").set_index("variant")[["scorer", "design", "budget"]]
    s = steps.join(meta, on="variant")
    keep = (s.scorer == "window_question") & (s.design == "randomized") & s.budget.isin([0.25, 0.5])
    return s[keep & np.isfinite(s.variance)].reset_index(drop=True)


def summary(cells: pd.DataFrame) -> pd.DataFrame:
    """Per radius: coverage at 0.95 pooled / worst layer / worst tail-mass bin and median radius / error."""
    rows = []
    bins = pd.cut(cells.tail_mass, TAIL_MASS_EDGES, right=False)
    for subset, df, b in (
        ("all cells", cells, bins),
        ("trusted cells", cells[cells.certificate_trusted], bins[cells.certificate_trusted]),
    ):
        for name, col in RADII.items():
            covered = df.error <= df[col]
            rows.append(
                {
                    "cells": subset,
                    "radius": name,
                    "n": len(df),
                    "coverage": covered.mean(),
                    "worst_layer": covered.groupby(df.layer).mean().min(),
                    "worst_tail_mass_bin": covered.groupby(b, observed=True).mean().min(),
                    "median_r_over_err": float((df[col] / df.error).median()),
                }
            )
    return pd.DataFrame(rows)


def conformal(cells: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Split-conformal multipliers (95% quantile of error / radius) fitted on half the examples, per radius, pooled
    and per layer, with held-out coverage (both halves in turn): pooled, worst layer, worst tail-mass bin."""
    ids = np.array(sorted(cells.example_id.unique()))
    np.random.default_rng(seed).shuffle(ids)
    halves = [set(ids[: len(ids) // 2]), set(ids[len(ids) // 2 :])]
    rows = []
    for k, fit_ids in enumerate(halves):
        fit, test = cells[cells.example_id.isin(fit_ids)], cells[~cells.example_id.isin(fit_ids)]
        test_bins = pd.cut(test.tail_mass, TAIL_MASS_EDGES, right=False)
        for name, col in RADII.items():
            pooled = float(np.quantile(fit.error / fit[col], 0.95))
            per_layer = (fit.error / fit[col]).groupby(fit.layer).quantile(0.95)
            for how, m in (("pooled", pooled), ("per layer", test.layer.map(per_layer))):
                covered = test.error <= m * test[col]
                rows.append(
                    {
                        "fit_half": k,
                        "radius": name,
                        "multiplier": how,
                        "value": pooled if how == "pooled" else float(per_layer.median()),
                        "heldout_coverage": covered.mean(),
                        "heldout_worst_layer": covered.groupby(test.layer).mean().min(),
                        "heldout_worst_tail_mass_bin": covered.groupby(test_bins, observed=True).mean().min(),
                        "median_r_over_err": float((m * test[col] / test.error).median()),
                    }
                )
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", default="results/exploratory")
    ap.add_argument("--tag", default="newcode", help="file-name tag: certificate_<tag>*.{md,csv,png}")
    ap.add_argument("--title", default="C1 cells of a 30-example rerun with tr(C^2) (this version)")
    args = ap.parse_args(argv)
    run, out, tag = Path(args.run_dir), Path(args.out), args.tag
    out.mkdir(parents=True, exist_ok=True)
    columns = [
        "run", "example_id", "variant", "layer", "error", "variance", "radius95", "radius95_tight", "trace_c2",
        "tail_mass",
        "certificate_trusted",
    ]  # fmt: skip
    examples = pd.read_parquet(run / "examples.parquet")
    wanted = examples.loc[(examples.scorer == "window_question") & (examples.design == "randomized"), "variant"]
    steps = pd.read_parquet(run / "steps.parquet", columns=columns, filters=[("variant", "in", sorted(set(wanted)))])
    cells = c1_cells(examples, steps)
    table, conf = summary(cells), conformal(cells)
    curve = calibration_curve(cells, names=("conservative", "tight"))
    plot_calibration(
        curve,
        out / f"certificate_calibration_{tag}.png",
        f"EXPLORATORY: {args.title}",
    )
    table.to_csv(out / f"certificate_{tag}_summary.csv", index=False)
    conf.to_csv(out / f"certificate_{tag}_conformal.csv", index=False)
    curve.to_csv(out / f"certificate_{tag}_calibration.csv", index=False)
    text = (
        f"# EXPLORATORY: candidate radii on real records with tr(C^2)\n\nSource: `{run}` ({cells.example_id.nunique()}"
        f" examples, {len(cells)} C1 cells; not pre-registered). Generated by "
        "`python -m kvcert.exploratory.certificate_newcode`.\n\n## Coverage at 0.95 and tightness\n\n"
        f"{_md(table)}\n\nShare of trusted cells: "
        f"{cells.certificate_trusted.mean():.3f}.\n\n## Split-conformal multipliers (held out over examples)\n\n"
        f"{_md(conf)}\n\n![calibration](certificate_calibration_{tag}.png)\n"
    )
    (out / f"certificate_{tag}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
