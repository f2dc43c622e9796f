"""The metrics of each analysis kind a claim names (predictions.yaml's `analysis`: coverage, paired_accuracy,
drop_vs_full, auroc_failure, auroc_attribution, escalation, recompute): ANALYSES maps the kind to a function
(examples, steps, spec) -> (metrics, details, n_examples) built on the locked estimators of kvcert.analysis; the
verdict rule that reads the metrics, and the claim's result, are kvcert.analysis.claims."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from kvcert.analysis import accuracy, auroc, coverage, intervention


def _boot(spec: Mapping) -> dict:
    return {
        "n_boot": int(spec.get("n_boot", 2000)),
        "seed": int(spec.get("bootstrap_seed", 0)),
        "alpha": float(spec.get("alpha", 0.05)),
    }


def _records(df: pd.DataFrame) -> list[dict]:
    return df.to_dict(orient="records") if isinstance(df, pd.DataFrame) else df


def _coverage(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    b = _boot(spec)
    level = float(spec.get("level", 0.95))
    ex = accuracy.select_rows(examples, spec.get("rows"))
    certified = ex[ex["has_certificate"].astype(bool)]
    details: dict = {"n_rows_without_certificate": int(len(ex) - len(certified))}
    if steps is None or len(steps) == 0:
        # no step records: the examples table carries 95% counts only
        res = coverage.coverage_from_examples(certified, **b)
        details["source"] = "examples (steps95 / steps_total)"
        metrics = {"coverage": {"estimate": res["coverage"], "lo": res["lo"], "hi": res["hi"]}}
        return metrics, details | {"pooled": res}, int(certified["example_id"].nunique())
    st = coverage.steps_for(certified, steps)
    st = coverage.attach_example_columns(st, certified, ["budget", "task"])
    res = coverage.pooled_coverage(st, level, **b)
    conf = coverage.conformal_multiplier(st, level, int(spec.get("conformal_seed", 0)), **b)
    metrics = {
        "coverage": {"estimate": res["coverage"], "lo": res["lo"], "hi": res["hi"]},
        "conformal_multiplier": {"estimate": conf["multiplier"], "lo": float("nan"), "hi": float("nan")},
        "conformal_test_coverage": conf["coverage_test"],
    }
    regime = spec.get("regime_bins", {})
    details |= {
        "source": "steps",
        "pooled": res,
        "by_budget": _records(coverage.coverage_table(st, "budget", level, **b)),
        "by_task": _records(coverage.coverage_table(st, "task", level, **b)),
        "by_layer": _records(coverage.coverage_table(st, "layer", level, **b)),
        "calibration": _records(coverage.calibration_curve(st, spec.get("levels", coverage.DEFAULT_LEVELS), **b)),
        "by_regime": _records(
            coverage.coverage_by_regime(
                st,
                level,
                regime.get("tail_mass", coverage.TAIL_MASS_BINS),
                regime.get("p_max", coverage.P_MAX_BINS),
                **b,
            )
        ),
        "conformal": conf,
    }
    return metrics, details, int(res["n_examples"])


def _paired_accuracy(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    ex = accuracy.select_rows(examples, spec.get("rows"))
    arms = spec["arms"]
    res = accuracy.paired_accuracy_difference(
        ex, arms["a"], arms["b"], spec.get("pair_on", ["scorer", "budget"]), **_boot(spec)
    )
    cells = res["cells"]
    worst = cells.loc[cells["lo"].idxmin()].to_dict() if len(cells) and cells["lo"].notna().any() else None
    metrics = {"diff": res["diff"], "acc_a": res["acc_a"], "acc_b": res["acc_b"]}
    if worst is not None:
        metrics["worst_cell_diff"] = {"estimate": worst["diff"], "lo": worst["lo"], "hi": worst["hi"]}
    details = {"cells": _records(cells), "worst_cell": worst, "n_units": res["n_units"]}
    return metrics, details, int(res["n_examples"])


def _drop_vs_full(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    b = _boot(spec)
    ex = accuracy.select_rows(examples, spec.get("rows"))
    res = accuracy.drop_vs_full(ex, **b)
    per_budget = {float(k): accuracy.drop_vs_full(g, **b) for k, g in ex.groupby("budget", sort=True)}
    metrics = {"drop": res["drop"], "full_accuracy": res["full_accuracy"], "policy_accuracy": res["policy_accuracy"]}
    details = {
        "by_budget": [
            {
                "budget": k,
                "drop": v["drop"],
                "policy_accuracy": v["policy_accuracy"],
                "full_accuracy": v["full_accuracy"],
                "n_examples": v["n_examples"],
            }
            for k, v in per_budget.items()
        ]
    }
    return metrics, details, int(res["n_examples"])


def _auroc_metrics(res: dict) -> dict:
    return {"auc_cert": res["auc_a"], "auc_conf": res["auc_b"], "auc_diff": res["diff"]}


def _auroc_details(res: dict) -> dict:
    return {
        "n_pos": res["n_pos"],
        "n_neg": res["n_neg"],
        "reason": res["reason"],
        "n_excluded": res["n_excluded"],
        "roc_cert": _records(res["roc_cert"]),
        "roc_confidence": _records(res["roc_confidence"]),
    }


def _auroc_failure(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    ex = accuracy.select_rows(examples, spec.get("rows"))
    res = auroc.failure_prediction(ex, **_boot(spec))
    return _auroc_metrics(res), _auroc_details(res), int(ex["example_id"].nunique())


def _auroc_attribution(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    ex = accuracy.select_rows(examples, spec.get("rows"))
    res = auroc.failure_attribution(ex, **_boot(spec))
    details = _auroc_details(res) | {"n_failures": res["n_failures"]}
    return _auroc_metrics(res), details, int(ex[~ex["correct"].astype(bool)]["example_id"].nunique())


def _escalation(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    ex = accuracy.select_rows(examples, spec.get("rows"))
    units, excluded = intervention.escalation_units(ex, spec["low"], spec["high"])
    res = intervention.escalation_gain(units, float(spec["rate"]), **_boot(spec))
    names = ("gain_random", "gain_confidence", "certificate", "confidence", "random", "oracle", "low", "high")
    metrics = {k: res[k] for k in names}
    curves = intervention.escalation_curves(units, spec.get("rates", intervention.DEFAULT_RATES))
    details = {"curves": _records(curves), "n_units": res["n_units"], "n_excluded": excluded, "rate": res["rate"]}
    return metrics, details, int(res["n_examples"])


def _recompute(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> tuple[dict, dict, int]:
    ex = accuracy.select_rows(examples, spec.get("rows"))
    budgets = spec.get("recompute_budgets", intervention.DEFAULT_BUDGETS)
    res = intervention.recompute_areas(ex, budgets, **_boot(spec))
    names = ("diff_random", "diff_confidence", "certificate", "confidence", "random", "oracle")
    metrics = {k: res[k] for k in names}
    details = {
        "curves": _records(intervention.recompute_curves(ex, budgets)),
        "n_excluded": res["n_excluded"],
        "n_cache_induced": res["n_cache_induced"],
        "budgets": res["budgets"],
    }
    return metrics, details, int(res["n_examples"])


ANALYSES = {
    "coverage": _coverage,
    "paired_accuracy": _paired_accuracy,
    "drop_vs_full": _drop_vs_full,
    "auroc_failure": _auroc_failure,
    "escalation": _escalation,
    "auroc_attribution": _auroc_attribution,
    "recompute": _recompute,
}
