"""One Markdown table renderer (kvcert.analysis.tables.markdown_table, pandas' to_markdown through tabulate): its
output on a known frame, and no other module of src/kvcert that writes a Markdown table by hand or calls tabulate."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from kvcert.analysis.tables import markdown_table

SRC = Path(__file__).resolve().parents[1] / "src" / "kvcert"
RENDERER = "analysis/tables.py"
# a table's separator row: a pipe followed by dashes, or a string literal of dashes (`"---|"`, `["---"]`)
SEPARATOR = re.compile(r"""\|\s*:?-{3,}|["']\s*:?-{3,}:?\s*\|?\s*["']""")
TABULATE = re.compile(r"\.to_markdown\(|\bimport tabulate\b|\btabulate\(")


def test_known_frame():
    df = pd.DataFrame({"claim": ["C1", "C2"], "n": [3, 12], "value": [0.5, 1.25]})
    assert markdown_table(df, floatfmt=".2f") == (
        "| claim   |   n |   value |\n"
        "|---------|-----|---------|\n"
        "| C1      |   3 |    0.50 |\n"
        "| C2      |  12 |    1.25 |"
    )


def test_cells_written_as_given():
    """Cells a caller formatted itself are not read back as numbers (0.950 keeps its zero, 1e-05 its form)."""
    df = pd.DataFrame({"a": ["0.950", "n/a"], "b": ["1e-05", ""]})
    assert markdown_table(df, parse_numbers=False) == (
        "| a     | b     |\n|-------|-------|\n| 0.950 | 1e-05 |\n| n/a   |       |"
    )


def _modules() -> dict[str, str]:
    return {p.relative_to(SRC).as_posix(): p.read_text() for p in sorted(SRC.rglob("*.py"))}


def test_no_markdown_table_by_hand():
    """Every module, none excepted: a separator row written by hand is a table that bypasses markdown_table."""
    found = {}
    for name, text in _modules().items():
        lines = [i for i, line in enumerate(text.splitlines(), 1) if SEPARATOR.search(line)]
        if lines:
            found[name] = lines
    assert not found, f"Markdown tables built by hand (use kvcert.analysis.tables.markdown_table): {found}"


def test_one_renderer_calls_tabulate():
    callers = [name for name, text in _modules().items() if TABULATE.search(text)]
    assert callers == [RENDERER]
