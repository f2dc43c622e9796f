"""The claims registry, and each pre-registered claim evaluated from its predictions.yaml entry.

The registry is predictions.yaml itself: its `claims` mapping gives the ids (in scorecard order) and each id's
experiment is the conf/claim/*.yaml file whose `claim.id` names it.

Everything that decides a verdict (which rows, which metric, threshold, direction, whether the interval or the point
estimate decides) is read from the spec entry; kvcert.analysis.claim_metrics computes each analysis kind's metrics
and this module applies the generic rule:

  a condition {metric, direction, threshold, support_on, refute_on} is
    met       when (support_on: ci)    the whole interval is on the predicted side of the threshold,
                   (support_on: point) the point estimate is on the predicted side;
    failed    when (refute_on: ci)     the whole interval is on the other side,
                   (refute_on: point)  the point estimate is on the other side and the condition is not met;
    undecided otherwise (also when the metric is NaN).
  verdict: supported when every `decision` condition is met, refuted when any is failed, inconclusive otherwise.
  `secondary` conditions are evaluated the same way and reported, but do not enter the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvcert.analysis.claim_metrics import ANALYSES

ROOT = Path(__file__).resolve().parents[3]
PREDICTIONS = ROOT / "preregistration" / "predictions.yaml"
CLAIM_CONF = ROOT / "conf" / "claim"
TBD = "TBD_PILOT"
VERDICTS = ("supported", "refuted", "inconclusive")
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda x, t: x >= t,
    ">": lambda x, t: x > t,
    "<=": lambda x, t: x <= t,
    "<": lambda x, t: x < t,
}


def load_predictions(path: str | Path = PREDICTIONS) -> dict[str, dict]:
    """The `claims` mapping of predictions.yaml: claim id -> spec entry."""
    data = yaml.safe_load(Path(path).read_text())
    return data["claims"]


def claim_ids(path: str | Path = PREDICTIONS) -> tuple[str, ...]:
    """Every claim id, in predictions.yaml order (the scorecard's order)."""
    return tuple(load_predictions(path))


@dataclass(frozen=True, kw_only=True)
class RegisteredClaim:
    """One pre-registered claim: its id, its experiment (conf/claim/<experiment>.yaml) and its spec entry."""

    id: str
    experiment: str
    spec: dict

    @property
    def analysis(self) -> str:
        return str(self.spec.get("analysis", ""))


def registry(predictions: str | Path = PREDICTIONS, conf_dir: str | Path = CLAIM_CONF) -> dict[str, RegisteredClaim]:
    """Claim id -> RegisteredClaim, ids from predictions.yaml, experiments found by their `claim.id` field."""
    experiments: dict[str, str] = {}
    for path in sorted(Path(conf_dir).glob("*.yaml")):
        cid = ((yaml.safe_load(path.read_text()) or {}).get("claim") or {}).get("id")
        if cid is not None:
            if cid in experiments:
                raise ValueError(f"claim {cid} has two experiments: {experiments[cid]}, {path.stem}")
            experiments[str(cid)] = path.stem
    specs = load_predictions(predictions)
    missing = [cid for cid in specs if cid not in experiments]
    if missing:
        raise ValueError(f"no conf/claim experiment with claim.id {', '.join(missing)}")
    return {cid: RegisteredClaim(id=cid, experiment=experiments[cid], spec=spec) for cid, spec in specs.items()}


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """One claim's outcome. as_dict() is its JSON form (claim_*.json, a scorecard row); conditions, secondary and
    metrics are left out when None (T1 has none), and a claim that was not evaluated keeps only its row keys."""

    id: str
    claim: str = ""
    prediction: str = ""
    primary_metric: str | None = None
    unit: str = ""
    observed: float | None = None
    ci: list = field(default_factory=lambda: [None, None])
    verdict: str = "inconclusive"
    paper_verdict: str | None = None
    paper_value: str | None = None
    agrees_with_paper: bool | None = None
    n_examples: int | None = None
    conditions: list | None = None
    secondary: list | None = None
    metrics: dict | None = None
    details: dict = field(default_factory=dict)
    evaluated: bool = True

    @classmethod
    def not_evaluated(cls, claim_id: str) -> ClaimResult:
        return cls(id=claim_id, evaluated=False, details={"reason": "not evaluated"})

    def as_dict(self) -> dict:
        if not self.evaluated:
            return {
                "id": self.id,
                "claim": self.claim,
                "prediction": self.prediction,
                "observed": self.observed,
                "ci": self.ci,
                "verdict": self.verdict,
                "paper_verdict": self.paper_verdict,
                "agrees_with_paper": self.agrees_with_paper,
                "evaluated": False,
                "details": self.details,
            }
        out = {
            "id": self.id,
            "claim": self.claim,
            "prediction": self.prediction,
            "primary_metric": self.primary_metric,
            "unit": self.unit,
            "observed": self.observed,
            "ci": self.ci,
            "verdict": self.verdict,
            "paper_verdict": self.paper_verdict,
            "paper_value": self.paper_value,
            "agrees_with_paper": self.agrees_with_paper,
            "n_examples": self.n_examples,
        }
        out |= {
            k: v
            for k, v in (("conditions", self.conditions), ("secondary", self.secondary), ("metrics", self.metrics))
            if v is not None
        }
        return out | {"details": self.details}


def find_tbd(obj: object, where: str = "") -> list[str]:
    """Paths inside a spec that still hold the TBD_PILOT placeholder."""
    if isinstance(obj, str):
        return [where or "."] if TBD in obj else []
    if isinstance(obj, Mapping):
        return [p for k, v in obj.items() for p in find_tbd(v, f"{where}.{k}" if where else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in find_tbd(v, f"{where}[{i}]")]
    return []


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def condition_status(metric: Mapping[str, float], condition: Mapping[str, object]) -> str:
    """'met' | 'failed' | 'undecided' for one condition (see the module docstring)."""
    op = _OPS[str(condition["direction"])]
    thr = float(condition["threshold"])
    est, lo, hi = metric.get("estimate"), metric.get("lo"), metric.get("hi")
    support_on = condition.get("support_on", "ci")
    refute_on = condition.get("refute_on", "ci")
    upward = str(condition["direction"]).startswith(">")
    # the interval end that must clear the threshold for support, and the one that must miss it for refutation
    near, far = (lo, hi) if upward else (hi, lo)

    decisive = est if support_on == "point" else near
    met = _finite(decisive) and op(decisive, thr)
    if refute_on == "point":
        failed = (not met) and _finite(est) and not op(est, thr)
    else:
        failed = _finite(far) and not op(far, thr)
    if met and not failed:
        return "met"
    if failed and not met:
        return "failed"
    return "undecided"


def decide(metrics: Mapping[str, Mapping[str, float]], conditions: list[Mapping[str, object]]) -> tuple[str, list]:
    """Verdict over the decision conditions, and each condition with its status and the metric it read."""
    if not conditions:
        raise ValueError("a claim needs at least one decision condition")
    evaluated = []
    for cond in conditions:
        name = str(cond["metric"])
        if name not in metrics:
            raise KeyError(f"decision refers to unknown metric {name!r}; known: {sorted(metrics)}")
        evaluated.append({**cond, "status": condition_status(metrics[name], cond), "value": dict(metrics[name])})
    statuses = [c["status"] for c in evaluated]
    if all(s == "met" for s in statuses):
        return "supported", evaluated
    if any(s == "failed" for s in statuses):
        return "refuted", evaluated
    return "inconclusive", evaluated


def exclude_nonfinite(examples: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """Drop rows whose generation or certificate produced NaN/inf (counted, never silent)."""
    lp = examples["logprob_mean"].to_numpy(np.float64)
    bad_lp = (examples["n_answer_tokens"].to_numpy() > 0) & ~np.isfinite(lp)
    bad_lp |= np.isinf(lp)
    has_cert = examples["has_certificate"].to_numpy(bool)
    bad_cert = has_cert & ~np.isfinite(examples["cert_score"].to_numpy(np.float64))
    # the runner flags rows where any logged quantity went non-finite before it was replaced by NaN
    flagged = examples["nonfinite"].to_numpy(bool) if "nonfinite" in examples else np.zeros(len(examples), bool)
    keep = ~(bad_lp | bad_cert | flagged)
    return examples.loc[keep], {
        "nonfinite_logprob": int(bad_lp.sum()),
        "nonfinite_certificate": int(bad_cert.sum()),
        "nonfinite_flagged": int(flagged.sum()),
        "excluded": int((~keep).sum()),
    }


def _agrees(verdict: str, paper_verdict: str | None) -> bool | None:
    """Agreement with the paper; None when our verdict is inconclusive (neither agrees nor disagrees)."""
    if verdict == "inconclusive" or paper_verdict is None:
        return None
    return verdict == paper_verdict


def evaluate_claim(
    claim_id: str, examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping[str, object]
) -> ClaimResult:
    """Metrics, verdict and details for one claim C1..C7 from its predictions.yaml entry."""
    pending = find_tbd(spec)
    if pending:
        raise ValueError(f"claim {claim_id}: predictions.yaml still holds {TBD} at {', '.join(pending)}")
    kind = str(spec["analysis"])
    if kind not in ANALYSES:
        raise ValueError(f"claim {claim_id}: unknown analysis {kind!r}; known: {sorted(ANALYSES)}")
    kept, excluded = exclude_nonfinite(examples)
    metrics, details, n_examples = ANALYSES[kind](kept, steps, spec)
    verdict, conditions = decide(metrics, list(spec["decision"]))
    secondary = [  # a secondary metric may be unavailable (e.g. conformal without step records): say so
        {
            **c,
            "status": condition_status(metrics[str(c["metric"])], c) if str(c["metric"]) in metrics else "unavailable",
        }
        for c in spec.get("secondary", [])
    ]
    primary = metrics[str(spec["primary_metric"])]
    return ClaimResult(
        id=claim_id,
        claim=spec.get("claim", ""),
        prediction=spec.get("prediction", ""),
        primary_metric=spec["primary_metric"],
        unit=spec.get("unit", ""),
        observed=primary["estimate"],
        ci=[primary.get("lo"), primary.get("hi")],
        verdict=verdict,
        paper_verdict=spec.get("paper_verdict"),
        paper_value=spec.get("paper_value"),
        agrees_with_paper=_agrees(verdict, spec.get("paper_verdict")),
        n_examples=n_examples,
        conditions=conditions,
        secondary=secondary,
        metrics=metrics,
        details=details | {"excluded_rows": excluded, "analysis": kind},
    )


def evaluate_t1(t1_result: Mapping[str, list], spec: Mapping[str, object]) -> ClaimResult:
    """T1 non-identifiability: the deterministic estimate stays constant while its true error grows, and the
    randomized mean V_hat tracks the MSE (ratio within spec['ratio_band'] at every lambda with MSE > 0)."""
    lam = np.asarray(t1_result["lambda"], dtype=np.float64)
    err = np.asarray(t1_result["true_error_deterministic"], dtype=np.float64)
    est = np.asarray(t1_result["estimate_deterministic"], dtype=np.float64)
    mse = np.asarray(t1_result["mse_randomized"], dtype=np.float64)
    vhat = np.asarray(t1_result["mean_vhat_randomized"], dtype=np.float64)
    lo_band, hi_band = (float(x) for x in spec["ratio_band"])
    rtol = float(spec.get("constant_rtol", 1e-6))
    min_growth = float(spec.get("min_error_growth", 2.0))

    sizes = {len(lam), len(err), len(est), len(mse), len(vhat)}
    arrays_ok = len(sizes) == 1 and len(lam) >= 2 and all(np.isfinite(a).all() for a in (lam, err, est, mse, vhat))
    checks: dict[str, bool] = {}
    ratio = np.full(len(mse), np.nan)
    if arrays_ok:
        order = np.argsort(lam)
        err, est, mse, vhat = err[order], est[order], mse[order], vhat[order]
        scale = max(float(np.abs(est).max()), 1e-12)
        checks["estimate_constant"] = bool(np.ptp(est) <= rtol * scale)
        growth = err[-1] / err[0] if err[0] > 0 else (np.inf if err[-1] > 0 else 1.0)
        checks["error_grows"] = bool(growth >= min_growth and np.all(np.diff(err) >= -rtol * max(err.max(), 1e-12)))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(mse > 0, vhat / mse, np.nan)
        checks["ratio_in_band"] = bool(
            np.isfinite(ratio).any()
            and np.all((ratio[np.isfinite(ratio)] >= lo_band) & (ratio[np.isfinite(ratio)] <= hi_band))
        )
        verdict = "supported" if all(checks.values()) else "refuted"
    else:
        verdict = "inconclusive"
        growth = float("nan")
    finite_ratio = ratio[np.isfinite(ratio)]
    observed = float(finite_ratio.mean()) if finite_ratio.size else float("nan")
    ci = [float(finite_ratio.min()), float(finite_ratio.max())] if finite_ratio.size else [None, None]
    paper = spec.get("paper_verdict")
    return ClaimResult(
        id="T1",
        claim=spec.get("claim", ""),
        prediction=spec.get("prediction", ""),
        primary_metric=spec.get("primary_metric", "mean_vhat_over_mse"),
        unit=spec.get("unit", "ratio"),
        observed=observed,
        ci=ci,
        verdict=verdict,
        paper_verdict=paper,
        paper_value=spec.get("paper_value"),
        agrees_with_paper=_agrees(verdict, paper),
        n_examples=None,
        details={
            "ci_kind": "range over lambda of mean V_hat / MSE (not a confidence interval)",
            "checks": checks,
            "error_growth": float(growth),
            "ratio": ratio.tolist(),
            "lambda": np.sort(lam).tolist(),
            "inputs_valid": bool(arrays_ok),
        },
    )
