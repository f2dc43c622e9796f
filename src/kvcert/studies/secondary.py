"""Study 2's secondary predictions S1-S5 (preregistration/study2/PLAN.md section 5), from the examples table and the
per-cell table of kvcert.studies.cells (never the raw steps).

Each S function returns a plain dict: the decided metric's estimate / lo / hi (example-cluster 95% percentile
bootstrap, kvcert.analysis.bootstrap.ratio_of_sums for coverages, the locked claim code for AUROCs and drops), a
`status` (met / failed / undecided; None for the descriptive S3 and S5) and the reported outcomes beside it. The
settings (rows, n_boot, bootstrap_seed, alpha, decision conditions) come from study 2's predictions.yaml: the
`secondary` block where it has them, otherwise the claim whose rows the prediction reuses (C1 for S1, S2 and S4;
C4 / C6 for S3; C1 / C3 / C6 for S5).

Conventions:
- Rows are those the locked claim code would use: claims.exclude_nonfinite, then accuracy.select_rows, then rows
  with a certificate; cells are matched to them on (run, example_id, variant).
- Clusters are example_ids (sorted), as in coverage.pooled_coverage, so the C1 coverage computed here equals the
  locked code's, interval included. A coverage over a subset of cells (trusted / untrusted) keeps every example of
  the selection as a cluster, with zero counts where it has no such cell (the resampled unit is the example).
- Context length: examples carry the prompt's token count (`context_tokens`, e.g. 1038 for a 1k example); the
  nominal length is the nearest of the design's `context_tokens` (1000 / 2000 / 4000).
- A condition with `band: [lo, hi]` is met when the CI lies inside the band and failed when it lies entirely
  outside; any other condition is decided by kvcert.analysis.claims.condition_status (study 1's rule).
- S2 decides on the tight radius times the per-layer multiplier (`primary="tight"`; the Gaussian radius times its
  multiplier is reported beside it); `primary="gaussian"` decides on the Gaussian one instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy, claim_metrics, claims
from kvcert.studies.secondary_common import (
    LENGTHS,
    _claim_spec,
    _decide,
    _finite,
    _levels,
    boot_settings,
    cluster_ratio,
    covered_at,
    example_cells,
    nominal_length,
)

S1_BAND = (0.93, 0.97)
S2_THRESHOLD = 0.93
S4_TOLERANCE = 0.005
S3_MIN_CLASS_ROWS = 10
NAN = float("nan")


# ------------------------------------------------------------------------------------------------------------ S1
def s1(examples: pd.DataFrame, cells: pd.DataFrame, spec: Mapping, lengths: Sequence[int] = LENGTHS) -> dict:
    """The tight (Satterthwaite) radius's coverage on trusted cells; met when its CI lies inside [0.93, 0.97]."""
    boot = boot_settings(spec)
    c = example_cells(examples, cells, spec.get("rows"), lengths)
    trusted = c["trusted"].to_numpy(bool)
    metrics = {
        "coverage_trusted": cluster_ratio(c, "tight95", "tight_defined", boot, trusted),
        "trusted_share": cluster_ratio(c, c["n_cells"].to_numpy() * trusted, "n_cells", boot),
        "coverage_tight_all": cluster_ratio(c, "tight95", "tight_defined", boot),
        "coverage_tight_untrusted": cluster_ratio(c, "tight95", "tight_defined", boot, ~trusted),
    }
    conditions = spec.get("decision") or [{"metric": "coverage_trusted", "band": list(S1_BAND)}]
    status, evaluated = _decide(metrics, conditions)
    by_length = []
    for length, g in c.groupby("length", sort=True):
        t = g["trusted"].to_numpy(bool)
        by_length.append(
            {
                "length": int(length),
                "coverage_trusted": cluster_ratio(g, "tight95", "tight_defined", boot, t),
                "trusted_share": cluster_ratio(g, g["n_cells"].to_numpy() * t, "n_cells", boot),
            }
        )
    main = metrics["coverage_trusted"]
    return {
        "id": "S1",
        "metric": "coverage_trusted",
        "estimate": main["estimate"],
        "lo": main["lo"],
        "hi": main["hi"],
        "status": status,
        "conditions": evaluated,
        "metrics": metrics,
        "by_length": by_length,
    }


# ------------------------------------------------------------------------------------------------------------ S2
_KINDS = {"tight": ("conformal_tight", "tight_defined"), "gaussian": ("conformal_gauss", "n_cells")}


