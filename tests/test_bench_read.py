"""kvcert.bench.read on a tiny model: the table a user reads (ratios to a plain forward, the read's parts)."""

from __future__ import annotations

import json

from kvcert.bench import read


def test_read_bench_reports_the_ratio_and_the_parts(tmp_path):
    out = tmp_path / "read"
    args = ["--model", "tiny-llama", "--tokens", "160", "--reps", "1", "--grid", "8", "--out", str(out)]
    assert read.main(args) == 0
    res = json.loads(out.with_suffix(".json").read_text())["results"]
    assert list(res) == ["one policy", "8-variant grid, prompt-time", "kvpress's 11 configurations"]
    for row in res.values():
        assert row["ratio"] == row["read_s"] / row["plain_s"] > 0
        assert set(row["parts_s"]) == set(read.PARTS)
        assert row["parts_s"]["selection (scores, design)"] > 0 and row["parts_s"]["decode buffers"] > 0
    assert "CPU:" in out.with_suffix(".md").read_text()
