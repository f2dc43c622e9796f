"""The combined scorecard: each study's own scorecard (kvcert.analysis.scorecard.build_scorecard, unchanged) side by
side, one row per claim, with its replication label and a footer that says what the table does not: no multiplicity
correction, N against the power target, on which side of the paper each inconclusive point estimate lies, and what
T1's interval is.

    card = combined_scorecard({"study1": card1, "study2": card2}, secondary=s1_to_s5, power=targets)
    write_combined(card, out_dir, figures)   # scorecard.json (strict), scorecard.md, scorecard.html

Replication (`replication`, REPLICATION) is taken over the studies that evaluated the claim; the pre-registered rule's
label (study 2's PLAN.md section 6, a not-evaluated study counting as open) is kept beside it (DEVIATIONS.md, stop
39). Verdicts are reported beside each other, never pooled.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import pandas as pd

from kvcert.analysis.scorecard import _fmt, jsonable, lock_line
from kvcert.analysis.tables import markdown_table
from kvcert.studies.scorecard_claims import (  # noqa: F401  (re-exported: the one-row-per-claim table)
    CONCLUSIVE,
    HOW_TO_READ,
    NOT_EVALUATED,
    PREREGISTERED_NOTE,
    REPLICATION,
    SUMMARY_HEADER,
    T1_INTERVAL,
    _evaluated,
    _finite,
    _interval_kind,
    _model_name,
    _paper,
    _verdict,
    _where,
    claim_summary_rows,
    preregistered_text,
    replication,
    replication_preregistered,
    replication_text,
    scorecard_title,
)

TOWARD, AGAINST, NA = "toward the paper's verdict", "against", "n/a"
MULTIPLICITY = (
    "No multiplicity correction: each claim is decided by its own pre-registered rule, with no family-wise "
    "correction across the seven claims (as pre-registered in both studies); the secondary predictions never change "
    "a claim's verdict. Each study's verdicts are reported beside the other's, never pooled."
)
_OPS = {">=": lambda x, t: x >= t, ">": lambda x, t: x > t, "<=": lambda x, t: x <= t, "<": lambda x, t: x < t}


def _condition_side(cond: Mapping) -> dict:
    value = cond.get("value") if isinstance(cond.get("value"), Mapping) else {}
    est = cond.get("estimate", value.get("estimate"))
    direction, threshold = cond.get("direction"), cond.get("threshold")
    decidable = direction in _OPS and _finite(est) and _finite(threshold)
    side = ("predicted" if _OPS[str(direction)](float(est), float(threshold)) else "other") if decidable else NA
    return {"metric": cond.get("metric"), "direction": direction, "threshold": threshold, "estimate": est, "side": side}


def inconclusive_direction(claim: Mapping) -> dict:
    """For an inconclusive claim: whether its point estimates are on the paper's side of the decision thresholds.
    Each condition's estimate is on the predicted side of its threshold or the other. If the paper supports the claim,
    its side is every condition on the predicted side (any on the other: against); if the paper refutes it, any
    condition on the other side (all on the predicted side: against). n/a when the paper has no supported/refuted
    verdict, the claim has no conditions (T1) or the estimates that would decide are undefined."""
    sides = [_condition_side(c) for c in claim.get("conditions") or []]
    paper = claim.get("paper_verdict")
    got = [s["side"] for s in sides]
    direction = NA
    if sides and paper == "supported":
        direction = AGAINST if "other" in got else (TOWARD if all(g == "predicted" for g in got) else NA)
    elif sides and paper == "refuted":
        direction = TOWARD if "other" in got else (AGAINST if all(g == "predicted" for g in got) else NA)
    return {"id": claim.get("id"), "paper_verdict": paper, "direction": direction, "conditions": sides}


def _claim_ids(studies: Mapping[str, Mapping]) -> list[str]:
    ids: list[str] = []
    for card in studies.values():  # the first study's order (study 1: C1..C7, T1), then any new ids
        ids += [str(c["id"]) for c in card.get("claims", []) if str(c["id"]) not in ids]
    return ids


def _power_rows(studies: Mapping[str, Mapping], power: Mapping | None) -> dict[str, list]:
    """power is {claim id: {n?, target_n}} (study 2's targets, or the last study's when there is no study2) or
    {study id: {claim id: {...}}}; a missing n is the claim's n_examples in that study."""
    if not power:
        return {}
    if set(power) <= set(studies):
        per_study = dict(power)
    else:
        per_study = {"study2" if "study2" in studies else list(studies)[-1]: power}
    out: dict[str, list] = {}
    for sid, targets in per_study.items():
        claims = {str(c["id"]): c for c in studies[sid].get("claims", [])}
        rows = []
        for cid, t in targets.items():
            n = t.get("n", (claims.get(cid) or {}).get("n_examples"))
            target = t.get("target_n")
            reaches = bool(n >= target) if _finite(n) and _finite(target) else None
            rows.append({"id": cid, "n": n, "target_n": target, "reaches_target": reaches})
        out[sid] = rows
    return out


