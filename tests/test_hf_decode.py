"""The decoder: the speed switches (one batch, finished rows leave) change nothing but speed; stop strings."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import needs_cxx, needs_mkl
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.hf.decode import StopDetector, answer_length
from kvcert.policy import FULL, Policy

N, QS = 160, 130


class _CharTokenizer:
    """Token i is chr(i): a stop string of c characters spans c tokens."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def _variants(model, tokenizer, prompt, one_batch, drop_finished, stops=(), steps=8):
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=b, seed=1)
        for s in ("window_question", "window_context", "streaming", "key_norm")
        for d in ("topk", "randomized")
        for b in (0.3, 0.6)
    ]
    policies.append(Policy(scorer="streaming", design="randomized", budget=0.5, compress_after="context"))
    opts = DecodeOptions(max_new_tokens=steps, stop_strings=stops, one_batch=one_batch, drop_finished=drop_finished)
    return generate_variants(model, tokenizer, prompt, policies, opts)


@pytest.mark.parametrize("one_batch, drop_finished", [(True, False), (False, True), (True, True)])
def test_speed_switches_change_nothing_but_float_rounding(tiny_smol, one_batch, drop_finished):
    """Tokens, answers and answer lengths are identical; statistics agree to 1e-5 absolute (the matmuls see other
    batch shapes, so float32 summation orders change; the oracle's softmax is split at the context instead of the
    prompt when the two compression times share a batch)."""
    model, tok = tiny_smol
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    stops = (tok.decode([ids[7]]),)  # a frequent-enough token text so that rows finish at different steps
    ref = _variants(model, tok, prompt, False, False, stops)
    new = _variants(model, tok, prompt, one_batch, drop_finished, stops)
    for a, b in zip(ref, new):
        assert a.policy == b.policy
        assert (a.n_answer, a.answer) == (b.n_answer, b.answer), a.policy.label
        assert a.tokens[: a.n_answer + 1] == b.tokens[: b.n_answer + 1]
        assert np.allclose(a.logprobs[: a.n_answer + 1], b.logprobs[: b.n_answer + 1], atol=1e-5)
        assert a.stats.keys() == b.stats.keys()
        for name in a.stats:
            assert a.stats[name].shape == b.stats[name].shape, (a.policy.label, name)
            assert np.allclose(a.stats[name], b.stats[name], atol=1e-5, equal_nan=True), (a.policy.label, name)


def test_finished_rows_leave_the_batch(tiny_smol, monkeypatch):
    import kvcert.hf.decode as decode

    model, _ = tiny_smol
    tok = _CharTokenizer()
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    policies = [FULL] + [
        Policy(scorer="streaming", design="topk", budget=b, compress_after="context") for b in (0.1, 0.2, 0.4)
    ]
    first = generate_variants(model, tok, prompt, policies, DecodeOptions(max_new_tokens=1))
    assert first[0].tokens[0] not in {r.tokens[0] for r in first[1:]}, "pick another seed: a row must go on"
    batch_sizes = []
    forward = decode.forward_with_state

    def spy(model, input_ids, positions, state):
        batch_sizes.append(input_ids.shape[0])
        return forward(model, input_ids, positions, state)

    monkeypatch.setattr(decode, "forward_with_state", spy)
    stop = chr(first[0].tokens[0])  # the full cache's first token ends its answer at once
    res = generate_variants(model, tok, prompt, policies, DecodeOptions(max_new_tokens=4, stop_strings=(stop,)))
    assert res[0].n_answer == 0 and res[0].answer == ""
    assert batch_sizes and max(batch_sizes) < len(policies)  # the full-cache row never took a decode step
    monkeypatch.setattr(decode, "forward_with_state", forward)
    legacy = generate_variants(
        model, tok, prompt, policies, DecodeOptions(max_new_tokens=4, stop_strings=(stop,), drop_finished=False)
    )
    assert [r.answer for r in res] == [r.answer for r in legacy]


def test_stop_detector_sees_a_stop_string_spanning_tokens():
    tok = _CharTokenizer()
    stop = StopDetector(tok, ("<end>",))
    assert not stop([ord(c) for c in "abc<en"])
    assert stop([ord(c) for c in "abc<end>"])
    assert stop([ord(c) for c in "x" * 100 + "<end>"])  # only the last 4c+4 tokens are decoded
    assert not StopDetector(tok, ())([ord("a")])


def test_answer_length_cuts_at_eos_and_stop_strings():
    tok = _CharTokenizer()
    ids = [ord(c) for c in "42. more"]
    assert answer_length(tok, ids, {0}, (".",)) == (2, "42")
    assert answer_length(tok, [ord("7"), 0, ord("9")], {0}, ()) == (1, "7")
    assert answer_length(None, [5, 6, 0], {0}, ()) == (2, "5 6")