def s2(
    examples: pd.DataFrame,
    cells: pd.DataFrame,
    spec: Mapping,
    primary: str = "tight",
    lengths: Sequence[int] = LENGTHS,
    seen_lengths: Sequence[int] = (1000, 2000),
    new_lengths: Sequence[int] = (4000,),
) -> dict:
    """Coverage of the transferred per-layer conformal radius, (a) pooled over the fitted lengths and (b) on the
    new one; each condition met when its CI lower bound >= 0.93, failed when its upper bound < 0.93."""
    if primary not in _KINDS:
        raise ValueError(f"primary must be one of {sorted(_KINDS)}, got {primary!r}")
    if cells.attrs.get("multipliers") is False:
        raise ValueError("the cell table was built without multipliers: its conformal counts are all zero")
    boot = boot_settings(spec)
    c = example_cells(examples, cells, spec.get("rows"), lengths)
    length = c["length"].to_numpy()
    seen, new = np.isin(length, list(seen_lengths)), np.isin(length, list(new_lengths))
    by_kind = {}
    for kind, (num, den) in _KINDS.items():
        by_kind[kind] = {
            "seen_lengths": cluster_ratio(c.loc[seen], num, den, boot),
            "new_lengths": cluster_ratio(c.loc[new], num, den, boot),
            "all_lengths": cluster_ratio(c, num, den, boot),
        }
    metrics = {
        "conformal_transfer_coverage_1k2k": by_kind[primary]["seen_lengths"],
        "conformal_transfer_coverage_4k": by_kind[primary]["new_lengths"],
    }
    conditions = spec.get("decision") or [
        {"metric": name, "direction": ">=", "threshold": S2_THRESHOLD, "support_on": "ci", "refute_on": "ci"}
        for name in metrics
    ]
    status, evaluated = _decide(metrics, conditions)
    num, den = _KINDS[primary]
    by_layer = []
    for layer, g in c.groupby("layer", sort=True):
        row = {"layer": int(layer)}
        for kind, (n, d) in _KINDS.items():
            row[kind] = cluster_ratio(g, n, d, boot)
        by_layer.append(row)
    worst = min(by_layer, key=lambda r: r[primary]["estimate"], default=None)
    return {
        "id": "S2",
        "metric": "conformal_transfer_coverage",
        "primary": primary,
        "estimate": by_kind[primary]["all_lengths"]["estimate"],
        "lo": by_kind[primary]["all_lengths"]["lo"],
        "hi": by_kind[primary]["all_lengths"]["hi"],
        "status": status,
        "conditions": evaluated,
        "metrics": metrics,
        "by_kind": by_kind,
        "by_layer": by_layer,
        "worst_layer": worst,
        "seen_lengths": list(seen_lengths),
        "new_lengths": list(new_lengths),
    }


# ------------------------------------------------------------------------------------------------------------ S3
def _auroc_row(metrics: Mapping, details: Mapping, n_examples: int) -> dict:
    return {
        "auc_cert": dict(metrics["auc_cert"]),
        "auc_conf": dict(metrics["auc_conf"]),
        "auc_diff": dict(metrics["auc_diff"]),
        "n_pos": int(details["n_pos"]),
        "n_neg": int(details["n_neg"]),
        "reason": details["reason"],
        "n_examples": int(n_examples),
    }


def s3(examples: pd.DataFrame, c4_spec: Mapping, c6_spec: Mapping, min_class_rows: int = S3_MIN_CLASS_ROWS) -> dict:
    """Per task: C4's and C6's AUROC(cert), AUROC(conf) and difference, by the locked claim code on the task's rows.

    Check: "consistent" when the C4 difference has the same sign in every task with >= min_class_rows rows of each
    class, "not consistent" otherwise, "no task qualifies" when none has enough rows."""
    kept, _ = claims.exclude_nonfinite(examples)
    c4, c6 = _claim_spec(c4_spec), _claim_spec(c6_spec)
    by_task = []
    for task, sub in kept.groupby("task", sort=True):
        by_task.append(
            {
                "task": str(task),
                "C4": _auroc_row(*claim_metrics._auroc_failure(sub, None, c4)),
                "C6": _auroc_row(*claim_metrics._auroc_attribution(sub, None, c6)),
            }
        )
    qualifying = [
        r
        for r in by_task
        if r["C4"]["n_pos"] >= min_class_rows
        and r["C4"]["n_neg"] >= min_class_rows
        and _finite(r["C4"]["auc_diff"]["estimate"])
    ]
    signs = {int(np.sign(r["C4"]["auc_diff"]["estimate"])) for r in qualifying}
    check = "no task qualifies" if not qualifying else ("consistent" if len(signs) == 1 else "not consistent")
    return {
        "id": "S3",
        "status": None,
        "check": check,
        "check_tasks": [r["task"] for r in qualifying],
        "min_class_rows": min_class_rows,
        "by_task": by_task,
    }


