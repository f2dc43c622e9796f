"""Synthetic records with known answers, shared by the analysis tests (tests/test_analysis_*.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.claims import find_tbd, load_predictions

ROOT = Path(__file__).resolve().parents[1]
NB = 200  # bootstrap resamples in tests: enough for the checks, fast
# the locked design parameters, as predictions.yaml states them (synthetic rows must match its row filters)
DESIGN = {
    k: float(load_predictions(ROOT / "preregistration" / "predictions.yaml")["C1"]["rows"][k])
    for k in ("tail_fraction", "floor", "score_power")
}


def row(**over) -> dict:
    """One examples row with every schema column; overrides replace defaults."""
    base = {
        "run": "r0",
        "example_id": "e0",
        "task": "niah_single",
        "context_tokens": 1500,
        "depth": 0.5,
        "variant": "v",
        "scorer": "window_question",
        "design": "randomized",
        "budget": 0.5,
        **DESIGN,
        "seed": 0,
        "question_aware": True,
        "kept_tokens": 750.0,
        "answer": "a",
        "gold": "a",
        "score": 1.0,
        "correct": True,
        "full_correct": True,
        "n_answer_tokens": 4,
        "logprob_mean": -0.5,
        "logprob_min": -1.0,
        "has_certificate": True,
        "cert_score": 0.1,
        "rel_error_mean": 0.05,
        "covered95": 1.0,
        "steps95": 10,
        "steps_total": 10,
    }
    base.update(over)
    base["variant"] = f"{base['scorer']}/{base['design']}/{base['budget']}/{base['seed']}"
    if base["design"] in ("topk", "full"):
        base["has_certificate"] = False
        base["cert_score"] = float("nan")
        base["covered95"] = float("nan")
        base["tail_fraction"] = base["floor"] = base["score_power"] = float("nan")
    return base


def synthetic_examples(
    n: int = 300,
    seed: int = 0,
    cert_signal: float = 3.0,
    conf_signal: float = 0.0,
    rand_penalty: float = 0.0,
    keep: dict | None = None,
    scorers=("window_question",),
    budgets=(0.25, 0.5, 0.75),
) -> pd.DataFrame:
    """Full cache correct w.p. 0.8; a policy at budget b stays correct iff u_example < keep[b] (u shared across
    designs and budgets, so larger budgets fix a nested set). The certificate is high on cache-induced failures
    by cert_signal standard deviations, the confidence (-logprob) by conf_signal."""
    keep = keep or {0.25: 0.3, 0.5: 0.6, 0.75: 0.85}
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        eid = f"e{i:04d}"
        full = bool(rng.random() < 0.8)
        u = rng.random()
        rows.append(
            row(
                example_id=eid,
                scorer="none",
                design="full",
                budget=1.0,
                correct=full,
                full_correct=full,
                logprob_mean=-rng.random(),
            )
        )
        for scorer in scorers:
            for b in budgets:
                for design in ("topk", "randomized"):
                    ok = full and u < keep[b] - (rand_penalty if design == "randomized" else 0.0)
                    induced = full and not ok
                    rows.append(
                        row(
                            example_id=eid,
                            scorer=scorer,
                            design=design,
                            budget=b,
                            correct=ok,
                            full_correct=full,
                            cert_score=float(rng.normal() + cert_signal * induced),
                            logprob_mean=float(-(rng.normal() + conf_signal * induced)),
                        )
                    )
    return pd.DataFrame(rows)


def synthetic_steps(examples: pd.DataFrame, inflate: float = 1.0, cells: int = 30, seed: int = 0) -> pd.DataFrame:
    """Per certified row, cells with error = inflate * sd * |N(0,1)|: inflate 1 gives coverage 0.95 exactly
    in expectation (a one-dimensional error with exact variance)."""
    rng = np.random.default_rng(seed)
    ex = examples[examples["has_certificate"]]
    n = len(ex) * cells
    var = np.exp(rng.normal(size=n))
    err = inflate * np.sqrt(var) * np.abs(rng.normal(size=n))
    rep = ex.loc[ex.index.repeat(cells), ["run", "example_id", "variant"]].reset_index(drop=True)
    return rep.assign(
        step=np.tile(np.arange(cells) // 6, len(ex)),
        layer=np.tile(np.arange(cells) % 6, len(ex)),
        head=0,
        error=err,
        variance=var,
        radius95=1.96 * np.sqrt(var),
        out_norm=1.0,
        tail_mass=rng.random(n) * 0.2,
        p_max=rng.random(n),
    )


def filled_spec(claim_id: str, budget: float = 0.5) -> dict:
    """The predictions.yaml entry, n_boot small; a claim analysed at one budget (C4, C6, C7) is moved to `budget`,
    where the synthetic records have failures of both kinds in numbers (placeholders, if any, are filled too)."""
    spec = copy.deepcopy(load_predictions(ROOT / "preregistration" / "predictions.yaml")[claim_id])

    def fill(obj):
        if isinstance(obj, dict):
            return {
                k: (DESIGN[k] if v == "TBD_PILOT" and k in DESIGN else budget if v == "TBD_PILOT" else fill(v))
                for k, v in obj.items()
            }
        return obj

    spec = fill(spec)
    if isinstance(spec.get("rows", {}).get("budget"), (int, float)):
        spec["rows"]["budget"] = budget
    spec["n_boot"] = NB
    assert not find_tbd(spec)
    return spec
