"""The benchmark package on tiny random models: structure and sanity of the report (no timing thresholds: timings
on a shared machine are noise), the byte / flop accounting of the roofline against a hand computation, the
decode-step timer driven by generate_variants' on_step callback, and the before / after options."""

import dataclasses
import json
import math
import statistics

import pytest

from kvcert.bench import ModelShape, StepTimer, VariantLoad, main, policy_grid, step_cost
from kvcert.bench.common import BenchConfig, before_after_options, no_eos, run_generate, synthetic_prompt
from kvcert.bench.measure import bench_examples
from kvcert.bench.roofline import limit, measure_bandwidth, measure_matmul
from kvcert.hf import tiny_random_model


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_policy_grid_is_realistic_and_prefix_stable():
    grid = policy_grid(24)
    assert len(grid) == 24 and len({p.label for p in grid}) == 24
    assert policy_grid(8) == grid[:8]
    assert {p.scorer for p in grid[:8]} == {"window_question", "window_context", "streaming"}
    assert {p.design for p in grid[:8]} == {"topk", "randomized"}


# ------------------------------------------------------------------------------------------- accounting
def test_model_shape_by_hand():
    # tiny llama: vocab 128, hidden 64, intermediate 128, 2 layers, 4 query / 2 KV heads of 16, untied embeddings
    model, _ = tiny_random_model("llama")
    s = ModelShape.from_model(model)
    linear_per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down = 36864
    assert s.linear_params == 2 * linear_per_layer + 128 * 64  # + LM head
    norms = 2 * (64 + 64) + 64  # two RMSNorms per layer + the final one
    assert s.weight_bytes == 4 * (2 * linear_per_layer + norms + 128 * 64)  # the embedding table is not read...
    assert s.embed_row_bytes == 64 * 4  # ...only one row per variant
    assert (s.layers, s.kv_heads, s.q_heads, s.head_dim, s.vocab, s.intermediate) == (2, 2, 4, 16, 128, 128)
    tied, _ = tiny_random_model("llama", tie_word_embeddings=True)
    t = ModelShape.from_model(tied)
    assert t.embed_row_bytes == 0 and t.weight_bytes == s.weight_bytes  # the LM head reads the shared table once
    assert t.linear_params == s.linear_params


def test_step_cost_by_hand():
    s = ModelShape(
        layers=2,
        hidden=64,
        intermediate=128,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=128,
        weight_bytes=1000,
        embed_row_bytes=256,
        linear_params=81920,
    )
    loads = [
        VariantLoad(kept=100, appended=3, tail=60, generated=3),  # question-aware, randomized
        VariantLoad(kept=50, appended=43, tail=0, generated=3),
    ]  # question-agnostic top-k (read 40 question)
    plain = step_cost(s, loads, 200, certificate=False, oracle=False)
    # bytes: weights + 2 embedding rows; K, V (16 floats each) + offset per token, layer, KV head; logits
    kv = (103 + 93) * 2 * 2 * (2 * 16 + 1) * 4
    assert plain["bytes_by"] == dict(weights=1000 + 2 * 256, kv=kv, certificate=0, oracle=0, logits=2 * 128 * 4)
    assert plain["bytes"] == 1512 + kv + 1024
    # flops: 2 N P_lin; 4 (kept + appended) d Hq L per variant
    assert plain["flops_by"]["weights"] == 2 * 2 * 81920
    assert plain["flops_by"]["attention"] == 4 * (103 + 93) * 16 * 4 * 2
    full = step_cost(s, loads, 200, certificate=True, oracle=True)
    assert full["bytes_by"]["certificate"] == 60 * 2 * 2 * 2 * 4  # 1 - pi and ||v||^2 per tail slot
    assert full["bytes_by"]["oracle"] == 200 * 2 * 2 * 2 * 16 * 4  # the shared prefix K and V, read once
    assert full["flops_by"]["certificate"] == 2 * 60 * 16 * 4 * 2
    assert full["flops_by"]["oracle"] == 2 * 4 * (200 + 3) * 16 * 4 * 2
    assert full["bytes"] == plain["bytes"] + 1920 + 102400
    lim = limit(full, bandwidth=1e9, matmul_flops=1e9)
    assert lim["limit_s"] == max(full["bytes"], full["flops"]) / 1e9
    assert lim["limit_sum_s"] == (full["bytes"] + full["flops"]) / 1e9
    assert lim["bound"] == ("memory" if full["bytes"] >= full["flops"] else "compute")


