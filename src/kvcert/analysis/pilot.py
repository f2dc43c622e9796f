"""The pilot summary (disjoint seeds, every candidate design setting as a variant) that chose the locked design
parameters: accuracy, certificate score, relative error and 95% coverage per variant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.scorecard import round_frame
from kvcert.analysis.tables import markdown_table


def pilot_summary(examples: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One row per variant: accuracy, full-cache accuracy, certificate score, relative error, n, coverage."""
    cert = steps[np.isfinite(steps.variance)]
    cov = (cert.error <= cert.radius95).groupby(cert.variant).mean().rename("coverage")
    g = (
        examples.groupby(["variant", "scorer", "design", "budget", "tail_fraction", "floor"])
        .agg(
            accuracy=("correct", "mean"),
            full_accuracy=("full_correct", "mean"),
            cert_score=("cert_score", "mean"),
            rel_error=("rel_error_mean", "mean"),
            n=("correct", "size"),
        )
        .reset_index()
    )
    return g.join(cov, on="variant")


def write_pilot_summary(table: pd.DataFrame, out: str | Path) -> dict[str, Path]:
    """out/summary.csv and out/summary.md (a Markdown table, kvcert.analysis.tables.markdown_table), floats rounded by
    round_frame."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "summary.csv", "md": out / "summary.md"}
    table = round_frame(table)  # floats to 10 significant digits: the same bytes on any CPU
    table.to_csv(paths["csv"], index=False)
    text = markdown_table(table, floatfmt=".3f")
    paths["md"].write_text(text + "\n")
    return paths
