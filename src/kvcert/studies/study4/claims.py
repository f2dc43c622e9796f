"""Study 4's claims and verdicts (preregistration/study4/PLAN.md section 5), pure pandas over the answers of
`kvcert.studies.study4.collect`, by the decision rules in `preregistration/study4/predictions_<model>.yaml`.

Every claim is decided on the confirmatory split (examples whose id hash puts them outside the calibration split);
thresholds, the combined model, KV-matched rates and tolerance choices come from the calibration split only.
Each claim's interval is a paired example-cluster percentile bootstrap (2000 resamples, seed 20260101). Decision
rules, one per claim (`rule` in the predictions file):

- `margin`  (P1, P2): supported when lo > 0 and the estimate >= margin; refuted when hi < margin; else inconclusive.
- `positive` (P3, P4, C5): supported when lo > 0; refuted when hi < 0; else inconclusive.
- `less_kv` (P5): the tolerance rule's mean KV over the fixed budget's (a ratio, tolerance chosen on the calibration
  split as the largest whose accuracy there is at least the fixed budget's); supported when the ratio's hi < 1 and
  the accuracy difference's lo > -margin; refuted when the ratio's lo >= 1; else inconclusive.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from kvcert.analysis.bootstrap import bootstrap_many, paired_difference, weighted_mean
from kvcert.studies.study4.analysis import (
    BOOT_SEED,
    N_BOOT,
    add_scores,
    in_calibration_split,
    policy_outcomes,
    within_cell_auroc,
)

LADDER = (0.125, 0.25, 0.5)  # the tolerance rule's rungs below the full cache (DEFAULT_LADDER of kvcert.serve.probe)
TOLERANCE_GRID = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5)


def split(answers: pd.DataFrame) -> pd.DataFrame:
    out = answers.copy()
    out["split"] = np.where(out["example_id"].map(in_calibration_split), "calibration", "confirmatory")
    return out


def scored(answers: pd.DataFrame, budget: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(calibration rows, confirmatory rows sorted by id) at one budget, with every signal's score column."""
    at = split(answers)
    at = at[np.isclose(at["budget"], budget)]
    rows = add_scores(at, at[at["split"] == "calibration"])
    cal = rows[rows["split"] == "calibration"]
    conf = rows[rows["split"] == "confirmatory"].sort_values("example_id").reset_index(drop=True)
    return cal, conf


def escalation_difference(answers: pd.DataFrame, budget: float, rate: float, a: str, b: str) -> dict:
    """Accuracy (points) of escalating by signal a minus by signal b at one rate; thresholds from calibration."""
    cal, conf = scored(answers, budget)
    ra, _ = policy_outcomes(conf, cal, a, rate)
    rb, _ = policy_outcomes(conf, cal, b, rate)
    ca, cb = ra["correct"].to_numpy(), rb["correct"].to_numpy()
    ci = paired_difference(
        weighted_mean(ca), weighted_mean(cb), conf["example_id"], N_BOOT, BOOT_SEED, diff=weighted_mean(ca - cb)
    )["diff"].scaled(100)
    return dict(
        estimate=ci.estimate,
        lo=ci.lo,
        hi=ci.hi,
        n=len(conf),
        realized_rate={a: float(ra["escalated"].mean()), b: float(rb["escalated"].mean())},
    )


def _cells(frame: pd.DataFrame) -> np.ndarray:
    return (frame["task"].astype(str) + "@" + frame["context_tokens"].astype(str)).to_numpy()


def within_cell_gain(answers: pd.DataFrame, budget: float, rate: float, a: str, b: str) -> dict:
    """Inside each task x length cell, escalate the round(rate n_cell) confirmatory examples with the highest score
    (a rank, no threshold: context length cannot choose whom to escalate); accuracy of a minus b, points."""
    _, conf = scored(answers, budget)
    cells = _cells(conf)

    def correct(signal: str) -> np.ndarray:
        esc = np.zeros(len(conf), bool)
        for cell in np.unique(cells):
            idx = np.flatnonzero(cells == cell)
            scores = conf[f"score_{signal}"].to_numpy(np.float64)[idx]
            scores = np.where(np.isfinite(scores), scores, -np.inf)
            k = round(rate * len(idx))
            esc[idx[np.argsort(-scores, kind="stable")[:k]]] = True
        return np.where(esc, conf["full_correct"], conf["correct"]).astype(float)

    ca, cb = correct(a), correct(b)
    ci = paired_difference(
        weighted_mean(ca), weighted_mean(cb), conf["example_id"], N_BOOT, BOOT_SEED, diff=weighted_mean(ca - cb)
    )["diff"].scaled(100)
    return dict(estimate=ci.estimate, lo=ci.lo, hi=ci.hi, n=len(conf))


