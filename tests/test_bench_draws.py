"""kvcert.bench.draws on a tiny model: the table a user reads (ratios to one draw, the union KV), not its times."""

from __future__ import annotations

import json

from kvcert.bench import draws


def test_draws_bench_reports_ratios_to_one_draw_and_the_union_kv(tmp_path):
    out = tmp_path / "draws"
    assert (
        draws.main(["--model", "tiny-llama", "--tokens", "160", "--steps", "3", "--reps", "1", "--out", str(out)]) == 0
    )
    res = json.loads(out.with_suffix(".json").read_text())["results"]
    assert list(res) == list(draws.CONFIGS)
    assert res["one draw"]["answer_ratio"] == res["one draw"]["kv_ratio"] == 1.0
    # the split halves hold one draw's kept set (only their own answer slots add); R draws hold more, R = 4 most
    assert 1.0 < res["split halves"]["kv_ratio"] < res["2 draws"]["kv_ratio"] < res["4 draws"]["kv_ratio"] < 4.0
    assert "CPU:" in out.with_suffix(".md").read_text()
