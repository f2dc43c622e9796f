"""Golden test: the whole claim analysis on a small committed records fixture reproduces, byte for byte, the
scorecard, the per-claim JSON tables, the CSV tables and the pilot summary that the analysis produced when the
fixture was made (tests/fixtures/golden/README.md). The analysis files are locked by the pre-registration, so any
refactor of them must keep this test passing unchanged.

The lock status is pinned (tests/fixtures/golden/lock_status.json) instead of read from the tree: it is the one
part of the scorecard that legitimately changes when a locked file changes (a recorded deviation), and it is not
computed from the records. Figures (PNG) are not compared byte for byte (matplotlib versions differ); their names
are, and scorecard.html lists them. The bootstrap counts are the pre-registered ones (predictions.yaml).

Since the rounding deviation (preregistration/DEVIATIONS.md, 2026-12-03, "reproducible on the next machine") every
float the analysis writes carries 10 significant digits: the golden files are unchanged and compared after that
same rounding (`_rounded_expected`), so nothing but the digits beyond the 10th may differ from them.

Since the one-renderer deviation (every Markdown table through kvcert.analysis.tables.markdown_table) the scorecard's
table is padded to its widest cells: the golden scorecard.md is unchanged too, and its table is compared after the same
re-rendering (`_relaid_table`: its cells, as written, through markdown_table), so only the column padding and the
separator's dashes may differ from it, never a cell's text.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from kvcert.analysis.claims import load_predictions
from kvcert.analysis.pilot import pilot_summary
from kvcert.analysis.scorecard import jsonable, round_frame
from kvcert.analysis.tables import markdown_table
from kvcert.studies.analyze import analyze_records

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"
EXPECTED = GOLDEN / "expected"
RUN = next((GOLDEN / "runs").iterdir())
CLAIM_IDS = ("C1", "C2", "C3", "C4", "C5", "C6", "C7")


def _records() -> tuple[pd.DataFrame, pd.DataFrame]:
    return pd.read_parquet(RUN / "examples.parquet"), pd.read_parquet(RUN / "steps.parquet")


def _expected_files() -> list[str]:
    return sorted(
        p.relative_to(EXPECTED).as_posix()
        for p in EXPECTED.rglob("*")
        if p.is_file() and p.name not in ("figures.txt", "pilot_summary.csv")
    )


def _relaid_table(text: str) -> str:
    """A Markdown file with each of its pipe tables (a header, a `|---|` separator, rows) re-rendered by markdown_table
    from the cells as written (an escaped pipe `\\|` stays inside its cell); every other line as it was."""
    out: list[str] = []
    block: list[list[str]] = []

    def flush() -> None:
        if block:
            table = pd.DataFrame(block[2:], columns=block[0])  # block[1]: the separator row
            out.extend(markdown_table(table, parse_numbers=False).split("\n"))
            block.clear()

    for line in text.split("\n"):
        if line.startswith("|"):
            block.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out)


def _rounded_expected(name: str) -> bytes:
    """The golden file with its floats rounded as the analysis now writes them (JSON through jsonable, CSV through
    round_frame), in the same layout; Markdown with its table re-laid out by markdown_table (_relaid_table); everything
    else as it was."""
    data = (EXPECTED / name).read_bytes()
    if name.endswith(".json"):
        text = data.decode()
        return (json.dumps(jsonable(json.loads(text)), indent=2) + ("\n" if text.endswith("\n") else "")).encode()
    if name.endswith(".csv"):
        return round_frame(pd.read_csv(io.BytesIO(data))).to_csv(index=False).encode()
    if name.endswith(".md"):  # already printed at 1 or 3 decimals; the table re-laid out (_relaid_table)
        return _relaid_table(data.decode()).encode()
    return data  # HTML: already printed at 1 or 3 decimals


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("golden")
    records = _records()
    predictions = load_predictions(ROOT / "preregistration" / "predictions.yaml")
    lock = json.loads((GOLDEN / "lock_status.json").read_text())
    t1 = json.loads((GOLDEN / "t1.json").read_text())
    analyze_records(
        {cid: records for cid in CLAIM_IDS},
        t1,
        predictions,
        out,
        lock,
        profile="golden",
        runs=[RUN.relative_to(ROOT).as_posix()],
    )
    return out


@pytest.mark.parametrize("name", _expected_files())
def test_golden_output_is_byte_identical(analyzed, name):
    produced = analyzed / name
    assert produced.is_file(), f"{name} was not written"
    assert produced.read_bytes() == _rounded_expected(name), f"{name} differs from the golden output"


def test_golden_writes_no_unexpected_table_and_the_same_figures(analyzed):
    written = {p.relative_to(analyzed).as_posix() for p in analyzed.rglob("*") if p.is_file()}
    tables = {n for n in written if not n.startswith("figures/")}
    assert tables == set(_expected_files())
    figures = sorted(n.removeprefix("figures/") for n in written if n.startswith("figures/"))
    assert figures == (EXPECTED / "figures.txt").read_text().split()


def test_golden_pilot_summary_is_byte_identical(tmp_path):
    examples, steps = _records()
    pilot_summary(examples, steps).to_csv(tmp_path / "pilot_summary.csv", index=False)
    assert (tmp_path / "pilot_summary.csv").read_bytes() == (EXPECTED / "pilot_summary.csv").read_bytes()
