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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
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


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_serving_holds_exactly_the_kept_tokens(budget):
    """Top-k keeps keep_count(budget, n) tokens in every (layer, head): the buffers hold that plus one slot per
    token still to come (the first answer token's and max_new_tokens), in the model's dtype; the full cache holds
    n plus the same slots."""
    from kvcert.bench.child import kv_bytes
    from kvcert.core import keep_count

    model, _ = tiny_random_model("llama")
    cfg = model.config
    n_kv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
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