def test_machine_measurements_are_positive():
    bw = measure_bandwidth(mb=8, reps=2)
    assert _positive(bw["read_Bps"]) and _positive(bw["copy_Bps"]) and bw["bandwidth_Bps"] == bw["read_Bps"]
    mm = measure_matmul(4, 64, 128, reps=2, min_s=0.001)
    assert _positive(mm["flops_per_s"]) and mm["m"] == 4


# ---------------------------------------------------------------------------------------------- timing hook
def test_step_timer_splits_decode_loops(monkeypatch):
    import kvcert.bench.common as common

    clock = iter([0.0, 1.0, 3.0, 10.0, 10.5, 11.0, 11.5])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    t = StepTimer()
    for step in (0, 1, 2, 0, 1, 2, 3):  # two decode loops (question-aware, then question-agnostic variants)
        t(step)
    assert t.loops == [[1.0, 2.0], [0.5, 0.5, 0.5]]
    assert t.step_s == pytest.approx(1.5 + 0.5) and t.n_loops == 2


def test_on_step_is_called_after_every_decode_forward():
    from kvcert.hf import DecodeOptions, Prompt, generate_variants

    model, _ = tiny_random_model("llama")
    ids, qs = synthetic_prompt(model, 96)
    policies = policy_grid(3)  # window_question and streaming (question-aware), window_context (agnostic)
    calls = []
    with no_eos(model):
        generate_variants(
            model,
            None,
            Prompt(input_ids=ids, question_start=qs, example_id="x"),
            policies,
            DecodeOptions(max_new_tokens=4),
            on_step=calls.append,
        )
    loops = [list(range(4))] * calls.count(0)
    assert calls == [s for loop in loops for s in loop] and len(loops) in (1, 2)  # one batch, or aware + agnostic
    total, step, res = run_generate(model, ids, qs, policies, DecodeOptions(max_new_tokens=4), "cpu")
    assert _positive(total) and _positive(step) and len(res) == 3


def test_before_after_options():
    from kvcert.hf import DecodeOptions

    opts = DecodeOptions(max_new_tokens=7)
    names = {f.name for f in dataclasses.fields(DecodeOptions)}
    before, after = before_after_options(opts)
    if {"one_batch", "drop_finished"} <= names:
        assert (before.one_batch, before.drop_finished, after.one_batch, after.drop_finished) == (
            False,
            False,
            True,
            True,
        )
    else:
        assert before is opts and after is None

    @dataclasses.dataclass(frozen=True)
    class Future:
        max_new_tokens: int = 3
        one_batch: bool = True
        drop_finished: bool = True

    b, a = before_after_options(Future())
    assert (b.one_batch, b.drop_finished, a.one_batch, a.drop_finished) == (False, False, True, True)


# ---------------------------------------------------------------------------------------------- end to end
def test_examples_section_on_real_confirmatory_examples(tiny_smol):
    model, tok = tiny_smol
    cfg = BenchConfig(example_tasks=2, example_lengths=(400,), example_per_cell=1, example_reps=1)
    out = bench_examples(model, tok, cfg, "cpu", lambda m: None)
    assert out["variants"] == 21 and out["examples"] == 2 and len(out["tasks"]) == 2
    assert _positive(out["before"]["seconds_per_example"]) and _positive(out["before"]["examples_per_hour"])
    if out["available_after"]:
        assert _positive(out["example_speedup"]) and _positive(out["after"]["seconds_per_example"])
    else:
        assert out["example_speedup"] is None and out["after"] is None


def test_examples_section_measures_after_when_options_have_the_fields(monkeypatch):
    """With a DecodeOptions that has one_batch / drop_finished (the lead's interface), both modes run interleaved and
    example_speedup is their ratio; today's decode ignores the fields, so the answers must be identical."""
    import kvcert.hf.generate as gen

    @dataclasses.dataclass(frozen=True)
    class FutureOptions(gen.DecodeOptions):
        one_batch: bool = True
        drop_finished: bool = True

    monkeypatch.setattr(gen, "DecodeOptions", FutureOptions)
    model, _ = tiny_random_model("llama")
    cfg = BenchConfig(example_tasks=1, example_lengths=(96,), example_per_cell=2, example_reps=1)
    out = bench_examples(model, None, cfg, "cpu", lambda m: None)
    assert out["available_after"] and out["examples"] == 2
    before = sum(r["seconds"] for r in out["rows"] if r["mode"] == "before")
    after = sum(r["seconds"] for r in out["rows"] if r["mode"] == "after")
    assert out["example_speedup"] == pytest.approx(before / after)
    assert out["after"]["examples_per_hour"] == pytest.approx(3600 / (after / 2))
    assert out["answers_identical"] == 1.0