def combined_scorecard(
    studies: dict[str, dict],
    *,
    secondary: dict | None = None,
    power: dict | None = None,
    study_secondary: Mapping[str, dict] | None = None,
    model_dependence: list[dict] | None = None,
) -> dict:
    """Study id -> that study's scorecard ({"lock", "claims"}, optional "profile", "runs", "n_examples") into one
    strict-JSON dict: `studies` (each lock and claims as they came, `interval` = `ci` added), `side_by_side` (one row
    per claim id: each study's verdict / observed / ci, the paper's verdict / value, `replication`,
    `replication_studies` (how many studies evaluated it) and `replication_preregistered`), `footer` (multiplicity, N
    against the power target, direction of each inconclusive result, T1's interval) and, with `secondary` (S-id ->
    {estimate, lo, hi, status, ...}), studies.study2.secondary; `study_secondary` (study id -> its S-id mapping) does
    the same for other studies, and `model_dependence` (kvcert.studies.model_dependence's rows) is kept as such."""
    if not studies:
        raise ValueError("no study scorecards")
    if secondary is not None and "study2" not in studies:
        raise ValueError("secondary predictions are study 2's; no study2 scorecard given")
    out_studies: dict[str, dict] = {}
    for sid, card in studies.items():
        lock = dict(card.get("lock") or {})
        lock.setdefault("line", lock_line(lock))
        claims = [{**c, "interval": c.get("ci"), "interval_kind": _interval_kind(c)} for c in card.get("claims", [])]
        entry = {"lock": lock, "claims": claims}
        entry |= {k: card[k] for k in ("profile", "runs", "n_examples") if k in card}
        out_studies[sid] = entry
    if secondary is not None:
        out_studies["study2"]["secondary"] = secondary
    for sid, sec in (study_secondary or {}).items():
        out_studies[sid]["secondary"] = sec

    by_study = {sid: {str(c["id"]): c for c in card.get("claims", [])} for sid, card in studies.items()}
    rows = []
    for cid in _claim_ids(studies):
        present = [by_study[sid][cid] for sid in studies if cid in by_study[sid]]
        first = next((c for c in present if _evaluated(c)), present[0])
        paper = next((c.get("paper_verdict") for c in present if c.get("paper_verdict")), None)
        paper_value = next((c.get("paper_value") for c in present if c.get("paper_value")), None)
        cells = {}
        for sid in studies:
            c = by_study[sid].get(cid)
            ok = _evaluated(c)
            cells[sid] = {
                "verdict": _verdict(c),
                "observed": c.get("observed") if ok else None,
                "ci": c.get("ci") if ok else [None, None],
                "n_examples": c.get("n_examples") if ok else None,
                "evaluated": ok,
            }
        label, n_evaluating = replication(verdicts := [cells[sid]["verdict"] for sid in studies])
        rows.append(
            {
                "id": cid,
                "claim": first.get("claim", ""),
                "unit": first.get("unit", ""),
                "interval_kind": _interval_kind(first),
                "studies": cells,
                "paper_verdict": paper,
                "paper_value": paper_value,
                "replication": label,
                "replication_studies": n_evaluating,
                "replication_preregistered": replication_preregistered(verdicts),
            }
        )

    directions = {
        sid: [inconclusive_direction(c) for c in card.get("claims", []) if _verdict(c) == "inconclusive"]
        for sid, card in studies.items()
    }
    t1 = {sid: by_study[sid]["T1"] for sid in studies if _evaluated(by_study[sid].get("T1"))}
    t1_kind = _interval_kind(next(iter(t1.values()))) if t1 else T1_INTERVAL
    footer = {
        "multiplicity": MULTIPLICITY,
        "replication": REPLICATION,
        "power": _power_rows(studies, power),
        "inconclusive_direction": directions,
        "t1_interval": {
            "kind": t1_kind,
            "text": f"T1's interval is the {t1_kind}: it shows how far the ratio moves across lambda, "
            "not sampling uncertainty.",
            "by_study": {sid: c.get("ci") for sid, c in t1.items()},
        },
    }
    card = {"studies": out_studies, "side_by_side": rows, "footer": footer}
    if model_dependence is not None:
        card["model_dependence"] = list(model_dependence)
    return jsonable(card)


