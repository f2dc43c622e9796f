"""Study 5's signals and escalation rules over its records (preregistration/study5/PLAN.md sections 3, 5, 6): plain
pandas / numpy. One frame = the rows of one budget; every function leaves the records unchanged.

Scores (larger: escalate first): `agreement_score` (a variant's disagreement, alone or combined with confidence by
reference-set CDF values), `confidence`, `certificate`, the answer-level flag `differs_<variant>` (as recorded: end
tokens compared) and `answers_differ_score` (the draws' answers compared), random.

Overall escalation with a threshold from the calibration split: `above` (strict, the pre-registered rule of every
claim: a score equal to the threshold never escalates) and `above_or_drawn` (ties at the threshold escalate by a
seeded draw that holds the rate, the rule of kvcert.serve.escalator).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from kvcert.studies.study4.analysis import in_calibration_split, within_cell_auroc

VARIANTS = ("split", "r2", "r3", "r4")  # by cost: the split halves hold one draw's KV; r<R>: R independent draws
FORMS = ("alone", "combined")
RANDOM_SEED = 20260101
TIE_SEED = 20260102  # the draw among scores tied at an overall threshold (above_or_drawn)


def cells(frame: pd.DataFrame) -> np.ndarray:
    return (frame["task"].astype(str) + "@" + frame["context_tokens"].astype(str)).to_numpy()


def with_split(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame.copy()
    out["split"] = np.where(out["example_id"].map(in_calibration_split), "calibration", "confirmatory")
    out["cache_failure"] = out["full_correct"].astype(bool) & ~out["correct"].astype(bool)
    return out


def ecdf(reference: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Share of the reference's finite values <= each value (NaN stays NaN)."""
    ref = np.sort(reference[np.isfinite(reference)])
    out = np.searchsorted(ref, values, side="right") / max(len(ref), 1)
    return np.where(np.isfinite(values), out, np.nan)


def agreement_score(frame: pd.DataFrame, variant: str, form: str, reference: pd.DataFrame | None = None) -> np.ndarray:
    """The agreement signal: the variant's disagreement ("alone"), or the mean of the CDF values of disagreement and
    confidence over `reference` (default: the frame itself) at the same budget ("combined")."""
    if variant not in VARIANTS or form not in FORMS:
        raise ValueError(f"agreement {variant}/{form}: variant one of {VARIANTS}, form one of {FORMS}")
    column = f"disagreement_{variant}"
    dis = frame[column].to_numpy(np.float64)
    if form == "alone":
        return dis
    ref = frame if reference is None else reference
    conf = frame["confidence"].to_numpy(np.float64)
    return (ecdf(ref[column].to_numpy(np.float64), dis) + ecdf(ref["confidence"].to_numpy(np.float64), conf)) / 2