def within_cell_auroc_difference(answers: pd.DataFrame, budget: float, a: str, b: str) -> dict:
    """AUROC(a) - AUROC(b) for a cache-induced failure among confirmatory examples the full cache got right,
    counting only pairs inside one task x length cell; example-cluster bootstrap."""
    _, conf = scored(answers, budget)
    right = conf[conf["full_correct"].astype(bool)].reset_index(drop=True)
    labels = right["cache_failure"].to_numpy(bool)
    cells = _cells(right)
    sa, sb = (right[f"score_{s}"].to_numpy(np.float64) for s in (a, b))
    ok = np.isfinite(sa) & np.isfinite(sb)

    def auroc_of(scores: np.ndarray):
        def stat(w: np.ndarray) -> float:
            keep = ok & (w > 0)
            rep = np.repeat(np.arange(len(w)), w.astype(int))  # a resampled example counts as often as drawn
            rep = rep[keep[rep]]
            return within_cell_auroc(labels[rep], scores[rep], cells[rep])

        return stat

    res = bootstrap_many(
        {"a": auroc_of(sa), "b": auroc_of(sb)},
        right["example_id"],
        N_BOOT,
        BOOT_SEED,
        derived={"diff": lambda v: v["a"] - v["b"]},
    )
    d = res["diff"]
    return dict(
        estimate=d.estimate,
        lo=d.lo,
        hi=d.hi,
        n=int(ok.sum()),
        n_cache_failures=int(labels[ok].sum()),
        auroc_a=res["a"].estimate,
        auroc_b=res["b"].estimate,
    )


