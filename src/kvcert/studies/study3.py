"""Study 3's own secondary predictions (preregistration/study3/PLAN.md section 4) and its side-by-side report.

- S6a / S6b / S6b_t075 / S6c: C2's and C1's comparisons at tail fraction 0.25, each a spec in the model's
  predictions file evaluated by the locked claim code (kvcert.analysis.claims.evaluate_claim) on the same records
  as the claims; S6c adds the pre-declared comparison with C1's coverage (|coverage t0.25 - coverage t0.75| <= 0.03
  on the point estimates) and the mean relative error and certificate score of both tail fractions.
- C5: evaluated the same way and reported as "undecidable at this scale" (PLAN.md section 5), never as a verdict.

`study3_report` runs kvcert.studies.model_dependence over the two models' records and writes
results/study3/model_dependence.{csv,md}; `kvcert.studies.analyze.combine` puts its rows into results/scorecard.*.
Pure pandas over records (no model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from kvcert.analysis import accuracy, claims

S6_IDS = ("S6a", "S6b", "S6b_t075", "S6c")
MODEL_NAMES = ("SmolLM2-135M", "Gemma3-270M")  # model A, model B of the difference (PLAN.md section 6)


def _result(cid: str, examples: pd.DataFrame, steps: pd.DataFrame | None, spec: Mapping) -> dict:
    r = claims.evaluate_claim(cid, examples, steps, spec)
    status = {"supported": "met", "refuted": "failed"}.get(r.verdict, "undecided")
    return {
        "estimate": r.observed,
        "lo": r.ci[0],
        "hi": r.ci[1],
        "status": status,
        "prediction": str(spec.get("prediction") or spec.get("claim") or ""),
        "n_examples": r.n_examples,
        "conditions": r.conditions,
    }


def _mean_of(examples: pd.DataFrame, rows: Mapping, column: str) -> float:
    kept, _ = claims.exclude_nonfinite(examples)
    values = accuracy.select_rows(kept, rows)[column].astype(float)
    return float(values.mean()) if len(values) else math.nan


def evaluate_study3_secondary(examples: pd.DataFrame, steps: pd.DataFrame | None, document: Mapping) -> dict:
    """S6a-S6c and C5 (descriptive) from one model's records and its parsed predictions file."""
    secondary = document.get("secondary") or {}
    out: dict[str, dict] = {}
    for sid in S6_IDS:
        if sid in secondary:
            spec = secondary[sid]
            out[sid] = _result(sid, examples, steps if spec["analysis"] == "coverage" else None, spec)
    if "S6c" in out:
        c1_rows = dict(document["claims"]["C1"]["rows"])
        c1 = _result("C1", examples, steps, document["claims"]["C1"])
        band = float(secondary["S6c"].get("band_vs_c1", 0.03))
        gap = out["S6c"]["estimate"] - c1["estimate"]
        out["S6c"] |= {
            "coverage_t075": c1["estimate"],
            "coverage_gap": gap,
            "status": "met" if abs(gap) <= band else "failed",  # the pre-declared band, on point estimates
            "rel_error_mean_t025": _mean_of(examples, secondary["S6c"]["rows"], "rel_error_mean"),
            "rel_error_mean_t075": _mean_of(examples, c1_rows, "rel_error_mean"),
            "cert_score_t025": _mean_of(examples, secondary["S6c"]["rows"], "cert_score"),
            "cert_score_t075": _mean_of(examples, c1_rows, "cert_score"),
        }
    if "C5" in secondary:
        out["C5"] = _result("C5", examples, None, secondary["C5"]) | {
            "status": str(secondary["C5"].get("status", "undecidable at this scale"))
        }
    return out


def study3_report(
    records: Mapping[str, tuple[pd.DataFrame, pd.DataFrame]],
    documents: Mapping[str, Mapping],
    cards: Mapping[str, Mapping],
    out: Path,
) -> pd.DataFrame:
    """The model-dependence table (kvcert.studies.model_dependence) of the two study-3 models -> out/
    model_dependence.{csv,md}. records / documents / cards are keyed by study id (study3_smollm2, study3_gemma3),
    records = (examples, steps) as the claims read them."""
    from kvcert.studies.model_dependence import CLAIMS, model_dependence, write_model_dependence

    a, b = "study3_smollm2", "study3_gemma3"
    verdicts = {sid: {str(c["id"]): str(c.get("verdict")) for c in cards[sid].get("claims", [])} for sid in (a, b)}
    settings = documents[a].get("model_dependence") or {}
    both = set(documents[a]["claims"]) & set(documents[b]["claims"])
    ids = [cid for cid in settings.get("claims", CLAIMS) if cid in both]
    table = model_dependence(
        {cid: records[a] for cid in ids},
        {cid: records[b] for cid in ids},
        {cid: documents[a]["claims"][cid] for cid in ids},
        {cid: documents[b]["claims"][cid] for cid in ids},
        verdicts[a],
        verdicts[b],
        n_boot=int(settings.get("n_boot", 2000)),
        seed=int(settings.get("bootstrap_seed", 20260101)),
        claim_ids=tuple(ids),
    )
    table.insert(2, "model_a", MODEL_NAMES[0])
    table.insert(3, "model_b", MODEL_NAMES[1])
    write_model_dependence(table, out, names=MODEL_NAMES)
    return table
