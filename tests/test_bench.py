"""The benchmark machinery end to end on a tiny random model: the JSON has the required fields, finite and positive.
No timing thresholds (timings on a shared machine are noise); only structure and sanity."""

import json
import math

from kvcert.bench import BenchConfig, policy_grid, run_bench
from kvcert.hf import tiny_random_model

TINY = BenchConfig(lengths=(160,), variants=(1, 3), max_new_tokens=3, prefill_reps=(1,), decode_tokens=160,
                   decode_variants=3, decode_steps=3, decode_reps=2, attention_reps=2, thread_reps=1, omp_reps=1,
                   memory_lengths=(160,), memory_variants=(3,))


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_policy_grid_is_realistic_and_prefix_stable():
    grid = policy_grid(24)
    assert len(grid) == 24 and len({p.label for p in grid}) == 24
    assert policy_grid(8) == grid[:8]
    assert {p.scorer for p in grid[:8]} == {"window_question", "window_context", "streaming"}
    assert {p.design for p in grid[:8]} == {"topk", "randomized"}


def test_bench_writes_required_fields(tmp_path):
    model, _ = tiny_random_model("llama")
    fig = tmp_path / "fig.png"
    res = run_bench(model, "tiny-llama", TINY, "cpu", "float32", tmp_path, True, fig, log=lambda m: None)
    data = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert data["shared_prefill_speedup"] == res["shared_prefill_speedup"]
    for key in ("shared_prefill_speedup", "certificate_overhead", "oracle_overhead"):
        assert _positive(data[key]), key
    assert {(r["tokens"], r["variants"]) for r in data["prefill"]} == {(160, 1), (160, 3)}
    for r in data["prefill"]:
        assert all(_positive(r[k]) for k in ("shared_s", "reprefill_s", "speedup", "decode_step_s"))
    assert set(data["decode"]) == {"plain", "certificate", "certificate+oracle"}
    assert all(_positive(v["step_s"]) for v in data["decode"].values())
    assert _positive(data["attention_only"]["ratio"])
    assert len(data["memory"]) == 1 and data["memory"][0]["peak_delta_mb"] >= 0
    assert _positive(data["memory"][0]["rss_peak_mb"])
    t = data["threads"]
    assert t["best_num_threads"] >= 1 and all(_positive(v) for v in t["num_threads_step_s"].values())
    assert set(t["omp_wait_policy_step_s"]) == {"default", "PASSIVE"}
    md = (tmp_path / "bench_cpu.md").read_text()
    assert "GPU figures were not measured" in md and "certificate overhead" in md
    assert fig.stat().st_size > 0
