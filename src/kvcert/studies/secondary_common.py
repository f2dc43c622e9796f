"""What the secondary predictions S1-S5 (kvcert.studies.secondary) share: bootstrap settings, the nominal context
length, the decision rules (a CI band, else study 1's condition rule, combined as study 1's verdict rule), the claim
code's rows and their C1 cells, example-cluster ratios of cell counts and the cells covered at a level; the
conventions they follow are listed in kvcert.studies.secondary's docstring."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy, claims, coverage
from kvcert.analysis.bootstrap import ratio_of_sums
from kvcert.studies.published import as_strings

LENGTHS = (1000, 2000, 4000)
DEFAULT_BOOT = {"n_boot": 2000, "bootstrap_seed": 20260101, "alpha": 0.05}
KEY = ["run", "example_id", "variant"]


def boot_settings(spec: Mapping) -> dict:
    """n_boot / seed / alpha of a spec (study 2's common settings by default)."""
    return {
        "n_boot": int(spec.get("n_boot", DEFAULT_BOOT["n_boot"])),
        "seed": int(spec.get("bootstrap_seed", DEFAULT_BOOT["bootstrap_seed"])),
        "alpha": float(spec.get("alpha", DEFAULT_BOOT["alpha"])),
    }


def _claim_spec(spec: Mapping) -> dict:
    """A spec with study 2's bootstrap defaults filled in (what claim_metrics._boot reads)."""
    return {**DEFAULT_BOOT, **dict(spec)}


def nominal_length(context_tokens: pd.Series | np.ndarray, lengths: Sequence[int] = LENGTHS) -> np.ndarray:
    """The nearest design length (ties to the shorter) of each prompt's token count."""
    x = np.asarray(context_tokens, dtype=np.float64)
    grid = np.asarray(sorted(lengths), dtype=np.float64)
    return grid[np.abs(x[:, None] - grid[None, :]).argmin(axis=1)].astype(np.int64)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def band_status(metric: Mapping, band: Sequence[float]) -> str:
    """met: the CI lies inside [band]; failed: the CI lies entirely outside it; undecided otherwise (or NaN)."""
    lo, hi = metric.get("lo"), metric.get("hi")
    b_lo, b_hi = float(band[0]), float(band[1])
    if not (_finite(lo) and _finite(hi)):
        return "undecided"
    if lo >= b_lo and hi <= b_hi:
        return "met"
    if hi < b_lo or lo > b_hi:
        return "failed"
    return "undecided"


def condition_status(metric: Mapping, condition: Mapping) -> str:
    if "band" in condition:
        return band_status(metric, condition["band"])
    return claims.condition_status(metric, condition)


def combine(statuses: Sequence[str]) -> str:
    """met when every condition is met, failed when any is failed, undecided otherwise (study 1's verdict rule)."""
    if statuses and all(s == "met" for s in statuses):
        return "met"
    if any(s == "failed" for s in statuses):
        return "failed"
    return "undecided"


def _decide(metrics: Mapping[str, Mapping], conditions: Sequence[Mapping]) -> tuple[str, list[dict]]:
    evaluated = []
    for cond in conditions:
        name = str(cond["metric"])
        if name not in metrics:
            raise KeyError(f"condition on unknown metric {name!r}; known: {sorted(metrics)}")
        evaluated.append({**cond, "status": condition_status(metrics[name], cond), "value": dict(metrics[name])})
    return combine([c["status"] for c in evaluated]), evaluated


def selected_examples(examples: pd.DataFrame, rows: Mapping | None, lengths: Sequence[int] = LENGTHS) -> pd.DataFrame:
    """The claim code's rows (non-finite rows excluded, then the row filter), with a nominal `length` column."""
    kept, _ = claims.exclude_nonfinite(examples)
    ex = accuracy.select_rows(kept, rows)
    return ex.assign(length=nominal_length(ex["context_tokens"], lengths))


def example_cells(
    examples: pd.DataFrame, cells: pd.DataFrame, rows: Mapping | None, lengths: Sequence[int] = LENGTHS
) -> pd.DataFrame:
    """Cells of the selected rows with a certificate, with the rows' task and nominal length."""
    ex = selected_examples(examples, rows, lengths)
    ex = ex[ex["has_certificate"].astype(bool)]
    meta = ex[[*KEY, "task", "length"]].drop_duplicates(KEY)
    meta = meta.astype({k: str for k in KEY})
    left = cells.assign(**{k: as_strings(cells[k]) for k in KEY})  # = astype(str), through the categories
    return left.merge(meta, on=KEY, how="inner")


def cluster_ratio(
    cells: pd.DataFrame,
    numerator: str | np.ndarray,
    denominator: str | np.ndarray,
    boot: Mapping,
    mask: np.ndarray | None = None,
) -> dict:
    """sum(numerator) / sum(denominator) over the cells (times mask), example-cluster percentile interval."""
    num = np.asarray(cells[numerator] if isinstance(numerator, str) else numerator, dtype=np.float64)
    den = np.asarray(cells[denominator] if isinstance(denominator, str) else denominator, dtype=np.float64)
    if mask is not None:
        num, den = num * mask, den * mask
    frame = pd.DataFrame({"k": cells["example_id"].astype(str).array, "n": num, "d": den})  # grouped in its dtype
    g = frame.groupby("k", sort=True)[["n", "d"]].sum()
    ci = ratio_of_sums(g["n"].to_numpy(), g["d"].to_numpy(), **boot)
    return {
        "estimate": ci.estimate,
        "lo": ci.lo,
        "hi": ci.hi,
        "numerator": float(num.sum()),
        "denominator": float(den.sum()),
        "n_examples": int(len(g)),
    }


def covered_at(cells: pd.DataFrame, level: float, levels: Sequence[float] | None = None) -> np.ndarray:
    """Cells covered by z_level sqrt(V_hat): n_cells where ratio_bin <= the level's index, else 0."""
    levels = list(levels if levels is not None else cells.attrs.get("levels", coverage.DEFAULT_LEVELS))
    hits = [j for j, lv in enumerate(levels) if math.isclose(float(lv), level, abs_tol=1e-12)]
    if not hits:
        raise ValueError(f"level {level} is not among the table's levels {levels}")
    return cells["n_cells"].to_numpy(np.int64) * (cells["ratio_bin"].to_numpy() <= hits[0])


def _levels(cells: pd.DataFrame) -> list[float]:
    return list(cells.attrs.get("levels", coverage.DEFAULT_LEVELS))
