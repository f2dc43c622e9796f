"""The benchmark package on tiny random models: structure and sanity of the report (no timing thresholds: timings
on a shared machine are noise), the byte / flop accounting of the roofline against a hand computation, the
decode-step timer driven by generate_variants' on_step callback, and the before / after options."""

import dataclasses
import itertools
import json
import statistics

import pytest
import torch

from conftest import needs_cxx
from kvcert.bench import ModelShape, StepTimer, VariantLoad, main, policy_grid, step_cost
from kvcert.bench.common import BenchConfig, before_after_options, no_eos, run_generate, synthetic_prompt
from kvcert.bench.measure import bench_examples
from kvcert.bench.roofline import limit, measure_bandwidth, measure_matmul
from kvcert.hf import tiny_random_model


def _plausible_bandwidth(bps):
    """Bytes per second of any machine's memory: 100 MB/s .. 10 TB/s (a wrong unit misses by 8x or 1e6x)."""
    return 1e8 < bps < 1e13


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


def test_machine_measurements_are_bytes_and_flops_over_the_best_time(monkeypatch):
    import kvcert.bench.roofline as roofline

    bw = measure_bandwidth(mb=8, reps=2)
    assert _plausible_bandwidth(bw["read_Bps"]) and _plausible_bandwidth(bw["copy_Bps"])
    assert bw["bandwidth_Bps"] == bw["read_Bps"] and bw["threads"] == torch.get_num_threads()
    mm = measure_matmul(4, 64, 128, reps=2, min_s=0.001)
    assert (mm["m"], mm["k"], mm["n"]) == (4, 64, 128) and 1e6 < mm["flops_per_s"] < 1e14
    # on a clock that advances 0.25 s per reading, every timed section lasts 0.25 s: the numbers are exact
    ticks = itertools.count()
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: 0.25 * next(ticks))
    bw = measure_bandwidth(mb=8, reps=2)
    assert bw["read_Bps"] == 8 * 2**20 / 0.25 and bw["copy_Bps"] == 2 * 8 * 2**20 / 0.25  # read; read + write
    mm = measure_matmul(4, 64, 128, reps=2, min_s=0.001)
    assert mm["flops_per_s"] == 2 * 4 * 64 * 128 / 0.25


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
    # step: the mean interval between consecutive on_step calls (3 per loop of 4 steps), all inside the total
    assert 0 < 3 * step <= total
    assert [r.policy for r in res] == policies


def test_before_after_options():
    from kvcert.hf import DecodeOptions

    before, after = before_after_options(DecodeOptions(max_new_tokens=7))
    assert (before.backend, after.backend, before.max_new_tokens, after.max_new_tokens) == ("torch", "compiled", 7, 7)

    @dataclasses.dataclass(frozen=True)
    class Older:
        max_new_tokens: int = 3

    opts = Older()
    assert before_after_options(opts) == (opts, None)


# ---------------------------------------------------------------------------------------------- end to end
@needs_cxx  # "after" is the compiled backend
def test_examples_section_on_real_confirmatory_examples(tiny_smol):
    model, tok = tiny_smol
    cfg = BenchConfig(example_tasks=2, example_lengths=(400,), example_per_cell=1, example_reps=1)
    out = bench_examples(model, tok, cfg, "cpu", lambda m: None)
    assert out["variants"] == 21 and out["examples"] == 2 and len(out["tasks"]) == 2
    assert out["available_after"]  # DecodeOptions has a backend to switch
    seconds = {m: [r["seconds"] for r in out["rows"] if r["mode"] == m] for m in ("before", "after")}
    assert len(seconds["before"]) == len(seconds["after"]) == 2
    for mode in ("before", "after"):
        assert out[mode]["seconds_per_example"] == pytest.approx(statistics.fmean(seconds[mode]))
        assert out[mode]["examples_per_hour"] == pytest.approx(3600 / out[mode]["seconds_per_example"])
        assert out[mode]["median_s"] == pytest.approx(statistics.median(seconds[mode]))
    assert out["example_speedup"] == pytest.approx(sum(seconds["before"]) / sum(seconds["after"]))
    assert out["answers_identical"] == 1.0  # the backend changes no answer


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


