"""Hybrid attention (Gemma 3 style: sliding-window and full layers, q/k norms, query_pre_attn_scalar, one KV head):
keep-all through every design reproduces transformers' own greedy decoding with a window smaller than the prompt,
and sliding-window layers are kept exactly (no certificate)."""

import numpy as np
import pytest
import torch

from conftest import hf_greedy
from kvcert.hf import DecodeOptions, Prefill, Prompt, generate_variants
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_gemma3_model

N, QS, STEPS, WINDOW = 96, 70, 6, 24


def tiny_gemma3(seed=0):
    """kvcert.testing's tiny Gemma 3 (randomized q/k norms) with layers [sliding, full, sliding, full], window 24."""
    model, _ = tiny_gemma3_model(
        seed, num_hidden_layers=4, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2
    )
    return model


def _prompt(seed=0):
    ids = torch.randint(0, 128, (N,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Prompt(input_ids=ids, question_start=QS, example_id="g")


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_keep_all_on_a_hybrid_model_reproduces_transformers(backend):
    """Both backends; the full-attention and the sliding-window layers form two layer groups of one engine."""
    model = tiny_gemma3()
    prompt = _prompt()
    ref_tokens, ref_lp = hf_greedy(model, prompt.input_ids, STEPS)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=1.0)
        for s in ("window_question", "window_context")
        for d in ("topk", "randomized", "uniform")
    ]
    opts = DecodeOptions(max_new_tokens=STEPS, backend=backend)
    for r in generate_variants(model, None, prompt, policies, opts):
        assert r.tokens == ref_tokens, r.policy.label
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref_lp)) < 1e-5, r.policy.label
        assert np.nanmax(r.stats["error"]) < 1e-5  # the oracle applies each layer's window too


def test_sliding_layers_are_kept_exactly_and_have_no_certificate():
    model = tiny_gemma3(1)
    prompt = _prompt(1)
    prefill = Prefill.record(model, prompt)
    assert prefill.layer_windows == [WINDOW, None, WINDOW, None]
    policy = Policy(scorer="window_question", design="randomized", budget=0.5, seed=2)
    comp = prefill._compress_one(policy, pool_kernel=5)
    assert comp.indices[0].shape[-1] == WINDOW - 1 and comp.indices[0][0, 0] == N - WINDOW + 1
    assert comp.indices[1].shape[-1] < N  # the full-attention layer is compressed
    res = generate_variants(model, None, prompt, [FULL, policy], DecodeOptions(max_new_tokens=4))[1]
    var, err = res.stats["variance"], res.stats["error"]
    assert np.isnan(var[:, [0, 2]]).all() and np.isfinite(var[:, [1, 3]]).all()
    assert err[:, [0, 2]].max() < 1e-5 <= err[:, [1, 3]].max()  # exact where kept exactly; real error elsewhere
    assert res.compressed_layers == (False, True, False, True)


def test_records_summarise_the_compressed_layers_only():
    from kvcert.records import example_frame
    from kvcert.tasks.ruler import Example

    model = tiny_gemma3(2)
    prompt = _prompt(2)
    policy = Policy(scorer="window_question", design="randomized", budget=0.5, seed=2)
    results = generate_variants(model, None, prompt, [FULL, policy], DecodeOptions(max_new_tokens=3))
    ex = Example(
        id="g",
        task="single_needle",
        context="",
        question="",
        answers=("x",),
        depth=0.5,
        metric="ruler_all",
        target_tokens=N,
    )
    row = example_frame("run", ex, N, results).iloc[1]
    assert row.uncompressed_layers == "0,2" and not row.nonfinite
    assert row.steps_total == results[1].n_answer * 2 * model.config.num_attention_heads  # compressed layers