def test_tight_radius_every_refreshes_tr_c2_and_carries_its_ratio_between(tiny_smol):
    """tight_radius_every=3: at steps 0, 3, 6 tr(C^2) equals the every-step value bit for bit; between, tr(C^2) /
    V_hat^2 is the last refresh's (the effective dimension is carried, V_hat is not); every other statistic is
    untouched; rows leaving the batch keep their own carried ratio."""
    model, tok = tiny_smol
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    stops = (tok.decode([ids[7]]),)
    policies = [FULL] + [
        Policy(scorer=s, design="randomized", budget=b, seed=1)
        for s in ("window_question", "streaming")
        for b in (0.3, 0.6)
    ]
    base = DecodeOptions(max_new_tokens=8, stop_strings=stops)
    ref = generate_variants(model, tok, prompt, policies, base)
    new = generate_variants(
        model, tok, prompt, policies, DecodeOptions(max_new_tokens=8, stop_strings=stops, tight_radius_every=3)
    )
    carried = 0
    for a, b in zip(ref, new):
        assert (a.tokens, a.n_answer) == (b.tokens, b.n_answer)
        for name in a.stats:
            if name != "trace_c2":
                assert np.array_equal(a.stats[name], b.stats[name], equal_nan=True), name
        if a.policy.design != "randomized":
            continue
        var, tc_ref, tc_new = a.stats["variance"], a.stats["trace_c2"], b.stats["trace_c2"]
        for step in range(len(var)):
            if step % 3 == 0:
                assert np.array_equal(tc_ref[step], tc_new[step], equal_nan=True)
                psi = tc_ref[step] / var[step] ** 2
            else:
                ok = var[step] > 0
                assert np.allclose(tc_new[step][ok] / var[step][ok] ** 2, psi[ok], rtol=1e-4)
                carried += int(ok.sum())
    assert carried > 0
    with pytest.raises(ValueError, match="tight_radius_every"):
        DecodeOptions(tight_radius_every=0)


@pytest.mark.parametrize(
    "every, after_forward, transposed, fused, packed",
    [
        (1, True, False, False, False),
        (3, True, False, False, False),
        pytest.param(1, False, True, False, True, marks=needs_mkl),
        (3, True, True, False, False),
        pytest.param(1, True, True, True, False, marks=needs_cxx),
        pytest.param(3, True, True, True, True, marks=[needs_cxx, needs_mkl]),
    ],
)
def test_fast_switches_change_nothing_but_float_rounding(
    tiny_smol, monkeypatch, every, after_forward, transposed, fused, packed
):
    """decode.stats_after_forward / keys_transposed / fused_attention / packed_weights: every statistic of every
    step (certificate, diagnostics, tr(C^2) refreshed or carried, oracle error) equals the default path to float
    rounding, tokens and answers exactly, with rows leaving the batch between steps; and the deferred path, the
    fused kernel and the packed linear layers really ran when asked for."""
    from kvcert.hf import fused as fused_module
    from kvcert.hf import packed as packed_module
    from kvcert.hf.attention import Bucket

    model, tok = tiny_smol
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = Prompt(input_ids=ids, question_start=QS, example_id="x")
    stops = (tok.decode([ids[7]]),)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=b, seed=1)
        for s in ("window_question", "streaming")
        for d in ("topk", "randomized")
        for b in (0.3, 0.6)
    ]
    policies += [  # a second compression time: a second oracle prefix, buckets grouped by it
        Policy(scorer="streaming", design=d, budget=0.5, compress_after="context") for d in ("topk", "randomized")
    ]
    base = DecodeOptions(max_new_tokens=8, stop_strings=stops, tight_radius_every=every)
    ref = generate_variants(model, tok, prompt, policies, base)
    flushes = []
    flush = Bucket.flush_stats

    def spy(self, *args):
        flushes.append(self.batch_size)
        return flush(self, *args)

    monkeypatch.setattr(Bucket, "flush_stats", spy)
    kernel_calls = []
    kernel = fused_module.decode_attention

    def kernel_spy(*args, **kwargs):
        kernel_calls.append(len(args[3]))  # buckets in the call
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused_module, "decode_attention", kernel_spy)
    packed_calls = []
    packed_forward = packed_module._packed_forward

    def packed_spy(self, x):
        packed_calls.append(x.shape[0])
        return packed_forward(self, x)

    monkeypatch.setattr(packed_module, "_packed_forward", packed_spy)
    switches = dict(stats_after_forward=after_forward, keys_transposed=transposed, fused_attention=fused)
    fast = replace(base, packed_weights=packed, **switches)
    new = generate_variants(model, tok, prompt, policies, fast)
    assert bool(packed_calls) == packed, "the packed linear layers ran iff asked for"
    assert not any("forward" in vars(m) for m in model.modules()), "the model's own forwards are restored"
    assert bool(flushes) == after_forward, "the deferred path ran iff asked for"
    assert bool(kernel_calls) == fused and (not fused or max(kernel_calls) > 1), "one kernel call for all buckets"
    assert any(r.n_answer < 8 for r in ref), "pick another stop string: some row must leave the batch"
    for a, b in zip(ref, new):
        assert (a.tokens[: a.n_answer + 1], a.n_answer, a.answer) == (b.tokens[: b.n_answer + 1], b.n_answer, b.answer)
        assert a.stats.keys() == b.stats.keys() and "trace_c2" in a.stats and "error" in a.stats
        for name in a.stats:
            assert a.stats[name].shape == b.stats[name].shape, (a.policy.label, name)
            assert np.array_equal(np.isnan(a.stats[name]), np.isnan(b.stats[name])), (a.policy.label, name)
            assert np.allclose(a.stats[name], b.stats[name], rtol=1e-5, atol=1e-7, equal_nan=True), (
                a.policy.label,
                name,
            )


def test_take_tokens_is_the_gather_it_replaces():
    """The buffers' row copy equals core.hajek.gather_tokens exactly, per head and for repeated indices."""
    from kvcert.core.hajek import gather_tokens
    from kvcert.hf.prefill import _take_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 8, generator=g)
    idx = torch.randint(0, 50, (3, 17), generator=g)
    idx[1, :3] = 49  # repeats and the last token
    assert torch.equal(_take_tokens(x, idx), gather_tokens(x, idx))
    assert torch.equal(_take_tokens(x, idx[:, :0]), gather_tokens(x, idx[:, :0]))
