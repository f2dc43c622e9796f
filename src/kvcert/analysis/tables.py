"""The descriptive tables beside the claims (CSV): accuracy vs budget, per-variant summary, coverage tables; the one
Markdown table renderer every report uses (markdown_table) and the rounding every written float goes through
(round_float, round_frame; kvcert.analysis.scorecard imports them from here, below it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.accuracy import accuracy_vs_budget
from kvcert.analysis.coverage import calibration_curve, coverage_table, steps_for

# Every float the analysis writes (JSON, CSV, Markdown, HTML) carries this many significant digits: the last bits of
# a sum depend on the CPU's summation order, and the written files must be byte-identical on any machine.
SIGNIFICANT_DIGITS = 10


def round_float(x: float) -> float:
    """x to SIGNIFICANT_DIGITS significant digits (24.361111111111107 and 24.36111111111111 -> 24.36111111);
    NaN and inf pass through."""
    return float(f"{float(x):.{SIGNIFICANT_DIGITS}g}")


def round_frame(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of df with every float column rounded by round_float (as float64), for the CSV and Markdown tables."""
    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_float_dtype(out[col].dtype):
            out[col] = np.array([round_float(v) for v in out[col].to_numpy(np.float64)], dtype=np.float64)
    return out


def markdown_table(df: pd.DataFrame, floatfmt: str = "g", *, parse_numbers: bool = True) -> str:
    """The Markdown table of every report: pandas' DataFrame.to_markdown (tabulate), a GitHub pipe table without the
    index, columns padded to their widest cell. Numbers are written with `floatfmt`; parse_numbers=False writes every
    cell as given (a caller that formats its own cells passes strings, which tabulate would otherwise read back as
    numbers and format again)."""
    return df.to_markdown(index=False, tablefmt="github", floatfmt=floatfmt, disable_numparse=not parse_numbers)


def write_tables(examples: pd.DataFrame, steps: pd.DataFrame | None, out: Path, n_boot: int) -> list[Path]:
    """The descriptive tables beside the claims (CSV), under out/tables/; returns the paths written."""
    tables = Path(out) / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    written = []

    def write(df: pd.DataFrame, name: str) -> None:  # floats rounded (round_frame): the same bytes on any CPU
        round_frame(df).to_csv(tables / name, index=False)
        written.append(tables / name)

    write(accuracy_vs_budget(examples, n_boot=n_boot), "accuracy_vs_budget.csv")
    summary = (
        examples.groupby(["scorer", "design", "budget"], dropna=False)
        .agg(
            n=("correct", "size"),
            accuracy=("correct", "mean"),
            kept_tokens=("kept_tokens", "mean"),
            cert_score=("cert_score", "mean"),
            rel_error=("rel_error_mean", "mean"),
            covered95=("covered95", "mean"),
            logprob=("logprob_mean", "mean"),
        )
        .reset_index()
    )
    write(summary, "variants.csv")
    if steps is not None and len(steps):
        s = steps_for(examples, steps)
        meta = examples.drop_duplicates("variant").set_index("variant")[["design", "scorer", "budget"]]
        s = s.join(meta, on="variant")
        cert = s[np.isfinite(s.variance)]
        for by in (["design", "scorer", "budget"], ["design", "layer"], ["design", "budget", "layer"]):
            name = "coverage_by_" + "_".join(by) + ".csv"
            write(coverage_table(cert, by=by, n_boot=min(n_boot, 200)), name)
        calib = [calibration_curve(g).assign(design=d) for d, g in cert.groupby("design")]
        if calib:
            write(pd.concat(calib), "calibration_by_design.csv")
    return written