def test_cluster_check_compare(tmp_path):
    import pandas as pd

    from kvcert.bench.cluster_check import cluster_requirements, compare

    assert any(r.startswith("hydra-submitit-launcher") for r in cluster_requirements())
    assert any(r.startswith("hydra-ray-launcher") for r in cluster_requirements())
    folders = {}
    for launcher in ("a", "b", "c"):
        f = tmp_path / launcher / "cell"
        f.mkdir(parents=True)
        (f / "COMPLETE").write_text("")
        (f / "config.yaml").write_text("seed: 0\n")
        (f / "provenance.json").write_text(json.dumps({"time": launcher}))  # differs, not compared
        ex = pd.DataFrame({"example_id": ["e1", "e0"], "variant": ["full", "full"], "score": [1.0, 0.5]})
        if launcher == "c":
            ex.loc[0, "score"] = 0.9
        ex.to_parquet(f / "examples.parquet")
        pd.DataFrame(
            {"example_id": ["e0"], "variant": ["full"], "step": [0], "layer": [0], "head": [0], "error": [0.1]}
        ).to_parquet(f / "steps.parquet")
        folders[launcher] = [str(f)]
    ok, notes = compare(folders["a"], folders["b"])
    assert ok and all("identical" in n for n in notes)
    ok, notes = compare(folders["a"], folders["c"])
    assert not ok and any("examples.parquet: differs" in n for n in notes)
    ok, _ = compare(folders["a"], [str(tmp_path / "b")])
    assert not ok


def test_quick_profile_cli_on_tiny_model(tmp_path):
    rc = main(["--quick", "--model", "tiny-llama", "--out", str(tmp_path), "--figure", str(tmp_path / "s.png")])
    assert rc == 0
    data = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert data["quick"] and data["model"] == "tiny-llama"
    for key in ("shared_prefill_speedup", "certificate_overhead", "oracle_overhead", "roofline_multiple"):
        assert _positive(data[key]), key
    assert "example_speedup" in data and (data["example_speedup"] is None or _positive(data["example_speedup"]))
    assert {(r["tokens"], r["variants"]) for r in data["prefill"]} == {(1024, 1), (1024, 8), (1024, 24)}
    assert set(data["decode"]) == {
        "plain",
        "certificate",
        "certificate+oracle",
        "certificate, no tight radius",
        "certificate, tight radius every 8",
        "plain, fast path",
        "certificate, fast path",
        "certificate+oracle, fast path",
        "certificate, fast path, tight radius every 8",
        "certificate+oracle, fast path in torch ops",
    }
    for key in (
        "certificate_overhead_no_tight",
        "certificate_overhead_tight_every8",
        "certificate_overhead_default_path",
        "certificate_overhead_fast_tight_every8",
        "certificate_overhead_vs_default_plain",
        "fast_path_speedup",
        "kernel_speedup",
        "roofline_multiple_default_path",
    ):
        assert _positive(data[key]), key
    d = data["decode"]  # the headline is the fast path's certificate over the fast path's plain step
    ratios = [c / p for c, p in zip(d["certificate, fast path"]["samples_s"], d["plain, fast path"]["samples_s"])]
    assert data["certificate_overhead"] == pytest.approx(statistics.median(ratios))
    roof = data["roofline"]
    assert len(roof["rows"]) == 5 * 3 and {r["variants"] for r in roof["rows"]} == {1, 8, 24}
    for r in roof["rows"]:
        assert all(_positive(r[k]) for k in ("step_s", "bytes", "flops", "limit_s", "multiple"))
        assert r["limit_s"] == max(r["memory_s"], r["compute_s"])
    assert data["roofline_headline"] == dict(
        data["roofline_headline"], variants=24, tokens=1024, config="certificate+oracle, fast path"
    )
    assert _positive(roof["machine"]["bandwidth"]["bandwidth_Bps"])
    assert data["examples"]["variants"] == 21 and _positive(data["examples"]["before"]["seconds_per_example"])
    assert len(data["memory"]) == 1 and data["memory"][0]["peak_delta_mb"] >= 0
    assert _positive(data["threads"]["num_threads_step_s"]["1"])
    md = (tmp_path / "bench_cpu.md").read_text()
    for text in (
        "GPU figures were not measured",
        "certificate overhead",
        "## 6. End to end",
        "## 7. Roofline",
        "roofline multiple",
        "examples per hour",
    ):
        assert text in md, text
    assert "Hot-path" not in md
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "bench_roofline.png").stat().st_size > 0