def seeded_uniform(ids, seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per id from the SHA-256 of the seed and the id: the same for an id in any frame."""

    def u(example_id: str) -> float:
        return int(hashlib.sha256(f"{seed}|{example_id}".encode()).hexdigest()[:15], 16) / 16**15

    return np.array([u(str(i)) for i in ids], np.float64)


def random_score(frame: pd.DataFrame) -> np.ndarray:
    """A seeded uniform number in [0, 1) per example id (its SHA-256 with the seed): the same for an id in any frame,
    so a threshold fitted on the calibration split means the same on the confirmatory split."""
    return seeded_uniform(frame["example_id"], RANDOM_SEED)


def answers_differ_score(frame: pd.DataFrame, variant: str) -> np.ndarray:
    """The answer-level flag from the draws' own answers (texts up to the stop, `draw_answers`): the share of draws
    1..R-1 whose answer differs from draw 0's (`kvcert.core.agreement.answers_differ`). Independent draws only (the
    split halves decode no answer of their own): for "split" the recorded `differs_split`."""
    from kvcert.core.agreement import answers_differ

    if variant == "split":
        return frame["differs_split"].to_numpy(np.float64)
    r = int(variant.removeprefix("r"))
    return np.array([answers_differ(a[0], list(a[1:r])) for a in frame["draw_answers"]], np.float64)


def within_cell_escalated(frame: pd.DataFrame, scores: np.ndarray, rate: float) -> np.ndarray:
    """Inside each task x length cell, the round(rate n_cell) highest-scored rows (ties: the earlier example id; a
    NaN score is never preferred)."""
    esc = np.zeros(len(frame), bool)
    c = cells(frame)
    ids = frame["example_id"].to_numpy()
    for cell in np.unique(c):
        idx = np.flatnonzero(c == cell)
        s = np.where(np.isfinite(scores[idx]), scores[idx], -np.inf)
        order = np.lexsort((ids[idx], -s))  # by score descending, then id
        esc[idx[order[: round(rate * len(idx))]]] = True
    return esc


def outcome(frame: pd.DataFrame, escalated: np.ndarray, kv_column: str) -> pd.DataFrame:
    """Per row: correct after escalation (the full cache's answer where escalated), KV held (the full cache's where
    escalated, else the system's `kv_column`), escalated (a fraction for the cell rule's last cell)."""
    esc = np.asarray(escalated, dtype=float)
    full, own = frame["full_correct"].to_numpy(float), frame["correct"].to_numpy(float)
    kv_full, kv_own = frame["full_kv_bytes"].to_numpy(float), frame[kv_column].to_numpy(float)
    return pd.DataFrame(
        dict(correct=esc * full + (1 - esc) * own, kv=esc * kv_full + (1 - esc) * kv_own, escalated=esc),
        index=frame.index,
    )


def threshold(calibration_scores: np.ndarray, rate: float) -> float:
    finite = calibration_scores[np.isfinite(calibration_scores)]
    return float(np.quantile(finite, 1 - rate)) if len(finite) else float("inf")


def above(scores: np.ndarray, cut: float) -> np.ndarray:
    """Strictly above the threshold (the pre-registered rule of every claim): a score equal to it never escalates, so
    a score with few values whose threshold is its largest value escalates nothing (the "differs" flag)."""
    return np.isfinite(scores) & (scores > cut)


def tie_probability(calibration_scores: np.ndarray, cut: float, rate: float) -> float:
    """The probability p = (rate n - above) / equal, clipped to [0, 1], with which a score equal to the threshold
    escalates (n, above, equal: the calibration split's finite scores, those strictly above and those equal to it),
    so the calibration's expected escalated share is `rate`; `rate` when no calibration score equals it
    (kvcert.serve.escalator's tie rule)."""
    finite = calibration_scores[np.isfinite(calibration_scores)]
    equal, over = int((finite == cut).sum()), int((finite > cut).sum())
    if equal == 0:
        return float(rate)
    return float(min(1.0, max(0.0, (rate * len(finite) - over) / equal)))


def above_or_drawn(
    scores: np.ndarray, cut: float, calibration_scores: np.ndarray, rate: float, ids, seed: int = TIE_SEED
) -> np.ndarray:
    """Above the threshold, or equal to it and drawn: a tied row escalates when its seeded uniform number
    (`seeded_uniform(ids, seed)`, per id) is below `tie_probability`. Deterministic for a seed."""
    p = tie_probability(calibration_scores, cut, rate)
    tied = np.isfinite(scores) & (scores == cut) & (seeded_uniform(ids, seed) < p)
    return above(scores, cut) | tied


def cell_rule(calibration: pd.DataFrame, frame: pd.DataFrame, count: float) -> np.ndarray:
    """The task x length cells ordered by the accuracy escalation gained in them on the calibration split (full
    correct minus draw-0 correct, mean per example; ties by cell name), escalated in that order up to `count` rows of
    `frame`, the last cell in part (each of its rows counts the fraction still to fill)."""
    gain = (
        (calibration["full_correct"].astype(float) - calibration["correct"].astype(float))
        .groupby(cells(calibration))
        .mean()
    )
    order = sorted(gain.index, key=lambda c: (-gain[c], c))
    c = cells(frame)
    order += sorted(set(c) - set(order))  # a cell without calibration rows comes last
    esc = np.zeros(len(frame), float)
    left = float(count)
    for cell in order:
        at = c == cell
        n = int(at.sum())
        if left <= 0 or n == 0:
            continue
        esc[at] = min(1.0, left / n)
        left -= n
    return esc


def pooled_within_cell_auroc(frames: list[pd.DataFrame], scores: list[np.ndarray]) -> tuple[float, int]:
    """Within-cell AUROC for a cache-induced failure among rows the full cache got right, pairs of every frame
    together (a frame's cells kept apart from another's); and the number of failures."""
    labels, values, keys = [], [], []
    for k, (frame, s) in enumerate(zip(frames, scores)):
        right = frame["full_correct"].to_numpy(bool)
        labels.append((~frame["correct"].to_numpy(bool))[right])
        values.append(np.where(np.isfinite(s), s, -np.inf)[right])
        keys.append(np.array([f"{k}|{c}|{b:g}" for c, b in zip(cells(frame), frame["budget"])])[right])
    lab, val, key = np.concatenate(labels), np.concatenate(values), np.concatenate(keys)
    return float(within_cell_auroc(lab, val, key)), int(lab.sum())
