"""Serving mode (oracle off): each layer is compressed inside the prefill forward and the full cache is never held.

Checked against verification mode (record the full prompt, then compress), which the engine reference tests pin:
the same kept tokens for every scorer x design, on a full-attention and a hybrid sliding-window model; the same
tokens and statistics up to float rounding (serving reads the prompt in one chunk, verification in two); the KV
bytes held are exactly the kept tokens plus the slots of the tokens to come; and no full-prompt record is made.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcert.bench.common import no_eos
from kvcert.hf import DecodeOptions, Prefill, Prompt, compress_while_reading, generate_variants
from kvcert.hf import attention as attention_module
from kvcert.hf.attention import chunked_feed_forward
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_random_model

N, QS, STEPS = 96, 70, 5
SCORERS = ("window_question", "window_context", "streaming", "key_norm", "random")
DESIGNS = ("topk", "randomized", "uniform", "randomized_no_offset")
POLICIES = [FULL] + [Policy(scorer=s, design=d, budget=b) for s in SCORERS for d in DESIGNS for b in (0.25, 0.5)]


def _prompt() -> Prompt:
    ids = torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(1)).tolist()
    return Prompt(input_ids=ids, question_start=QS, example_id="serve")


def _kept(comp, layer: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per KV head: the kept positions (sorted) and their offsets in that order (padding dropped)."""
    idx, off = comp.indices[layer], comp.offset[layer]
    positions, offsets = [], []
    for h in range(idx.shape[0]):
        valid = off[h] > -float("inf")
        order = idx[h][valid].argsort()
        positions.append(idx[h][valid][order].tolist())
        offsets.append(off[h][valid][order])
    return positions, offsets


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2.5"])
def test_serving_keeps_what_verification_keeps_and_decodes_the_same(arch):
    model, _ = tiny_random_model(arch)
    options = DecodeOptions(max_new_tokens=STEPS, oracle=False, backend="torch")
    with no_eos(model):
        verified = Prefill.record(model, _prompt()).compress(POLICIES, options)
        served = compress_while_reading(model, _prompt(), POLICIES, options)
        by_policy = {i: c for i, c in zip(served.rows, served.comps)}
        for i, comp in zip(verified.rows, verified.comps):
            other = by_policy[i]
            assert comp.kept_tokens == other.kept_tokens, POLICIES[i].label
            for layer in range(len(comp.indices)):
                (pos_a, off_a), (pos_b, off_b) = _kept(comp, layer), _kept(other, layer)
                assert pos_a == pos_b, (POLICIES[i].label, layer)
                for a, b in zip(off_a, off_b):  # -log pi from scores of keys equal up to float rounding
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        results_a, results_b = verified.decode(options), served.decode(options)
    for policy, a, b in zip(POLICIES, results_a, results_b):
        assert a.tokens == b.tokens, policy.label
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
        for name in ("variance", "tail_mass", "out_norm"):
            np.testing.assert_allclose(a.stats[name], b.stats[name], rtol=1e-3, atol=1e-6, err_msg=name)