# ------------------------------------------------------------------------------------------------------------ S4
def s4(
    examples: pd.DataFrame,
    cells: pd.DataFrame,
    spec: Mapping,
    level: float = 0.95,
    lengths: Sequence[int] = LENGTHS,
) -> dict:
    """Coverage of z95 sqrt(V_hat) + numerical floor minus C1's coverage; met when |difference| < 0.005 (point)."""
    boot = boot_settings(spec)
    c = example_cells(examples, cells, spec.get("rows"), lengths)
    covered = covered_at(c, level, _levels(cells))
    c1 = cluster_ratio(c, covered, "n_cells", boot)
    with_floor = cluster_ratio(c, "floor95", "n_cells", boot)
    diff = cluster_ratio(c, c["floor95"].to_numpy(np.float64) - covered, "n_cells", boot)
    name = "coverage_with_tolerance_minus_c1"
    metric = {"estimate": abs(diff["estimate"]) if _finite(diff["estimate"]) else NAN, "lo": NAN, "hi": NAN}
    conditions = spec.get("decision") or [
        {"metric": name, "direction": "<", "threshold": S4_TOLERANCE, "support_on": "point", "refute_on": "point"}
    ]
    status, evaluated = _decide({name: metric}, conditions)
    return {
        "id": "S4",
        "metric": name,
        "estimate": diff["estimate"],
        "lo": diff["lo"],
        "hi": diff["hi"],
        "status": status,
        "conditions": evaluated,
        "numerical_floor": cells.attrs.get("numerical_floor"),
        "coverage_c1": c1,
        "coverage_with_tolerance": with_floor,
    }


# ------------------------------------------------------------------------------------------------------------ S5
def s5(
    examples: pd.DataFrame,
    cells: pd.DataFrame,
    c1_spec: Mapping,
    c3_spec: Mapping,
    c6_spec: Mapping,
    level: float = 0.95,
    lengths: Sequence[int] = LENGTHS,
) -> dict:
    """By nominal length: C1 coverage (cells), C3 drop and C6 AUROCs (the locked claim code). Descriptive."""
    c1, c3, c6 = _claim_spec(c1_spec), _claim_spec(c3_spec), _claim_spec(c6_spec)
    boot = boot_settings(c1)
    kept, _ = claims.exclude_nonfinite(examples)
    kept = kept.assign(length=nominal_length(kept["context_tokens"], lengths))
    c = example_cells(examples, cells, c1.get("rows"), lengths)
    covered = covered_at(c, level, _levels(cells))
    out = []
    for length, sub in kept.groupby("length", sort=True):
        here = c["length"].to_numpy() == length
        row: dict = {"length": int(length)}
        row["C1_coverage"] = cluster_ratio(c.loc[here], covered[here], "n_cells", boot)
        if len(accuracy.select_rows(sub, c3.get("rows"))):
            metrics, _, n = claim_metrics._drop_vs_full(sub, None, c3)
            row["C3_drop"] = dict(metrics["drop"]) | {"n_examples": int(n)}
        else:
            row["C3_drop"] = {"estimate": NAN, "lo": NAN, "hi": NAN, "n_examples": 0}
        row["C6"] = _auroc_row(*claim_metrics._auroc_attribution(sub, None, c6))
        out.append(row)
    return {"id": "S5", "status": None, "by_length": out}


# ------------------------------------------------------------------------------------------------------- all five
def _specs(predictions: Mapping) -> tuple[Mapping, Mapping, list[int]]:
    specs = predictions.get("claims", predictions)
    secondary = predictions.get("secondary", predictions.get("secondary_predictions", {})) or {}
    lengths = (predictions.get("design") or {}).get("context_tokens", LENGTHS)
    return specs, secondary, [int(x) for x in lengths]


def _spec(secondary: Mapping, sid: str, fallback: Mapping) -> dict:
    """The S entry's settings (rows, bootstrap, decision) over those of the claim whose rows it reuses."""
    base = {k: fallback[k] for k in ("rows", "n_boot", "bootstrap_seed", "alpha") if k in fallback}
    own = dict(secondary.get(sid) or {})
    return {**base, **own}


def evaluate_secondary(
    examples: pd.DataFrame, cells: pd.DataFrame, predictions: Mapping, s2_primary: str = "tight"
) -> dict:
    """S1-S5 from the examples table, the cell table and the parsed study-2 predictions.yaml (the whole document,
    or its `claims` mapping alone: the decision rules then default to PLAN.md section 5's)."""
    specs, secondary, lengths = _specs(predictions)
    c1 = specs["C1"]
    s2_seen = [x for x in lengths if x <= 2000]
    s2_new = [x for x in lengths if x > 2000]
    return {
        "S1": s1(examples, cells, _spec(secondary, "S1", c1), lengths),
        "S2": s2(examples, cells, _spec(secondary, "S2", c1), s2_primary, lengths, s2_seen, s2_new),
        "S3": s3(examples, specs["C4"], specs["C6"]),
        "S4": s4(examples, cells, _spec(secondary, "S4", c1), lengths=lengths),
        "S5": s5(examples, cells, c1, specs["C3"], specs["C6"], lengths=lengths),
    }
