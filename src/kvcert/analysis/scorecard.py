"""The scorecard: one row per claim (C1..C7, T1) with prediction, observed [CI], verdict and the paper's verdict,
and the pre-registration lock status. Written as strict JSON (NaN -> null), Markdown and HTML."""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from kvcert.analysis.claims import ClaimResult, claim_ids

# round_frame and SIGNIFICANT_DIGITS are re-exported: callers (pilot, model_dependence, tests) import them from here
from kvcert.analysis.tables import SIGNIFICANT_DIGITS, markdown_table, round_float, round_frame  # noqa: F401

ROW_KEYS = ("id", "claim", "prediction", "observed", "ci", "verdict", "paper_verdict", "agrees_with_paper")


def jsonable(obj: object) -> object:
    """Plain JSON types only: numpy scalars and arrays, DataFrames and Paths converted; floats rounded by
    round_float; NaN/inf -> None."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, pd.DataFrame):
        return jsonable(obj.to_dict(orient="records"))
    if isinstance(obj, (list, tuple, set, np.ndarray, pd.Series)):
        return [jsonable(v) for v in list(obj)]
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer, int)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return round_float(obj) if math.isfinite(float(obj)) else None
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, str):
        return obj
    if obj is pd.NA or obj is pd.NaT:
        return None
    return str(obj)


def lock_line(lock: Mapping[str, object]) -> str:
    status = lock.get("status")
    if status == "verified":
        return "Pre-registration: locked and verified"
    if status == "deviates":
        files = [*lock.get("changed", []), *lock.get("missing", []), *lock.get("added", [])]
        recorded = "recorded in DEVIATIONS.md" if lock.get("deviations_recorded") else "NOT all recorded"
        return f"Pre-registration: DEVIATES from pre-registration: {', '.join(files)} ({recorded})"
    return "Pre-registration: NOT LOCKED (no preregistration/LOCK.json)"


def build_scorecard(claim_results: list[ClaimResult], lock_status: dict, ids: Sequence[str] | None = None) -> dict:
    """{"lock": ..., "claims": [...]} in registry order (predictions.yaml: C1..C7, T1) unless `ids` is given; a
    claim with no result is listed as not evaluated."""
    ids = tuple(claim_ids() if ids is None else ids)
    by_id = {r.id: r for r in claim_results}
    unknown = sorted(set(by_id) - set(ids))
    if unknown:
        raise ValueError(f"unknown claim ids in results: {unknown}")
    claims = [(by_id[cid] if cid in by_id else ClaimResult.not_evaluated(cid)).as_dict() for cid in ids]
    lock = {**lock_status, "line": lock_line(lock_status)}
    return jsonable({"lock": lock, "claims": claims})


def _fmt(x: object, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float):
        digits = 1 if unit == "points" else 3
        # from the rounded value, as in the JSON; + 0.0 so that a zero up to summation noise never prints as -0.0
        return f"{round(round_float(x), digits) + 0.0:.{digits}f}"
    return str(x)


def _row_cells(c: Mapping) -> list[str]:
    unit = str(c.get("unit", ""))
    ci = c.get("ci") or [None, None]
    observed = f"{_fmt(c.get('observed'), unit)} [{_fmt(ci[0], unit)}, {_fmt(ci[1], unit)}]"
    if unit:
        observed += f" {unit}"
    agrees = c.get("agrees_with_paper")
    agrees_s = "n/a" if agrees is None else ("yes" if agrees else "no")
    paper = str(c.get("paper_verdict") or "n/a")
    if c.get("paper_value"):
        paper += f" ({c['paper_value']})"
    return [
        str(c["id"]),
        str(c.get("claim", "")),
        str(c.get("prediction", "")),
        observed,
        str(c.get("verdict")),
        paper,
        agrees_s,
    ]


HEADER = ["id", "claim", "prediction", "observed [95% CI]", "verdict", "paper", "agrees"]


def scorecard_markdown(scorecard: Mapping) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    rows = [[esc(x) for x in _row_cells(c)] for c in scorecard["claims"]]
    table = markdown_table(pd.DataFrame(rows, columns=HEADER), parse_numbers=False)
    lines = ["# Scorecard", "", scorecard["lock"]["line"], "", table]
    return "\n".join(lines) + "\n"


def scorecard_html(scorecard: Mapping, figures: list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join(
        f'<tr class="{html.escape(str(c.get("verdict")))}">'
        + "".join(f"<td>{html.escape(x)}</td>" for x in _row_cells(c))
        + "</tr>"
        for c in scorecard["claims"]
    )
    imgs = "".join(
        f'<figure><img src="{html.escape(f)}" alt="{html.escape(f)}" style="max-width:720px">'
        f"<figcaption>{html.escape(f)}</figcaption></figure>"
        for f in figures
    )
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #999;"
        "padding:4px 8px;vertical-align:top}.supported{background:#e8f5e9}.refuted{background:#ffebee}"
        ".inconclusive{background:#fffde7}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvcert scorecard</title>"
        f"<style>{style}</style></head><body><h1>Scorecard</h1>"
        f"<p>{html.escape(scorecard['lock']['line'])}</p><table><tr>{head}</tr>{body}</table>"
        f"<h2>Figures</h2>{imgs}</body></html>\n"
    )


def write_scorecard(scorecard: dict, out_dir: str | Path, figures: list[Path]) -> dict[str, Path]:
    """scorecard.json (strict), scorecard.md and scorecard.html (figures linked relative to out_dir)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rel = [Path(os.path.relpath(Path(f).resolve(), out.resolve())).as_posix() for f in figures]
    paths = {"json": out / "scorecard.json", "md": out / "scorecard.md", "html": out / "scorecard.html"}
    rounded = cast(dict, jsonable(scorecard))  # rounded once: the Markdown and HTML show the JSON's numbers
    paths["json"].write_text(json.dumps(rounded, indent=2, allow_nan=False) + "\n")
    paths["md"].write_text(scorecard_markdown(rounded))
    paths["html"].write_text(scorecard_html(rounded, rel))
    return paths