@needs_cxx  # the default configurations run the compiled kernel
def test_quick_profile_cli_on_tiny_model(tmp_path):
    args = ["--quick", "--no-versus", "--model", "tiny-llama", "--out", str(tmp_path)]
    rc = main([*args, "--figure", str(tmp_path / "s.png")])
    assert rc == 0
    data = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert data["quick"] and data["model"] == "tiny-llama"
    # serving mode at 1,024 tokens: budget 0.25 holds its 256 kept tokens (+ Poisson spread and the slots of the
    # tokens to come) against the full cache's 1,024; the table is in the report
    sv = data["serving"]
    assert {(r["tokens"], r["budget"]) for r in sv["rows"]} == {(1024, 1.0), (1024, 0.5), (1024, 0.25)}
    assert 0.25 <= data["serving_kv_memory_ratio"] <= 0.30
    assert "serving_kv_memory_ratio" in (tmp_path / "bench_cpu.md").read_text()
    assert {(r["tokens"], r["variants"]) for r in data["prefill"]} == {(1024, 1), (1024, 8), (1024, 24)}
    for r in data["prefill"]:  # one repetition (quick): the median of one ratio is the ratio of the two times
        assert r["reps"] == 1 and r["speedup"] == pytest.approx(r["reprefill_s"] / r["shared_s"])
    one = next(r for r in data["prefill"] if r["variants"] == 1)
    assert one["reprefill_s"] == pytest.approx(one["solo_one_variant_s"])  # re-prefill of 1 variant: its solo run
    head = next(r for r in data["prefill"] if (r["variants"], r["tokens"]) == (24, 1024))
    assert data["headline"] == dict(variants=24, tokens=1024) and data["shared_prefill_speedup"] == head["speedup"]
    assert set(data["decode"]) == {
        "plain",
        "certificate",
        "certificate+oracle",
        "certificate, no tight radius",
        "certificate, tight radius every 8",
        "plain, torch ops",
        "certificate, torch ops",
        "certificate+oracle, torch ops",
    }
    d = data["decode"]  # every overhead / speedup: the median over repetitions of the paired ratio of step times
    ratios = {
        "certificate_overhead": ("certificate", "plain"),  # the headline
        "certificate_overhead_torch_ops": ("certificate, torch ops", "plain, torch ops"),
        "certificate_overhead_no_tight": ("certificate, no tight radius", "plain"),
        "certificate_overhead_tight_every8": ("certificate, tight radius every 8", "plain"),
        "kernel_speedup": ("certificate+oracle, torch ops", "certificate+oracle"),
        "oracle_overhead": ("certificate+oracle", "certificate"),
    }
    for key, (num, den) in ratios.items():
        assert len(d[num]["samples_s"]) == len(d[den]["samples_s"]) == 3, key  # quick: 3 interleaved repetitions
        paired = [c / p for c, p in zip(d[num]["samples_s"], d[den]["samples_s"])]
        assert data[key] == pytest.approx(statistics.median(paired)), key
    roof = data["roofline"]
    assert len(roof["rows"]) == 4 * 3 and {r["variants"] for r in roof["rows"]} == {1, 8, 24}
    machine = roof["machine"]
    assert machine["bandwidth"]["bandwidth_Bps"] == machine["bandwidth"]["read_Bps"]
    assert _plausible_bandwidth(machine["bandwidth"]["bandwidth_Bps"])
    for r in roof["rows"]:  # the limit: bytes over the bandwidth, flops over the measured matmul rate, the larger
        assert r["step_s"] == pytest.approx(statistics.median(r["samples_s"]))
        assert r["memory_s"] == pytest.approx(r["bytes"] / machine["bandwidth"]["bandwidth_Bps"])
        assert r["compute_s"] == pytest.approx(r["flops"] / machine["matmul"][str(r["variants"])]["flops_per_s"])
        assert r["limit_s"] == max(r["memory_s"], r["compute_s"])
        assert r["multiple"] == pytest.approx(r["step_s"] / r["limit_s"])
        assert r["bound"] == ("memory" if r["memory_s"] >= r["compute_s"] else "compute")
    row = {(r["variants"], r["tokens"], r["config"]): r for r in roof["rows"]}
    headline, torch_ops = row[(24, 1024, "certificate+oracle")], row[(24, 1024, "certificate+oracle, torch ops")]
    assert data["roofline_multiple"] == headline["multiple"]
    assert data["roofline_multiple_torch_ops"] == torch_ops["multiple"]
    assert data["roofline_headline"] == dict(
        variants=24,
        tokens=1024,
        config="certificate+oracle",
        step_s=headline["step_s"],
        limit_s=headline["limit_s"],
        bound=headline["bound"],
    )
    ex = data["examples"]
    seconds = {m: [r["seconds"] for r in ex["rows"] if r["mode"] == m] for m in ("before", "after")}
    assert ex["variants"] == 21 and len(seconds["before"]) == len(seconds["after"]) == ex["examples"]
    assert ex["before"]["seconds_per_example"] == pytest.approx(statistics.fmean(seconds["before"]))
    assert data["example_speedup"] == ex["example_speedup"]
    assert ex["example_speedup"] == pytest.approx(sum(seconds["before"]) / sum(seconds["after"]))
    assert len(data["memory"]) == 1 and data["memory"][0]["peak_delta_mb"] >= 0
    threads = data["threads"]["num_threads_step_s"]
    assert "1" in threads and data["threads"]["best_num_threads"] == int(min(threads, key=threads.get))
    md = (tmp_path / "bench_cpu.md").read_text()
    for text in (
        "make gpu-check",
        "certificate overhead",
        "## 6. End to end",
        "## 7. Roofline",
        "roofline multiple",
        "examples per hour",
    ):
        assert text in md, text
    assert "Hot-path" not in md
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "bench_roofline.png").stat().st_size > 0


