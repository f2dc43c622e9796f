"""kvcert.bench.long_prompt: peak memory of kvcert's serving read against plain transformers' full cache."""

from __future__ import annotations

import json

from kvcert.bench import long_prompt


def test_the_report_holds_both_peaks_their_ratio_and_the_kv_kvcert_keeps(tmp_path):
    """One length on the tiny model, each engine in its own process: the ratio is kvcert's peak over plain
    transformers', and the KV kvcert holds at budget 0.25 is under half the full cache's bytes (computed here from
    the model's shape: layers x KV heads x head dim x 2 x 4 bytes x (prompt + answer slots))."""
    from kvcert.bench.common import load

    out = tmp_path / "lp"
    assert long_prompt.main(["--model", "tiny-llama", "--tokens", "512", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    run = data["results"]["512"]
    plain, ours = run["plain"], run["kvcert"]
    assert len(plain["tokens"]) == 8 and plain["peak_delta_mb"] >= 0 and ours["peak_delta_mb"] >= 0
    lines = [line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("|")]
    header, row = ([c.strip() for c in line.strip("|").split("|")] for line in (lines[0], lines[-1]))
    table = dict(zip(header, row))
    assert float(table["peak_ratio"]) == round(ours["peak_delta_mb"] / max(plain["peak_delta_mb"], 1e-9), 3)
    assert float(table["kvcert_kv_mb"]) == round(ours["kv_bytes"] / 2**20, 1)
    cfg = load("tiny-llama", "cpu", "float32")[0].config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    full = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 4 * (512 + 9)
    assert 0 < ours["kv_bytes"] < 0.5 * full