# ------------------------------------------------------------------------------------------------------ rendering
def _estimate(cell: Mapping, unit: str, t1: bool = False) -> str:
    if not cell.get("evaluated", True):
        return NOT_EVALUATED
    ci = cell.get("ci") or [None, None]
    est = f"{_fmt(cell.get('observed'), unit)} {'range ' if t1 else ''}[{_fmt(ci[0], unit)}, {_fmt(ci[1], unit)}]"
    return f"{cell['verdict']} {est}" + (f" {unit}" if unit else "")


def _table(card: Mapping) -> tuple[list[str], list[list[str]], list[str]]:
    sids = list(card["studies"])
    header = ["claim", *[f"{sid} verdict, estimate [CI]" for sid in sids], "paper", "replication"]
    header.append("pre-registered rule")  # the locked rule's label, beside the one over the evaluating studies
    body, classes = [], []
    for row in card["side_by_side"]:
        unit = str(row.get("unit") or "")
        name = f"{row['id']}: {row['claim']}" if row.get("claim") else str(row["id"])
        t1 = row["id"] == "T1"
        cells = [_estimate(row["studies"][s], unit, t1) for s in sids]
        body.append([name, *cells, _paper(row), replication_text(row), preregistered_text(row)])
        classes.append(str(row["replication"]))
    return header, body, classes


def _secondary_rows(card: Mapping, study: str = "study2") -> list[list[str]]:
    sec = card["studies"].get(study, {}).get("secondary") or {}
    rows = []
    for sid, s in sec.items():
        s = s if isinstance(s, Mapping) else {"estimate": s}
        est = f"{_fmt(s.get('estimate'))} [{_fmt(s.get('lo'))}, {_fmt(s.get('hi'))}]"
        what = str(s.get("prediction") or s.get("name") or s.get("description") or "")
        rows.append([str(sid), what, est, str(s.get("status") or "n/a")])
    return rows


SECONDARY_HEADER = ["id", "prediction", "estimate [CI]", "status"]
DEPENDENCE_HEADER = ["claim", "metric", "model A", "model B", "A - B [95% CI]", "verdicts A / B", "reading"]


def _dependence_rows(card: Mapping) -> list[list[str]]:
    rows = []
    for r in card.get("model_dependence") or []:
        diff = f"{_fmt(r.get('difference'))} [{_fmt(r.get('ci_low'))}, {_fmt(r.get('ci_high'))}]"
        verdicts = f"{r.get('verdict_a')} / {r.get('verdict_b')}"
        a = f"{r.get('model_a', 'A')}: {_fmt(r.get('estimate_a'))}"
        b = f"{r.get('model_b', 'B')}: {_fmt(r.get('estimate_b'))}"
        rows.append([str(r.get("claim")), str(r.get("metric")), a, b, diff, verdicts, str(r.get("reading"))])
    return rows


