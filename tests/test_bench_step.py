"""kvcert.bench.step: the one-thread floor by hand, the parts' timers restored, and the table a user reads."""

from __future__ import annotations

import json

import pytest
import torch

from kvcert.bench import step
from kvcert.bench.roofline import limit


def test_floor_is_the_linear_roofline_then_the_rest_and_never_below_the_limit():
    cost = dict(
        bytes=10.0e9,
        flops=5.0e9,
        bytes_by=dict(weights=2.0e9, kv=8.0e9),
        flops_by=dict(weights=4.0e9, attention=1.0e9),
    )
    # linear: max(2e9 / 1e10, 4e9 / 1e10) = 0.4 s; the rest: max(8e9 / 1e10, 1e9 / 1e10) = 0.8 s
    assert step.floor_s(cost, 1e10, 1e10) == pytest.approx(1.2)
    assert limit(cost, 1e10, 1e10)["limit_s"] == pytest.approx(1.0)  # max(1.0, 0.5): the floor is 1.2x the limit
    compute_bound = dict(cost, flops=50e9, flops_by=dict(weights=49e9, attention=1e9))
    assert step.floor_s(compute_bound, 1e10, 1e10) >= limit(compute_bound, 1e10, 1e10)["limit_s"]


def test_timed_parts_restores_the_model_and_the_engine():
    from kvcert.hf.compressed_state import CompressedState

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    attend, finish = CompressedState.attend, CompressedState.finish_step
    x = torch.randn(2, 4)
    with step.timed_parts(model) as acc:
        model(x)
        assert acc["linear"] == 0  # off until switched on
        acc["on"] = 1
        model(x)
        assert acc["linear"] > 0
    assert "forward" not in vars(model[0])
    assert CompressedState.attend is attend and CompressedState.finish_step is finish


def test_step_bench_reports_parts_that_add_up_and_multiples(tmp_path):
    out = tmp_path / "step"
    args = ["--model", "tiny-llama", "--tokens", "160", "--variants", "4", "--steps", "4", "--reps", "1"]
    assert step.main([*args, "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())["results"]
    assert list(res["rows"]) == list(step.CONFIGS)
    for row in res["rows"].values():
        parts = row["linear_ms"] + row["attention_ms"] + row["statistics_ms"]
        assert 0 < parts <= row["step_ms"] and row["rest_ms"] == pytest.approx(row["step_ms"] - parts)
        assert row["floor_multiple"] >= 1.0 and row["multiple"] == pytest.approx(row["step_ms"] / row["limit_ms"])
    # the certificate's statistics are work the plain step does not do
    assert res["rows"]["certificate"]["statistics_ms"] > res["rows"]["plain"]["statistics_ms"]
    assert "CPU:" in out.with_suffix(".md").read_text()


def test_the_floor_is_never_below_the_limit_even_by_rounding():
    """Both parts memory-bound: weights / bw + rest / bw rounds one ulp below total / bw for these numbers."""
    w, total, bw = 281837845.117866, 1037642049.5192857, 12749010936.8313
    assert w / bw + (total - w) / bw < total / bw  # the rounding this guards against
    cost = {"bytes": total, "flops": 1.0, "bytes_by": {"weights": w}, "flops_by": {"weights": 0.5}}
    assert step.floor_s(cost, bw, 1e12) >= limit(cost, bw, 1e12)["limit_s"]
