"""Study 5's pilot rule (preregistration/study5/PLAN.md section 3), applied to both models' pilot records: the
variant, R and form of the agreement signal, and N per model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvcert.studies.study5.signals import (
    FORMS,
    VARIANTS,
    agreement_score,
    cells,
    pooled_within_cell_auroc,
    within_cell_escalated,
)

PRIMARY_BUDGET, RATE = 0.5, 0.2
TOLERANCE = 0.02  # the cheapest candidate within this of the best AUROC is chosen
MIN_FAILURES = 10  # below this at budget 0.5, budgets 0.5 and 0.25 are pooled
HALF_WIDTH, CONFIRMATORY_SHARE = 0.025, 0.7
N_MIN, N_MAX = 480, 720


def _at(frame: pd.DataFrame, budgets: tuple[float, ...]) -> list[pd.DataFrame]:
    return [frame[np.isclose(frame["budget"], b)].reset_index(drop=True) for b in budgets]


def candidates() -> list[tuple[str, str]]:
    """(variant, form) by cost: split < r2 < r3 < r4; alone before combined."""
    return [(v, f) for v in VARIANTS for f in FORMS]


def criterion(frames: dict[str, pd.DataFrame], variant: str, form: str, budgets: tuple[float, ...]) -> float:
    parts = [part for frame in frames.values() for part in _at(frame, budgets)]
    return pooled_within_cell_auroc(parts, [agreement_score(p, variant, form) for p in parts])[0]


def paired_sd(frames: dict[str, pd.DataFrame], variant: str, form: str) -> float:
    """SD over both models' pilot examples at budget 0.5 of correct(chosen) - correct(confidence) under within-cell
    escalation at 20%."""
    diffs = []
    for frame in frames.values():
        (at,) = _at(frame, (PRIMARY_BUDGET,))
        full, own = at["full_correct"].to_numpy(float), at["correct"].to_numpy(float)
        esc_a = within_cell_escalated(at, agreement_score(at, variant, form), RATE)
        esc_b = within_cell_escalated(at, at["confidence"].to_numpy(np.float64), RATE)
        diffs.append(np.where(esc_a, full, own) - np.where(esc_b, full, own))
    d = np.concatenate(diffs)
    return float(d.std(ddof=1)) if len(d) > 1 else float("nan")


def n_per_cell(sd: float, n_cells: int) -> int:
    n = math.ceil((1.96 * sd / HALF_WIDTH) ** 2 / CONFIRMATORY_SHARE) if math.isfinite(sd) else N_MAX
    n = min(max(n, N_MIN), N_MAX)
    return math.ceil(n / n_cells)


def choose(frames: dict[str, pd.DataFrame]) -> dict:
    """Section 3's choice: {variant, draws, form, n_per_cell {model: n}, report}."""
    failures = sum(
        int((at["full_correct"].astype(bool) & ~at["correct"].astype(bool)).sum())
        for frame in frames.values()
        for at in _at(frame, (PRIMARY_BUDGET,))
    )
    budgets = (PRIMARY_BUDGET,) if failures >= MIN_FAILURES else (PRIMARY_BUDGET, 0.25)
    scores = {f"{v}/{f}": criterion(frames, v, f, budgets) for v, f in candidates()}
    best = max(s for s in scores.values() if math.isfinite(s))
    chosen = next(c for c in candidates() if scores[f"{c[0]}/{c[1]}"] >= best - TOLERANCE)
    variant, form = chosen
    sd = paired_sd(frames, variant, form)
    n = {tag: n_per_cell(sd, len(np.unique(cells(frame)))) for tag, frame in frames.items()}
    report = dict(
        failures_at_primary_budget=failures,
        budgets=list(budgets),
        within_cell_auroc={k: round(v, 4) for k, v in scores.items()},
        best=round(best, 4),
        paired_sd=round(sd, 4),
        examples={tag: int(frame["example_id"].nunique()) for tag, frame in frames.items()},
    )
    return dict(
        variant="split" if variant == "split" else "independent",
        draws=2 if variant == "split" else int(variant[1:]),
        form=form,
        n_per_cell=n,
        report=report,
    )
