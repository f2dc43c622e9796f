"""The combined scorecard's first table, one row per claim (the paper's verdict, ours over the study x model columns
that evaluated it, one line of reading), and the replication labels it and the per-study table use: `replication`
over the columns that evaluated a claim, `replication_preregistered` (the locked rule, a column that did not
evaluate it counting as open). Plain Python over the combined card (kvcert.studies.scorecard)."""

from __future__ import annotations

import math
from collections.abc import Mapping

T1_INTERVAL = "range over lambda of mean V_hat / MSE (not a confidence interval)"
NOT_EVALUATED = "not evaluated"
CONCLUSIVE = ("supported", "refuted")
REPLICATION = (
    "over the studies that evaluated the claim (one that did not is left out). our verdict replicated (k/k): all "
    "k >= 2 studies that evaluated it decided it the same way, supported or refuted (our verdict, the paper's or "
    "not: the first table says which); flipped: one supported it, another refuted it; "
    "open (n evaluated): otherwise, an inconclusive verdict among the n or fewer than two. 'pre-registered rule': the "
    "rule as study 2's PLAN.md section 6 wrote it for studies that each evaluated every claim, a study that did not "
    "evaluate the claim counting as open."
)


def _paper(row: Mapping) -> str:
    paper = str(row.get("paper_verdict") or "n/a")
    return paper + (f" ({row['paper_value']})" if row.get("paper_value") else "")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _evaluated(claim: Mapping | None) -> bool:
    return claim is not None and claim.get("evaluated", True) is not False


def _verdict(claim: Mapping | None) -> str:
    return str(claim.get("verdict")) if _evaluated(claim) else NOT_EVALUATED


def _interval_kind(claim: Mapping) -> str:
    kind = (claim.get("details") or {}).get("ci_kind")
    if kind:
        return str(kind)
    return T1_INTERVAL if claim.get("id") == "T1" else "95% example-cluster bootstrap percentile interval"


def replication_preregistered(verdicts: list[str]) -> str:
    """'replicated' | 'flipped' | 'open' over every study's verdict, NOT_EVALUATED counting as open (PLAN.md 6)."""
    if len(verdicts) >= 2 and len(set(verdicts)) == 1 and verdicts[0] in CONCLUSIVE:
        return "replicated"
    return "flipped" if {"supported", "refuted"} <= set(verdicts) else "open"


def replication(verdicts: list[str]) -> tuple[str, int]:
    """(label, how many studies evaluated the claim): the pre-registered rule over the studies that evaluated it, so
    a claim only some studies asked about is replicated when all of those decided it the same conclusive way."""
    evaluated = [v for v in verdicts if v != NOT_EVALUATED]
    return replication_preregistered(evaluated), len(evaluated)


def replication_text(row: Mapping) -> str:
    """'our verdict replicated (4/4)' (our verdict, which may be the paper's or not), 'open (1 evaluated)' (a card
    from before the count: the label alone)."""
    label, n = str(row["replication"]), row.get("replication_studies")
    shown = "our verdict replicated" if label == "replicated" else label
    return shown if n is None else f"{shown} ({n}/{n})" if label == "replicated" else f"{label} ({n} evaluated)"


def preregistered_text(row: Mapping) -> str:
    """The pre-registered rule's label, with why it reads open where the studies that evaluated the claim agree:
    the rule counts a study that did not evaluate the claim as open."""
    label = str(row.get("replication_preregistered"))
    cells = row.get("studies") or {}
    missing = sum(1 for c in cells.values() if not c.get("evaluated", True))
    if label == "open" and missing and row.get("replication") != "open":
        return f"open ({missing} not evaluated)"
    return label


def _model_name(sid: str) -> str:
    return "Gemma 3" if "gemma" in sid else "SmolLM2"  # studies 1-2 ran SmolLM2 only


def _where(sids: list[str]) -> str:
    """ "studies 1, 2, 3; SmolLM2, Gemma 3" for the study ids that evaluated a claim."""
    studies = list(dict.fromkeys(sid.split("_")[0].removeprefix("study") for sid in sids))
    models = list(dict.fromkeys(_model_name(sid) for sid in sids))
    return f"{'study' if len(studies) == 1 else 'studies'} {', '.join(studies)}; {', '.join(models)}"


def scorecard_title(card: Mapping) -> str:
    """ "Scorecard: studies 1, 2, 3, 4, 5 (8 columns; SmolLM2, Gemma 3)" for the card's study x model columns."""
    sids = list(card["studies"])
    where = _where(sids)
    studies, models = where.split("; ")
    columns = f"{len(sids)} column{'s' if len(sids) != 1 else ''}"
    return f"Scorecard: {studies} ({columns}; {models})"


def claim_summary_rows(card: Mapping) -> list[list[str]]:
    """One row per claim: the claim, the paper's verdict, ours (how many study x model columns decided which way,
    where), and one line reading them together."""
    rows = []
    for row in card["side_by_side"]:
        name = f"{row['id']}: {row['claim']}" if row.get("claim") else str(row["id"])
        done = [(sid, c["verdict"]) for sid, c in row["studies"].items() if c.get("evaluated", True)]
        paper = row.get("paper_verdict")
        if not done:
            rows.append([name, _paper(row), NOT_EVALUATED, "not evaluated by any study"])
            continue
        order = [v for v in (*CONCLUSIVE, "inconclusive") if any(x == v for _, x in done)]
        order += [v for v in dict.fromkeys(x for _, x in done) if v not in order]
        counts = {v: sum(1 for _, x in done if x == v) for v in order}
        if len(counts) == 1:
            ours = f"{done[0][1]} in {len(done)} of {len(done)}"
        else:
            ours = ", ".join(f"{v} {k}" for v, k in counts.items()) + f" of {len(done)}"
        ours += f" ({_where([sid for sid, _ in done])})"
        label = str(row["replication"])
        if label == "replicated":
            ours_verdict = done[0][1]
            if paper in CONCLUSIVE:
                same = paper == ours_verdict
                side = "the paper's verdict holds here" if same else f"the paper's verdict ({paper}) does not hold here"
                reading = f"our verdict replicated ({ours_verdict}); {side}"
            else:
                reading = f"our verdict replicated ({ours_verdict}); a prediction of ours, no paper verdict"
        elif label == "flipped":
            reading = "flipped: one column supported it, another refuted it"
        else:
            if len(done) == 1:
                reading = "open: one column evaluated it"
            elif len(counts) == 1:
                reading = f"open: {done[0][1]} in every column that evaluated it"
            else:
                reading = "open: the columns that evaluated it did not all decide it the same way"
        rows.append([name, _paper(row), ours, reading])
    return rows


PREREGISTERED_NOTE = (
    "'pre-registered rule': the replication rule as locked (study 2's PLAN.md section 6) counts a column that did "
    "not evaluate the claim as open, so a claim that some columns did not evaluate reads 'open (n not evaluated)' "
    "under it, however the others decided it; 'replication' applies the same rule to the columns that evaluated it."
)
SUMMARY_HEADER = ["claim", "paper", "ours: verdicts of the study x model columns that evaluated it", "reading"]
HOW_TO_READ = (
    "First table: each claim once, the paper's verdict and ours (how many study x model columns decided it which way; "
    "studies 1-2 ran SmolLM2, studies 3-5 SmolLM2 and Gemma 3). 'our verdict replicated': every column that "
    "evaluated it decided it the same way, supported or refuted; whether that is the paper's verdict is said beside "
    "it. Second table: every column's verdict and estimate [95% CI]. The locks and deviations are folded at the end."
)