def tolerance_choice(frame: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Per example: the smallest ladder budget whose probe error is <= tolerance (else the full cache), with that
    budget's correctness and KV bytes; frame holds every ladder budget's rows of the examples."""
    out = []
    for example_id, group in frame.sort_values("budget").groupby("example_id", sort=True):
        rungs = group[group["budget"].isin(LADDER)]
        within = rungs[rungs["probe_error"] <= tolerance]
        first = group.iloc[0]
        if len(within):
            row = within.iloc[0]
            out.append((example_id, float(row["budget"]), bool(row["correct"]), float(row["kv_bytes"])))
        else:
            out.append((example_id, 1.0, bool(first["full_correct"]), float(first["full_kv_bytes"])))
    return pd.DataFrame(out, columns=["example_id", "budget", "correct", "kv_bytes"])


def fixed_budget(frame: pd.DataFrame, budget: float) -> pd.DataFrame:
    at = frame[np.isclose(frame["budget"], budget)].sort_values("example_id")
    return pd.DataFrame(
        dict(
            example_id=at["example_id"].to_numpy(),
            budget=budget,
            correct=at["correct"].astype(bool).to_numpy(),
            kv_bytes=at["kv_bytes"].astype(float).to_numpy(),
        )
    )


def tolerance_against_fixed(answers: pd.DataFrame, budget: float, margin: float) -> dict:
    """P5 at one fixed budget: the tolerance chosen on the calibration split (the largest in TOLERANCE_GRID whose
    accuracy there is >= the fixed budget's), then on the confirmatory split the ratio of mean KV bytes (tolerance /
    fixed) and the accuracy difference (points), one bootstrap."""
    frame = split(answers)
    cal, conf = frame[frame["split"] == "calibration"], frame[frame["split"] == "confirmatory"]
    target = fixed_budget(cal, budget)["correct"].mean()
    chosen = None
    for t in TOLERANCE_GRID:  # increasing: a larger tolerance takes smaller budgets
        if tolerance_choice(cal, t)["correct"].mean() >= target:
            chosen = t
    if chosen is None:
        chosen = TOLERANCE_GRID[0]
    tol, fix = tolerance_choice(conf, chosen), fixed_budget(conf, budget)
    tol = tol.set_index("example_id").loc[fix["example_id"]].reset_index()
    kv_t, kv_f = tol["kv_bytes"].to_numpy(), fix["kv_bytes"].to_numpy()
    acc_t, acc_f = tol["correct"].to_numpy(float), fix["correct"].to_numpy(float)

    def ratio(w: np.ndarray) -> float:
        return float(w @ kv_t / (w @ kv_f))

    res = bootstrap_many(
        {"kv_ratio": ratio, "accuracy_diff": weighted_mean(100 * (acc_t - acc_f))}, fix["example_id"], N_BOOT, BOOT_SEED
    )
    r, a = res["kv_ratio"], res["accuracy_diff"]
    return dict(
        estimate=r.estimate,
        lo=r.lo,
        hi=r.hi,
        accuracy_diff=a.estimate,
        accuracy_lo=a.lo,
        accuracy_hi=a.hi,
        tolerance=chosen,
        mean_budget=float(tol["budget"].mean()),
        share_full=float((tol["budget"] >= 1.0).mean()),
        n=len(fix),
        margin=margin,
    )


def verdict(rule: str, result: Mapping, margin: float = 0.0) -> str:
    lo, hi, est = result["lo"], result["hi"], result["estimate"]
    if not all(np.isfinite([lo, hi, est])):
        return "inconclusive"
    if rule == "margin":
        return "supported" if lo > 0 and est >= margin else "refuted" if hi < margin else "inconclusive"
    if rule == "positive":
        return "supported" if lo > 0 else "refuted" if hi < 0 else "inconclusive"
    if rule == "less_kv":
        if hi < 1 and result["accuracy_lo"] > -margin:
            return "supported"
        return "refuted" if lo >= 1 else "inconclusive"
    raise ValueError(f"unknown decision rule {rule!r}")


def evaluate_claim(answers: pd.DataFrame, spec: Mapping) -> dict:
    """One claim of a predictions file: its estimate, interval and verdict."""
    kind, budget, margin = spec["test"], float(spec["budget"]), float(spec.get("margin", 0.0))
    a, b, rate = spec.get("a"), spec.get("b"), spec.get("rate")
    if kind == "escalation":
        result = escalation_difference(answers, budget, float(rate), a, b)
    elif kind == "within_cell_gain":
        result = within_cell_gain(answers, budget, float(rate), a, b)
    elif kind == "within_cell_auroc":
        result = within_cell_auroc_difference(answers, budget, a, b)
    elif kind == "tolerance":
        result = tolerance_against_fixed(answers, budget, margin)
    else:
        raise ValueError(f"unknown study-4 test {kind!r}")
    return dict(result, verdict=verdict(spec["rule"], result, margin), unit=spec.get("unit", "points"))


def evaluate_claims(answers: pd.DataFrame, predictions: Mapping) -> dict[str, dict]:
    return {cid: evaluate_claim(answers, spec) for cid, spec in predictions["claims"].items()}


def token_reference_difference(answers: pd.DataFrame, reference: pd.DataFrame, budget: float, rate: float) -> dict:
    """The token-level reference beside P1: accuracy of answer-level certificate escalation minus today's token-level
    rule at the same threshold (they escalate the same examples; the token-level answer keeps the compressed prefix).
    reference: `kvcert.studies.study4.cli.token_reference`'s rows (example_id, correct)."""
    cal, conf = scored(answers, budget)
    answer_level, _ = policy_outcomes(conf, cal, "certificate", rate)
    ref = dict(zip(reference["example_id"], reference["correct"].astype(bool)))
    esc = answer_level["escalated"].to_numpy()
    missing = [i for i, e in zip(conf["example_id"], esc) if e and i not in ref]
    if missing:
        raise ValueError(f"token reference incomplete: {len(missing)} escalated examples missing (run token-reference)")
    token = np.where(esc, [ref.get(i, False) for i in conf["example_id"]], conf["correct"]).astype(float)
    ca = answer_level["correct"].to_numpy()
    ci = paired_difference(weighted_mean(ca), weighted_mean(token), conf["example_id"], N_BOOT, BOOT_SEED,
                           diff=weighted_mean(ca - token))  # fmt: skip
    d = ci["diff"].scaled(100)
    return dict(estimate=d.estimate, lo=d.lo, hi=d.hi, answer_level=100 * ca.mean(), token_level=100 * token.mean(),
                n=len(conf), escalated=int(esc.sum()))  # fmt: skip