def _secondary_sections(card: Mapping) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) per study with secondary predictions, study 2 first (its title unchanged)."""
    out = []
    for sid in card["studies"]:
        rows = _secondary_rows(card, sid)
        if rows:
            what = "S1-S5" if sid == "study2" else "S1-S6, C5 descriptive"
            out.append((f"{sid} secondary predictions ({what}; never change a claim's verdict)", rows))
    return out


def _footer_lines(card: Mapping) -> list[str]:
    f = card["footer"]
    lines = [f["multiplicity"], f"Replication: {f['replication']}"]
    for sid, rows in f["power"].items():
        parts = []
        for r in rows:
            mark = {True: "reached", False: "BELOW target", None: "n/a"}[r["reaches_target"]]
            parts.append(f"{r['id']} N = {_fmt(r['n'])} / target {_fmt(r['target_n'])} ({mark})")
        lines.append(f"N against the power target, {sid}: " + ("; ".join(parts) or "none given"))
    for sid, items in f["inconclusive_direction"].items():
        if not items:
            lines.append(f"Inconclusive results, {sid}: none.")
            continue
        parts = []
        for it in items:
            conds = ", ".join(
                f"{c['metric']} {_fmt(c['estimate'])} {c['direction']} {_fmt(c['threshold'])}: {c['side']} side"
                for c in it["conditions"]
            )
            paper = it["paper_verdict"] or "n/a"
            parts.append(f"{it['id']} point estimate {it['direction']} (paper: {paper}; {conds or 'no conditions'})")
        lines.append(f"Inconclusive results, {sid}, relative to the paper: " + "; ".join(parts) + ".")
    lines.append(f["t1_interval"]["text"])
    return lines


def combined_markdown(card: Mapping) -> str:
    """The side-by-side table, each study's lock line, the secondary table (if any) and the footer."""

    def esc(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    def table(header: list[str], body: list[list[str]]) -> list[str]:
        df = pd.DataFrame([list(map(esc, r)) for r in body], columns=list(map(esc, header)))
        return markdown_table(df, parse_numbers=False).split("\n")

    lines = [f"# {scorecard_title(card)}", "", HOW_TO_READ, ""]
    lines += ["## What holds: one row per claim", "", *table(SUMMARY_HEADER, claim_summary_rows(card))]
    header, body, _ = _table(card)
    lines += ["", "## Every study's verdict and estimate", "", *table(header, body), "", PREREGISTERED_NOTE]
    dependence = _dependence_rows(card)
    if dependence:
        lines += ["", "## Model dependence (study 3: SmolLM2 - Gemma 3, read as declared in its PLAN.md)", ""]
        lines += table(DEPENDENCE_HEADER, dependence)
    for title, sec in _secondary_sections(card):
        lines += ["", f"## {title}", ""]
        lines += table(SECONDARY_HEADER, sec)
    lines += ["", "## Notes", ""] + [f"- {x}" for x in _footer_lines(card)]
    lines += ["", "<details><summary>Pre-registration: each study's lock and its recorded deviations</summary>", ""]
    lines += [f"- {sid}: {s['lock']['line']}" for sid, s in card["studies"].items()]
    lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def combined_html(card: Mapping, figures: list[str]) -> str:
    """The same content as combined_markdown, as one HTML page with the figures (paths relative to the page)."""

    def table(header: list[str], body: list[list[str]], classes: list[str] | None = None) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        tds = ["".join(f"<td>{html.escape(x)}</td>" for x in r) for r in body]
        trs = "".join(f'<tr class="{html.escape(classes[i]) if classes else ""}">{t}</tr>' for i, t in enumerate(tds))
        return f"<table><tr>{head}</tr>{trs}</table>"

    locks = "".join(
        f"<li>{html.escape(sid)}: {html.escape(study['lock']['line'])}</li>" for sid, study in card["studies"].items()
    )
    summary = claim_summary_rows(card)
    summary_classes = [str(r["replication"]) for r in card["side_by_side"]]
    header, body, classes = _table(card)
    dependence = _dependence_rows(card)
    sec_html = (
        f"<h2>Model dependence (study 3)</h2>{table(DEPENDENCE_HEADER, dependence)}" if dependence else ""
    ) + "".join(
        f"<h2>{html.escape(title.split(' (')[0])}</h2>{table(SECONDARY_HEADER, sec)}"
        for title, sec in _secondary_sections(card)
    )
    notes = "".join(f"<li>{html.escape(x)}</li>" for x in _footer_lines(card))
    imgs = "".join(
        f'<figure><img src="{html.escape(f)}" alt="{html.escape(f)}" style="max-width:720px">'
        f"<figcaption>{html.escape(f)}</figcaption></figure>"
        for f in figures
    )
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #999;"
        "padding:4px 8px;vertical-align:top}.replicated{background:#e8f5e9}.flipped{background:#ffebee}"
        ".open{background:#fffde7}.wide{overflow-x:auto}.wide table{font-size:12px}.wide td:first-child"
        "{min-width:16em}details{margin:1em 0}summary{cursor:pointer;font-weight:bold}"
    )
    title = scorecard_title(card)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvcert {html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1><p>{html.escape(HOW_TO_READ)}</p>"
        f"<h2>What holds: one row per claim</h2>{table(SUMMARY_HEADER, summary, summary_classes)}"
        f"<h2>Every study's verdict and estimate</h2><div class='wide'>{table(header, body, classes)}</div>"
        f"<p>{html.escape(PREREGISTERED_NOTE)}</p>"
        f"{sec_html}<h2>Notes</h2><ul>{notes}</ul><h2>Figures</h2>{imgs}"
        "<details><summary>Pre-registration: each study's lock and its recorded deviations</summary>"
        f"<ul>{locks}</ul></details></body></html>\n"
    )


def write_combined(card: dict, out_dir: str | Path, figures: list[Path]) -> dict[str, Path]:
    """scorecard.json (strict JSON, indent 2, trailing newline), scorecard.md and scorecard.html (figures linked
    relative to out_dir)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rel = [Path(os.path.relpath(Path(f).resolve(), out.resolve())).as_posix() for f in figures]
    paths = {"json": out / "scorecard.json", "md": out / "scorecard.md", "html": out / "scorecard.html"}
    rounded = cast(dict, jsonable(card))  # rounded once: the Markdown and HTML show the JSON's numbers
    paths["json"].write_text(json.dumps(rounded, indent=2, allow_nan=False) + "\n")
    paths["md"].write_text(combined_markdown(rounded))
    paths["html"].write_text(combined_html(rounded, rel))
    return paths
