"""The packaged SmolLM2-135M-Instruct inside kvcert: keep-all is exact, the full cache answers a needle."""

import pytest

from conftest import hf_greedy
from kvcert.hf import DecodeOptions, generate_variants
from kvcert.policy import FULL, Policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from kvcert.hf import load_model

    return load_model("smollm2-135m-instruct")


def _needle(tokenizer, n_tokens=600, seed=3):
    from kvcert.tasks import make_examples, render

    ex = make_examples("single_needle", 1, n_tokens, tokenizer, seed=seed)[0]
    return ex, render(ex, tokenizer)


def test_full_cache_answers_a_needle(smollm2):
    from kvcert.tasks import score

    model, tok = smollm2
    ex, r = _needle(tok)
    res = generate_variants(model, tok, r, [FULL], DecodeOptions(stop_strings=r.stop_strings))[0]
    assert score(res.answer, ex)[1], (res.answer, ex.answers)


def test_keep_all_reproduces_plain_transformers_decoding(smollm2):
    model, tok = smollm2
    ex, r = _needle(tok, 400)
    steps = 6
    policies = [FULL] + [
        Policy(scorer="window_question", design=d, budget=1.0) for d in ["topk", "randomized", "uniform"]
    ]
    ours = generate_variants(model, tok, r, policies, DecodeOptions(max_new_tokens=steps))
    ref_tokens, ref_lp = hf_greedy(model, r.input_ids, steps)
    for res in ours:
        assert res.tokens == ref_tokens, res.policy.label
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref_lp)) < 1e-5, res.policy.label


def test_eviction_on_the_real_model_has_real_error_and_a_certificate(smollm2):
    model, tok = smollm2
    ex, r = _needle(tok, 600)
    res = generate_variants(
        model,
        tok,
        r,
        [Policy(scorer="window_question", design="randomized", budget=0.25, seed=1)],
        DecodeOptions(max_new_tokens=6),
    )[0]
    err, var = res.stats["error"], res.stats["variance"]
    assert err.shape[1:] == (30, 9) and var.shape == err.shape
    assert (err > 0).mean() > 0.9 and (var > 0).mean() > 0.9  # a real, estimable error
    radius = 1.96 * var**0.5
    assert 0.3 < (err <= radius).mean() <= 1.0