def test_gpu_check_bench_row_on_cpu():
    """The GPU bench's measurement runs on any device: a step time, and compressed caches that hold less than the
    prompt's full K/V of every variant would."""
    from kvcert.bench.gpu_check import bench

    model, _ = tiny_random_model("llama", max_position_embeddings=2048)
    row = bench(model, 512, 4, True, device="cpu")
    assert row["step_s"] > 0 and row["peak_gpu_bytes"] is None
    full_kv = 4 * 2 * model.config.num_hidden_layers * 2 * 512 * 16 * 4  # variants x K/V x layers x Hkv x n x d x fp32
    assert 0 < row["kv_bytes_held"] < full_kv


def test_versus_runs_a_revision_exported_from_git_in_its_own_process(tmp_path):
    """Section 8's machinery: a revision exported with `git archive` is what the child imports; kvpress's protocol
    decodes its 11 configurations one call each; the table names both sides and the ratio before / after."""
    from kvcert.bench import versus

    src = versus.export("HEAD", tmp_path)
    assert (src / "kvcert" / "hf" / "decode.py").is_file()
    spec = dict(
        model="tiny-llama",
        threads=1,
        tokens=128,
        variants=1,
        kvpress=versus.KVPRESS_CONFIGS,
        options=dict(max_new_tokens=2, certificate=False, oracle=False, backend="torch"),
    )
    out = versus.run_child(src, spec)
    assert len(out["per_call"]) == 11 and out["seconds"] == pytest.approx(sum(out["per_call"]))
    assert [c[0] for c in versus.KVPRESS_CONFIGS].count("full") == 1 and len(versus.configurations()) == 7
    with pytest.raises(RuntimeError, match="cannot export revision"):
        versus.export("no-such-revision", tmp_path)
    row = dict(configuration="c", before_s=2.0, after_s=1.0, ratio=2.0, samples={})
    res = dict(before="abc", before_switches={"s": True}, after="here", model="m", threads=1, reps=1)
    res.update(new_tokens=16, cpu="cpu", cpu_count=2, rows=[row])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in versus.markdown(res).splitlines() if "|" in line]
    assert ["c", "2.00", "1.00", "2.00x"] in rows
