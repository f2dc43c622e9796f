"""Model dependence (study 3): per claim, model A's estimate minus model B's, with a bootstrap interval.

Study 3 decides the same claims on two models (SmolLM2-135M and Gemma 3 270M). For each of C1, C2, C3, C4, C6 and
C7 (C5 and T1 are left out) this module reports both models' estimates of the claim's metric and the difference
A - B with a 95% percentile interval from n_boot = 2000 bootstrap resamples. The two models are independent samples
(different tokenizers, different examples), so each model's examples are resampled independently: an
example-cluster bootstrap within each model, drawn exactly as the locked claim code draws it
(kvcert.analysis.bootstrap.cluster_codes and bootstrap_weights; model A with `seed`, model B with `seed + 1`), and
the b-th difference is stat_A(resample b) - stat_B(resample b).

Metrics (the claim's primary metric first):
  C1 coverage         pooled coverage of the level radius (coverage.pooled_coverage's cluster counts, or
                      coverage_from_examples' steps95 / steps_total without step records), ratio of resampled sums
  C2 diff             mean over paired units of randomized - deterministic accuracy (accuracy.paired_units), points
  C3 drop             full-cache minus policy accuracy, paired per row (accuracy.drop_vs_full), points
  C4 auc_diff         AUROC(cert) - AUROC(-logprob) for failure (auroc.failure_prediction's rows and labels)
  C6 auc_diff, auc_cert   the same among failures, label cache-induced (auroc.failure_attribution)
  C7 diff_random, diff_confidence   recovery-area differences (intervention.recomputation / normalized_area), points
Each resample's statistic is the locked one (kvcert.analysis, not edited here) evaluated at the resample's row
weights: bootstrap.weighted_mean, auroc.weighted_auroc_stat, RankedIntervention.curve. Point estimates are the
locked code's own (unit weights; sklearn for AUROCs, as auroc.paired_auroc), so each equals what
claims.evaluate_claim reports (tested).

Reading, declared before any study-3 record is read:
  "model-dependent"                    the difference's interval excludes zero and the two verdicts differ;
  "same verdict, sizes differ"         the interval excludes zero and the two verdicts are equal;
  "not distinguishable at this power"  the interval includes zero (a closed interval; an undefined, NaN, interval
                                       excludes nothing and reads the same).
The verdicts are passed in (each model's evaluated ClaimResult.verdict); this module never re-decides a claim.

Pure pandas / numpy over records (claim id -> (examples, steps), as kvcert.studies.analyze.analyze builds them from
published records): no model is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis import accuracy, auroc, claims, coverage, intervention
from kvcert.analysis.accuracy import POINTS
from kvcert.analysis.bootstrap import Stat, bootstrap_weights, cluster_codes, percentile_ci, weighted_mean
from kvcert.analysis.scorecard import round_frame
from kvcert.analysis.tables import markdown_table
from kvcert.shards import atomic_text

CLAIMS = ("C1", "C2", "C3", "C4", "C6", "C7")
# metrics reported per analysis; the spec's primary metric is put first
METRICS: dict[str, tuple[str, ...]] = {
    "coverage": ("coverage",),
    "paired_accuracy": ("diff",),
    "drop_vs_full": ("drop",),
    "auroc_failure": ("auc_diff",),
    "auroc_attribution": ("auc_diff", "auc_cert"),
    "recompute": ("diff_random", "diff_confidence"),
}
MODEL_DEPENDENT = "model-dependent"
SAME_VERDICT = "same verdict, sizes differ"
NOT_DISTINGUISHABLE = "not distinguishable at this power"
READINGS = (MODEL_DEPENDENT, SAME_VERDICT, NOT_DISTINGUISHABLE)
COLUMNS = [
    "claim",
    "metric",
    "estimate_a",
    "estimate_b",
    "difference",
    "ci_low",
    "ci_high",
    "verdict_a",
    "verdict_b",
    "reading",
    "n_a",
    "n_b",
]
N_BOOT = 2000
SEED = 20260101
NAN = float("nan")

Records = Mapping[str, tuple[pd.DataFrame, pd.DataFrame | None]]


@dataclass(frozen=True)
class Resampled:
    """One model's statistics for one claim: point estimates, their n_boot bootstrap values (index b = resample b)
    and the number of example clusters resampled."""

    estimates: dict[str, float]
    samples: dict[str, np.ndarray]
    n_examples: int


def _undefined(names: Sequence[str], n_boot: int, n_examples: int) -> Resampled:
    return Resampled({k: NAN for k in names}, {k: np.full(n_boot, NAN) for k in names}, n_examples)


def _weighted(
    stats: Mapping[str, Stat],
    clusters: Sequence | np.ndarray | pd.Series,
    n_boot: int,
    seed: int,
    scale: float = 1.0,
    derived: Mapping[str, Callable[[dict[str, float]], float]] | None = None,
) -> Resampled:
    """Every stat at unit weights and on each resample, evaluated as bootstrap.bootstrap_many evaluates it (same
    cluster codes, same weights for a given seed, derived stats from one resample's values), keeping the resampled
    values instead of reducing them to an interval; `scale` as Interval.scaled (x100 for points)."""
    derived = derived or {}
    codes, n_clusters = cluster_codes(clusters)

    def evaluate(w: np.ndarray) -> dict[str, float]:
        values = {name: float(stat(w)) for name, stat in stats.items()}
        return values | {name: float(fn(values)) for name, fn in derived.items()}

    point = evaluate(np.ones(len(codes)))
    weights = bootstrap_weights(n_clusters, n_boot, seed)
    samples = {name: np.empty(n_boot) for name in point}
    for b in range(n_boot):
        for name, value in evaluate(weights[b, codes]).items():
            samples[name][b] = value
    return Resampled(
        {name: value * scale for name, value in point.items()},
        {name: s * scale for name, s in samples.items()},
        n_clusters,
    )


# ---------------------------------------------------------------------------------------------------- per claim
def _ratio_of_sums(numerator: np.ndarray, denominator: np.ndarray, n_boot: int, seed: int) -> Resampled:
    """bootstrap.ratio_of_sums (one entry per cluster), keeping the resampled ratios."""
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    n = len(num)
    if n == 0 or den.sum() <= 0:
        return _undefined(["coverage"], n_boot, n)
    weights = bootstrap_weights(n, n_boot, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = (weights @ num) / (weights @ den)
    return Resampled({"coverage": float(num.sum() / den.sum())}, {"coverage": samples}, n)


def _coverage(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping, n_boot: int, seed: int) -> Resampled:
    """C1, as claim_metrics._coverage: the pooled coverage over the certified cells of the selected rows."""
    ex = accuracy.select_rows(examples, spec.get("rows"))
    certified = ex[ex["has_certificate"].astype(bool)]
    if steps is None or len(steps) == 0:
        # coverage.coverage_from_examples: per-example steps95 / steps_total
        kept = certified[certified["has_certificate"].astype(bool) & (certified["steps_total"] > 0)]
        grouped = kept.groupby("example_id")[["steps95", "steps_total"]].sum()
        return _ratio_of_sums(grouped["steps95"].to_numpy(), grouped["steps_total"].to_numpy(), n_boot, seed)
    # coverage.pooled_coverage; claim_metrics._coverage also attaches budget / task, which neither adds nor drops a cell
    cells, _ = coverage.certified_cells(coverage.steps_for(certified, steps))
    covered = coverage.standardized_error(cells) <= coverage.z_value(float(spec.get("level", 0.95)))
    num, den = coverage._cluster_counts(covered, cells["example_id"].to_numpy())  # the locked per-example counts
    return _ratio_of_sums(num, den, n_boot, seed)


def _paired_accuracy(
    examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping, n_boot: int, seed: int
) -> Resampled:
    """C2, as accuracy.paired_accuracy_difference: the weighted mean of the paired unit differences, in points."""
    ex = accuracy.select_rows(examples, spec.get("rows"))
    arms = spec["arms"]
    units = accuracy.paired_units(ex, arms["a"], arms["b"], spec.get("pair_on", ["scorer", "budget"]))
    return _weighted({"diff": weighted_mean(units["diff"].to_numpy())}, units["example_id"], n_boot, seed, POINTS)


def _drop_vs_full(
    examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping, n_boot: int, seed: int
) -> Resampled:
    """C3, as accuracy.drop_vs_full: the weighted mean of full_correct - correct per row, in points."""
    ex = accuracy.select_rows(examples, spec.get("rows"))
    full = ex["full_correct"].to_numpy(np.float64)
    policy = ex["correct"].to_numpy(np.float64)
    return _weighted({"drop": weighted_mean(full - policy)}, ex["example_id"], n_boot, seed, POINTS)


def _paired_auroc(rows: pd.DataFrame, label: Callable[[pd.DataFrame], np.ndarray], n_boot: int, seed: int) -> Resampled:
    """auroc.paired_auroc over the rows with finite scores: certificate vs confidence (-mean log-prob)."""
    ex, _ = auroc.finite_rows(rows, ["cert_score", "logprob_mean"])
    y = np.asarray(label(ex), dtype=bool)
    cert, conf = ex["cert_score"].to_numpy(np.float64), -ex["logprob_mean"].to_numpy(np.float64)
    clusters = ex["example_id"].to_numpy()
    if auroc.degenerate_reason(y) is not None:  # one class missing: undefined, as paired_auroc reports it
        return _undefined(["auc_cert", "auc_conf", "auc_diff"], n_boot, cluster_codes(clusters)[1])
    res = _weighted(
        {"auc_cert": auroc.weighted_auroc_stat(y, cert), "auc_conf": auroc.weighted_auroc_stat(y, conf)},
        clusters,
        n_boot,
        seed,
        derived={"auc_diff": lambda v: v["auc_cert"] - v["auc_conf"]},
    )
    # sklearn for the point estimates, the weighted Mann-Whitney statistic for the resamples (as paired_auroc)
    a, b = auroc.auroc(y, cert), auroc.auroc(y, conf)
    return Resampled({"auc_cert": a, "auc_conf": b, "auc_diff": a - b}, res.samples, res.n_examples)


def _auroc_failure(
    examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping, n_boot: int, seed: int
) -> Resampled:
    """C4, as auroc.failure_prediction: label failure = not correct."""
    ex = accuracy.select_rows(examples, spec.get("rows"))
    return _paired_auroc(ex, lambda r: ~r["correct"].to_numpy(bool), n_boot, seed)


def _auroc_attribution(
    examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping, n_boot: int, seed: int
) -> Resampled:
    """C6, as auroc.failure_attribution: failures only, label cache-induced = full_correct."""
    ex = accuracy.select_rows(examples, spec.get("rows"))
    failures = ex[~ex["correct"].astype(bool)]
    return _paired_auroc(failures, lambda r: r["full_correct"].to_numpy(bool), n_boot, seed)


def _recompute(examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping, n_boot: int, seed: int) -> Resampled:
    """C7, as intervention.recompute_areas: normalized recovery areas and their differences, in points."""
    ex = accuracy.select_rows(examples, spec.get("rows"))
    budgets = spec.get("recompute_budgets", intervention.DEFAULT_BUDGETS)
    rec, _, _ = intervention.recomputation(ex)

    def area(ranking: str) -> Stat:
        curve = rec.curve(ranking, budgets)
        return lambda w: intervention.normalized_area(budgets, curve(w))

    # the oracle's area enters no difference, so it is not resampled
    stats = {name: area(name) for name in ("certificate", "random", "confidence")}
    derived = {f"diff_{name}": fn for name, fn in intervention.DIFFERENCES.items()}
    return _weighted(stats, rec.clusters, n_boot, seed, POINTS, derived)


RESAMPLERS = {
    "coverage": _coverage,
    "paired_accuracy": _paired_accuracy,
    "drop_vs_full": _drop_vs_full,
    "auroc_failure": _auroc_failure,
    "auroc_attribution": _auroc_attribution,
    "recompute": _recompute,
}


def resample_claim(
    claim_id: str,
    examples: pd.DataFrame,
    steps: pd.DataFrame | None,
    spec: Mapping[str, object],
    n_boot: int = N_BOOT,
    seed: int = SEED,
) -> Resampled:
    """One model's point estimates and example-cluster bootstrap values for one claim (rows as evaluate_claim
    selects them: non-finite rows dropped first; steps are read by C1 only). With seed = the spec's bootstrap_seed
    and the same n_boot, the resamples are the claim's own, so their percentile interval is the claim's CI."""
    pending = claims.find_tbd(spec)
    if pending:
        raise ValueError(f"claim {claim_id}: the spec still holds {claims.TBD} at {', '.join(pending)}")
    kind = str(spec["analysis"])
    if kind not in RESAMPLERS:
        raise ValueError(
            f"claim {claim_id}: analysis {kind!r} has no model-dependence statistic; known: {sorted(RESAMPLERS)}"
        )
    kept, _ = claims.exclude_nonfinite(examples)
    return RESAMPLERS[kind](kept, steps if kind == "coverage" else None, spec, int(n_boot), int(seed))


# ------------------------------------------------------------------------------------------------------ reading
def difference_interval(samples_a: np.ndarray, samples_b: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """Percentile interval of the resampled differences a - b; NaN unless at least half the resamples are defined
    (bootstrap.bootstrap_many's rule: an undefined statistic must not make an interval falsely narrow)."""
    diff = np.asarray(samples_a, dtype=np.float64) - np.asarray(samples_b, dtype=np.float64)
    if int(np.isfinite(diff).sum()) < max(1, len(diff) // 2):
        return NAN, NAN
    return percentile_ci(diff, alpha)


def reading(ci_low: float, ci_high: float, verdict_a: str, verdict_b: str) -> str:
    """The pre-declared reading of one difference (module docstring)."""
    excludes_zero = math.isfinite(ci_low) and math.isfinite(ci_high) and (ci_low > 0 or ci_high < 0)
    if not excludes_zero:
        return NOT_DISTINGUISHABLE
    return SAME_VERDICT if verdict_a == verdict_b else MODEL_DEPENDENT


def _verdict(verdicts: Mapping[str, object], claim_id: str, which: str) -> str:
    if claim_id not in verdicts:
        raise KeyError(f"no verdict for {claim_id} (model {which})")
    v = verdicts[claim_id]
    return str(getattr(v, "verdict", v))  # a ClaimResult or its verdict string


def model_dependence(
    records_a: Records,
    records_b: Records,
    predictions_a: Mapping[str, Mapping],
    predictions_b: Mapping[str, Mapping],
    verdicts_a: Mapping[str, object],
    verdicts_b: Mapping[str, object],
    n_boot: int = N_BOOT,
    seed: int = SEED,
    alpha: float = 0.05,
    claim_ids: Sequence[str] = CLAIMS,
) -> pd.DataFrame:
    """One row per claim and metric (COLUMNS): both models' estimates, difference A - B, its percentile interval
    from independent example-cluster resamples of each model (A: seed, B: seed + 1), both verdicts (claim id ->
    verdict string or ClaimResult) and the reading. records: claim id -> (examples, steps); predictions: claim id
    -> spec (each model's own spec decides its rows); n: example clusters each model's statistic resampled."""
    rows = []
    for cid in claim_ids:
        for which, recs, preds in (("A", records_a, predictions_a), ("B", records_b, predictions_b)):
            if cid not in recs or cid not in preds:
                raise KeyError(f"model {which} has no records or no spec for {cid}")
        spec_a, spec_b = predictions_a[cid], predictions_b[cid]
        if spec_a["analysis"] != spec_b["analysis"]:
            raise ValueError(f"{cid}: the two models' specs have different analyses")
        res_a = resample_claim(cid, *records_a[cid], spec_a, n_boot, seed)
        res_b = resample_claim(cid, *records_b[cid], spec_b, n_boot, seed + 1)  # an independent resample stream
        verdict_a, verdict_b = _verdict(verdicts_a, cid, "A"), _verdict(verdicts_b, cid, "B")
        primary = str(spec_a["primary_metric"])
        if primary != spec_b["primary_metric"] or primary not in res_a.estimates:
            raise ValueError(f"{cid}: primary metric {primary!r} differs between the specs or has no statistic here")
        for metric in (primary, *(m for m in METRICS[str(spec_a["analysis"])] if m != primary)):
            lo, hi = difference_interval(res_a.samples[metric], res_b.samples[metric], alpha)
            rows.append(
                {
                    "claim": cid,
                    "metric": metric,
                    "estimate_a": res_a.estimates[metric],
                    "estimate_b": res_b.estimates[metric],
                    "difference": res_a.estimates[metric] - res_b.estimates[metric],
                    "ci_low": lo,
                    "ci_high": hi,
                    "verdict_a": verdict_a,
                    "verdict_b": verdict_b,
                    "reading": reading(lo, hi, verdict_a, verdict_b),
                    "n_a": res_a.n_examples,
                    "n_b": res_b.n_examples,
                }
            )
    out = pd.DataFrame(rows, columns=COLUMNS)
    out.attrs |= {"n_boot": int(n_boot), "seed": int(seed), "alpha": float(alpha)}
    return out


# -------------------------------------------------------------------------------------------------------- files
def _fmt(x: object) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def model_dependence_markdown(df: pd.DataFrame, names: tuple[str, str] = ("A", "B")) -> str:
    """The table as markdown, with the reading rule beside it."""
    a, b = names
    n_boot, seed, alpha = (df.attrs.get(k) for k in ("n_boot", "seed", "alpha"))
    level = f"{100 * (1 - alpha):.0f}%" if alpha is not None else "95%"
    lines = [
        f"# Model dependence: {a} - {b}",
        "",
        f"Per claim, each model's estimate and the difference {a} - {b} with a {level} percentile interval from "
        f"{n_boot if n_boot is not None else 'n_boot'} bootstrap resamples, each model's examples resampled "
        f"independently (example clusters; seed {seed if seed is not None else 'n/a'} for {a}, +1 for {b}). "
        "Accuracy differences, drops and recovery areas are in points; coverage and AUROC are fractions.",
        "",
        "Reading (declared in advance): **model-dependent** if the interval excludes zero and the verdicts differ; "
        "**same verdict, sizes differ** if it excludes zero and the verdicts are equal; **not distinguishable at "
        "this power** if it includes zero.",
        "",
    ]
    header = [
        *("claim", "metric", a, b, f"{a} - {b}", f"{level} CI"),
        *(f"verdict {a}", f"verdict {b}", "reading", f"n {a}", f"n {b}"),
    ]
    rows = [
        [
            *(f"{r['claim']}", f"{r['metric']}", _fmt(r["estimate_a"]), _fmt(r["estimate_b"])),
            *(_fmt(r["difference"]), f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]"),
            *(f"{r['verdict_a']}", f"{r['verdict_b']}", f"{r['reading']}", f"{r['n_a']}", f"{r['n_b']}"),
        ]
        for r in df.to_dict(orient="records")
    ]
    lines.append(markdown_table(pd.DataFrame(rows, columns=header), parse_numbers=False))
    return "\n".join(lines) + "\n"


def write_model_dependence(
    df: pd.DataFrame, out_dir: str | Path, names: tuple[str, str] = ("A", "B")
) -> dict[str, Path]:
    """model_dependence.csv and model_dependence.md in out_dir, each written atomically, from the table rounded to
    ten significant digits (as every table `make analyze` writes: the same bytes on any CPU)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "model_dependence.csv", "md": out / "model_dependence.md"}
    rounded = round_frame(df)
    atomic_text(rounded.to_csv(index=False), paths["csv"])
    atomic_text(model_dependence_markdown(rounded, names), paths["md"])
    return paths
