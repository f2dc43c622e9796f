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
        assert row["floor_ratio"] == (row["plain_s"] + row["write_s"]) / row["plain_s"] > 1
        assert set(row["parts_s"]) == set(read.PARTS)
        assert row["parts_s"]["selection (scores, design)"] > 0 and row["parts_s"]["decode buffers"] > 0
    text = out.with_suffix(".md").read_text()
    assert "CPU:" in text and "Huge pages (THP_MEM_ALLOC_ENABLE): off" in text


def test_huge_pages_are_asked_of_torch_for_the_run_and_said_in_the_report(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # restored after the test
    out = tmp_path / "read"
    args = ["--model", "tiny-llama", "--tokens", "96", "--reps", "1", "--grid", "4", "--huge-pages", "--out", str(out)]
    assert read.main(args) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    assert "Huge pages (THP_MEM_ALLOC_ENABLE): on;" in out.with_suffix(".md").read_text()


def test_the_floor_writes_exactly_the_buffers_the_read_leaves():
    from kvcert.hf import DecodeOptions, Prompt, compress_while_reading
    from kvcert.policy import Policy
    from kvcert.testing import tiny_random_model

    model, _ = tiny_random_model()
    policies = [Policy(scorer="streaming", design=d, budget=b) for d in ("topk", "randomized") for b in (0.25, 0.5)]
    opts = DecodeOptions(max_new_tokens=4, oracle=False, certificate=True)
    batch = compress_while_reading(model, Prompt(input_ids=list(range(5, 85)), question_start=70), policies, opts)
    tensors = read.buffer_tensors(batch)
    layers = [layer for bucket in batch.state.buckets for layer in bucket.layers]
    assert [id(t) for t in tensors] == [id(getattr(layer, name)) for layer in layers
                                         for name in ("keys", "values", "offset", "one_minus_pi")]  # fmt: skip
    assert sum(bucket.batch_size for bucket in batch.state.buckets) == len(policies)
    assert read.write_seconds(tensors, reps=1) > 0