def test_serving_never_records_the_full_prompt(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("serving mode recorded the full prompt")

    monkeypatch.setattr(attention_module.RecordState, "__init__", refuse)
    monkeypatch.setattr(Prefill, "record", refuse)
    model, _ = tiny_random_model("llama")
    policy = Policy(scorer="window_question", design="randomized", budget=0.5)
    with no_eos(model):
        (res,) = generate_variants(model, None, _prompt(), [policy], DecodeOptions(max_new_tokens=3, oracle=False))
    assert len(res.tokens) == 3
    assert "error" not in res.stats and (res.stats["variance"] > 0).any()  # no oracle: no exact error


@pytest.mark.parametrize("arch", ["llama", "qwen2.5"])
@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_serving_holds_exactly_the_kept_tokens(budget, arch):
    """Top-k keeps keep_count(budget, n) tokens in every (layer, head): the buffers hold that plus one slot per
    token still to come (the first answer token's and max_new_tokens), in the model's dtype; the full cache holds
    n plus the same slots."""
    from kvcert.bench.child import kv_bytes
    from kvcert.core import keep_count

    model, _ = tiny_random_model(arch)
    cfg = model.config
    n_kv, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    options = DecodeOptions(max_new_tokens=4, oracle=False)
    per_token = cfg.num_hidden_layers * n_kv * d * 2 * 4  # keys and values, float32
    slots = options.max_new_tokens + 1
    topk = Policy(scorer="streaming", design="topk", budget=budget)
    held = kv_bytes(compress_while_reading(model, _prompt(), [topk], options))
    assert held == (keep_count(budget, N) + slots) * per_token
    assert kv_bytes(compress_while_reading(model, _prompt(), [FULL], options)) == (N + slots) * per_token


def test_chunked_feed_forward_is_the_same_function_and_is_undone():
    model, _ = tiny_random_model("llama")
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 50, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = mlp(x)
        with chunked_feed_forward(model, chunk=16):
            assert "forward" in vars(mlp)
            chunked = mlp(x)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    assert "forward" not in vars(mlp)


# ------------------------------------------------------------------------------- one design call per policy group
HALVES = {"topk": (None,), "randomized": (None, 0, 1)}
GROUPED = [Policy(scorer=s, design=d, budget=b, floor=f, half=h)
           for s in ("window_question", "streaming") for d in ("topk", "randomized")
           for b in (0.1, 0.25, 0.5, 0.9) for f in (0.0, 0.2) for h in HALVES[d]]  # fmt: skip


def test_grouped_selection_keeps_exactly_what_each_policy_keeps_alone():
    """select_layers_together (one design call for policies of one group_key, any budgets) against each policy's own
    select_layers on the same keys and uniforms: identical positions, offsets, 1 - pi, tail lengths and counts,
    bit for bit (budget 0.9 caps inclusion probabilities at 1; halves split the tail)."""
    from kvcert.hf.compress import Plan, PolicyDraws, group_key, select_layers, select_layers_together

    gen = torch.Generator().manual_seed(3)
    n, n_kv, d = 80, 3, 8
    keys = torch.randn(1, n_kv, n, d, generator=gen)
    queries = torch.randn(1, 6, 8, d, generator=gen)
    groups: dict = {}
    for policy in GROUPED:
        plan = Plan.of(policy, region=n, forced=(n - 8, n))
        groups.setdefault(group_key(policy, plan, (n - 8, n)), []).append((policy, plan))
    assert None not in groups and len(groups) == 2 * (2 + 2 * 3)  # scorer x (topk x floor + randomized x floor x half)
    for members in groups.values():
        draws = [PolicyDraws.draw(p, torch.Generator().manual_seed(10 + k), (1, n_kv, plan.lo))
                 for k, (p, plan) in enumerate(members)]  # fmt: skip
        common = dict(layers=[0], window_queries=queries, scale=0.3, layer_windows=[None])
        together = select_layers_together([p for p, _ in members], [pl for _, pl in members], keys, draws=draws,
                                          score_cache={}, **common)  # fmt: skip
        for (policy, plan), draw, (got,) in zip(members, draws, together):
            (alone,) = select_layers(policy, keys, plan=plan, draws=draw, score_cache={}, **common)
            assert got.tail_slots == alone.tail_slots, policy.label
            for name in ("indices", "offset", "one_minus_pi", "drawn"):
                a, b = getattr(got, name), getattr(alone, name)
                assert a.shape == b.shape and torch.equal(a, b), (policy.label, name)


def test_a_grid_read_with_groups_equals_the_read_policy_by_policy(monkeypatch):
    """compress_while_reading on a grid (every scorer and design, two budgets) with policies grouped into one design
    call, against the same read with every policy alone: the same kept sets, buffers and decoded answers, exactly."""
    from kvcert.hf import compress as compress_module
    from kvcert.hf import serving_prefill

    model, _ = tiny_random_model("llama")
    options = DecodeOptions(max_new_tokens=STEPS, oracle=False, backend="torch")
    with no_eos(model):
        grouped = compress_while_reading(model, _prompt(), POLICIES + GROUPED, options)
        monkeypatch.setattr(serving_prefill, "group_key", lambda *a: None)
        alone = compress_while_reading(model, _prompt(), POLICIES + GROUPED, options)
        a, b = grouped.decode(options), alone.decode(options)
    assert compress_module.group_key is not None
    for comp_a, comp_b in zip(grouped.comps, alone.comps):
        for name in ("indices", "offset", "one_minus_pi"):
            assert all(torch.equal(x, y) for x, y in zip(getattr(comp_a, name), getattr(comp_b, name)))
        assert comp_a.tail_slots == comp_b.tail_slots and comp_a.kept_tokens == comp_b.kept_tokens
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.logprobs == y.logprobs, x.policy.label
        for name in ("variance", "trace_c2", "out_norm"):
            np.testing.assert_array_equal(x.stats[name], y.stats[name], err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2.5"])
def test_a_read_that_keeps_each_layer_whole_equals_the_layer_by_layer_read(monkeypatch, arch):
    """Policies that together keep more tokens than the prompt: each layer is kept whole until the buffers are built,
    and each group selects for all layers in one design call after the read. Against the layer-by-layer read (each
    layer selected and copied out while it is read): the same kept sets, the same decode buffers slot for slot, the
    same answers, log-probabilities and statistics, exactly; prompt-time and context-time policies."""
    from kvcert.hf import serving_prefill

    model, _ = tiny_random_model(arch)
    options = DecodeOptions(max_new_tokens=STEPS, oracle=False, backend="torch")
    context = [Policy(scorer=s, design=d, budget=b, compress_after="context")
               for s in ("window_context", "key_norm") for d in ("topk", "randomized") for b in (0.3, 0.6)]  # fmt: skip
    policies = POLICIES + GROUPED + context
    calls = []
    real = serving_prefill.select_together
    monkeypatch.setattr(serving_prefill, "select_together", lambda *a, **k: calls.append(k["layers"]) or real(*a, **k))
    with no_eos(model):
        whole = compress_while_reading(model, _prompt(), policies, options)
        assert calls and all(layers == list(range(model.config.num_hidden_layers)) for layers in calls)
        monkeypatch.setattr(serving_prefill, "keeps_whole", lambda plans, region: False)
        by_layer = compress_while_reading(model, _prompt(), policies, options)
        a, b = whole.decode(options), by_layer.decode(options)
    assert whole.rows == by_layer.rows
    for comp_a, comp_b in zip(whole.comps, by_layer.comps):
        for name in ("indices", "offset", "one_minus_pi"):
            pairs = zip(getattr(comp_a, name), getattr(comp_b, name), strict=True)
            assert all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)
        assert comp_a.tail_slots == comp_b.tail_slots and comp_a.kept_tokens == comp_b.kept_tokens
    for bucket_a, bucket_b in zip(whole.state.buckets, by_layer.state.buckets, strict=True):
        for buf_a, buf_b in zip(bucket_a.layers, bucket_b.layers):
            for name in ("keys", "values", "offset", "one_minus_pi"):
                assert torch.equal(getattr(buf_a, name), getattr(buf_b, name)), name
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.logprobs == y.logprobs, x.policy.label
        for name in ("variance", "trace_c2", "out_norm"):
            np.testing.assert_array_equal(x.stats[name], y.stats[name], err_msg=name)


def test_a_read_keeps_each_layer_whole_only_when_that_holds_less_than_the_copies():
    from kvcert.hf.compress import Plan
    from kvcert.hf.serving_prefill import keeps_whole

    def plans(*budgets):
        return [Plan.of(Policy(scorer="streaming", design="topk", budget=b), region=1000, forced=(990, 1000))
                for b in budgets]  # fmt: skip

    assert not keeps_whole(plans(0.25), 1000) and not keeps_whole(plans(0.5, 0.25), 1000)
    assert keeps_whole(plans(0.5, 0.5), 1000) and keeps_whole(plans(1.0), 1000)


# --------------------------------------------------------------------------- long prompts: sliding windows chunked
@pytest.mark.parametrize("window", [7, 30])
def test_a_long_prompts_sliding_window_attention_in_query_chunks_is_the_whole_attention(monkeypatch, window):
    """Past LONG_PROMPT tokens a sliding-window layer attends READ_CHUNK queries at a time over the keys its window
    reaches: the same output as one masked attention over the whole prompt (float64, to rounding), grouped heads."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 100, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    whole = attention_module.causal_attention(q, k, v, 0.25, window)
    monkeypatch.setattr(attention_module, "LONG_PROMPT", 64)
    monkeypatch.setattr(attention_module, "READ_CHUNK", 24)
    chunked = attention_module.causal_attention(q, k, v, 0.25, window)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)
    i, j = torch.arange(100)[:, None], torch.arange(100)[None, :]
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25  # an independent masked softmax
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    torch.testing.assert_close(chunked, scores.softmax(-1) @ v.repeat_interleave(2, 1), rtol=0, atol=1e-12)


def test_a_long_prompt_read_in_chunks_decodes_as_the_whole_read(monkeypatch):
    """The tiny Gemma 3 (sliding-window layers) read with chunked windows gives the same kept sets and answers as
    the whole read, and log-probabilities equal to float rounding."""
    model, _ = tiny_random_model("gemma3")
    options = DecodeOptions(max_new_tokens=STEPS, oracle=False, backend="torch")
    policies = [FULL, Policy(scorer="window_question", design="randomized", budget=0.5)]
    with no_eos(model):
        whole = compress_while_reading(model, _prompt(), policies, options)
        monkeypatch.setattr(attention_module, "LONG_PROMPT", 40)
        monkeypatch.setattr(attention_module, "READ_CHUNK", 16)
        chunked = compress_while_reading(model, _prompt(), policies, options)
        a, b = whole.decode(options), chunked.decode(options)
    for comp_a, comp_b in zip(whole.comps, chunked.comps):
        assert all(torch.equal(x, y) for x, y in zip(comp_a.indices, comp_b.indices))
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
