"""Several draws of one policy (kvcert.hf.draws): split halves and independent draws against an independent Poisson
simulation, teacher-forced rows against a float64 recomputation with a plain attention, and the union KV."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import AttentionInterface

from kvcert.core import agreement
from kvcert.core.designs import randomized
from kvcert.core.probabilities import inclusion_probabilities, uniform_draws
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.hf import compressed_batch as compressed_batch_module
from kvcert.hf.draws import Draws, agreement_of, draw_policies, union_kv_bytes
from kvcert.hf.serving_prefill import compress_while_reading
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_random_model

POLICY = Policy(scorer="window_question", design="randomized", budget=0.3, seed=3)
# the leader with followers against a plain run: float32 rounding of batches of different shapes (seen: 4.8e-7)
LEADER_ATOL = 1e-5


def _scores(seed: int = 0, shape=(3, 60)) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).pow(3)


def _select(scores, seed, half=None):
    u = uniform_draws(tuple(scores.shape), torch.Generator().manual_seed(seed))
    return randomized.select(scores, 20, generator=None, draws=u, half=half), u


def _kept(sel) -> list[set[int]]:
    return [set(sel.indices[h][sel.valid[h]].tolist()) for h in range(sel.indices.shape[0])]


def test_split_halves_are_disjoint_halves_of_one_draw_with_weights_two_over_pi():
    scores = _scores()
    whole, u = _select(scores, 7)
    h0, _ = _select(scores, 7, half=0)
    h1, _ = _select(scores, 7, half=1)
    # the head (pi = 1, log pi = 0) is the same in all three
    heads = [[{int(i) for i, lp, ok in zip(s.indices[h], s.log_pi[h], s.valid[h]) if ok and lp == 0} for h in range(3)]
             for s in (whole, h0, h1)]  # fmt: skip
    assert heads[0] == heads[1] == heads[2]
    for h in range(3):
        tail0, tail1 = _kept(h0)[h] - heads[0][h], _kept(h1)[h] - heads[0][h]
        assert not tail0 & tail1
        assert tail0 | tail1 == _kept(whole)[h] - heads[0][h]
    # every tail entry's weight is 2 / pi of the whole draw's pi (independently recomputed)
    n_head = 10  # 20 kept, tail_fraction 0.5
    top = scores.topk(n_head, dim=-1).indices
    rest = torch.ones_like(scores, dtype=torch.bool).scatter(-1, top, False)
    pi = inclusion_probabilities(scores, rest, 10, floor=0.2, score_power=1.0)
    for sel in (h0, h1):
        tail = sel.valid & (sel.log_pi != 0)
        got = sel.log_pi[tail].double()
        want = torch.log(pi.gather(-1, sel.indices)[tail] / 2)
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.allclose(sel.offset[tail].double(), -want, atol=1e-6)


def test_each_half_is_a_poisson_sample_at_half_pi():
    """Over many draws, each tail token enters half 0 with frequency pi/2 and half 1 with frequency pi/2: a plain
    Bernoulli simulation (numpy, its own random numbers) at pi/2 gives the same frequencies within binomial noise."""
    scores = _scores(1, (1, 40))
    n = 4000
    counts = np.zeros((2, 40))
    for seed in range(n):
        for half in (0, 1):
            sel, _ = _select(scores, seed, half=half)
            tail = sel.valid[0] & (sel.log_pi[0] != 0)
            counts[half, sel.indices[0][tail].numpy()] += 1
    top = scores.topk(10, dim=-1).indices
    rest = torch.ones_like(scores, dtype=torch.bool).scatter(-1, top, False)
    pi = inclusion_probabilities(scores, rest, 10, floor=0.2, score_power=1.0)[0].double().numpy()
    sim = (np.random.default_rng(0).random((n, 40)) < pi / 2).mean(0)
    for half in (0, 1):
        freq = counts[half] / n
        cand = rest[0].numpy()
        sd = np.sqrt(pi / 2 * (1 - pi / 2) / n)
        assert np.all(np.abs(freq - pi / 2)[cand] < 4.5 * sd[cand] + 1e-9)
        assert np.all(np.abs(freq - sim)[cand] < 6.5 * sd[cand] + 1e-9)


def test_independent_draws_share_the_head_and_their_union_counts_it_once():
    scores = _scores(2)
    sels = [_select(scores, seed)[0] for seed in (11, 12, 13)]
    heads = [
        [{int(i) for i, lp, ok in zip(s.indices[h], s.log_pi[h], s.valid[h]) if ok and lp == 0} for h in range(3)]
        for s in sels
    ]
    assert heads[0] == heads[1] == heads[2]
    assert _kept(sels[0]) != _kept(sels[1])
    want = sum(len(set().union(*(_kept(s)[h] for s in sels))) for h in range(3))
    got = agreement.union_count([s.indices for s in sels], [s.valid for s in sels], scores.shape[-1])
    assert got == want


def test_draw_policies_and_bad_input():
    rows, follow = draw_policies(POLICY, Draws(count=3))
    assert [p.seed for p in rows] == [3, 4, 5] and follow == {1: 0, 2: 0}
    rows, follow = draw_policies(POLICY, Draws(variant="split"))
    assert [p.half for p in rows] == [None, 0, 1] and {p.seed for p in rows} == {3} and follow == {1: 0, 2: 0}
    assert rows[1].label.endswith("/half0") and POLICY.label == rows[0].label
    with pytest.raises(ValueError, match="at least 2"):
        Draws(count=1)
    with pytest.raises(ValueError, match="choose one of independent, split"):
        Draws(variant="bogus")
    with pytest.raises(ValueError, match="whole randomized policy"):
        draw_policies(Policy(scorer="window_question", design="topk", budget=0.3), Draws())
    with pytest.raises(ValueError, match="half must be None, 0 or 1"):
        Policy(scorer="window_question", design="randomized", budget=0.3, half=2)


def test_signals_by_hand():
    span = agreement.scored_span(3, 5, first_from_prefill=True)
    assert list(span) == [1, 2, 3]
    lead = [-0.1, -0.2, -0.3, -0.05, -9.0]
    others = [[-0.1, -0.2, -2.3, -0.05, -1.0], [-0.1, -0.9, -0.3, -0.05, -1.0]]
    assert agreement.disagreement(lead, others, span) == pytest.approx((2.0 + 0.7) / 2)
    assert agreement.confidence(lead, span) == pytest.approx(0.3)
    assert agreement.differs([5, 6, 7, 8, 9], [[5, 6, 7, 8, 1], [5, 6, 0, 8, 9]], span) == 0.5
    assert math.isnan(agreement.disagreement(lead, [], span))


# ---------------------------------------------------------------------------------------------- teacher forcing
N, QS, STEPS = 120, 110, 6


def _prompt():
    ids = torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    return Prompt(input_ids=ids, question_start=QS, example_id="ex-draws")


class _Spy:
    """Every decoded batch (with each row's Compressed), captured as it decodes (nothing under src/ changes)."""

    def __init__(self, monkeypatch):
        self.batches = []
        decode = compressed_batch_module.CompressedBatch.decode

        def spy(batch, *args, **kwargs):
            self.batches.append(batch)
            return decode(batch, *args, **kwargs)

        monkeypatch.setattr(compressed_batch_module.CompressedBatch, "decode", spy)


def _reference_logprobs(model, prompt_ids, answer, comp) -> list[float]:
    """log p(answer[t] | prompt, answer[:t]) under the compressed cache `comp`, in float64 with a plain attention:
    prompt queries attend causally to the whole prompt (the prefill), answer queries to the kept prompt positions
    with their offsets (-log pi on the tail, 0 on the head) and to the answer before them."""
    n, m = len(prompt_ids), len(answer)
    ids = torch.tensor([prompt_ids + answer])
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    biases = []
    for layer in range(cfg.num_hidden_layers):
        bias = torch.full((cfg.num_attention_heads, n + m, n + m), -math.inf, dtype=torch.float64)
        causal = torch.ones(n + m, n + m, dtype=torch.bool).tril()
        bias[:, :n][causal[:n].expand(cfg.num_attention_heads, -1, -1)] = 0.0
        for q in range(cfg.num_attention_heads):
            idx, off = comp.indices[layer][q // group], comp.offset[layer][q // group].double()
            ok = torch.isfinite(off)
            row = torch.full((n,), -math.inf, dtype=torch.float64)
            row[idx[ok]] = off[ok]
            bias[q, n:, :n] = row
            bias[q, n:, n:] = torch.where(causal[n:, n:], 0.0, -math.inf)
        biases.append(bias)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        k = key.repeat_interleave(group, dim=1)
        v = value.repeat_interleave(group, dim=1)
        w = (query @ k.transpose(-1, -2)) * scaling + biases[module.layer_idx]
        return (w.softmax(-1) @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvcert_test_reference64", attention)
    ref = copy.deepcopy(model).double()  # the same weights (q/k/v biases included), in float64
    ref.set_attn_implementation("kvcert_test_reference64")
    with torch.no_grad():
        logp = ref(ids).logits[0].log_softmax(-1)
    return [float(logp[n - 1 + t, answer[t]]) for t in range(m)]


@pytest.mark.parametrize("arch", ["llama", "qwen2.5"])
@pytest.mark.parametrize("variant", ["independent", "split"])
@pytest.mark.parametrize("oracle", [True, False])
def test_teacher_forced_rows_against_a_float64_recomputation(monkeypatch, variant, oracle, arch):
    model, _ = tiny_random_model(arch, seed=0)
    prompt = _prompt()
    rows, follow = draw_policies(POLICY, Draws(variant=variant))
    spy = _Spy(monkeypatch)
    opts = DecodeOptions(max_new_tokens=STEPS, oracle=oracle, backend="torch")
    res = generate_variants(model, None, prompt, [FULL, *rows], opts, follow={i + 1: 1 for i in follow})
    leader, followers = res[1], res[2:]
    batch = spy.batches[-1]
    comps = dict(zip(batch.rows, batch.comps))
    for k, f in enumerate(followers, start=2):
        assert f.tokens == leader.tokens and f.follows == 1 and len(f.own_tokens) == len(f.tokens)
        want = _reference_logprobs(model, prompt.input_ids, leader.tokens, comps[k])
        assert np.allclose(f.logprobs, want, atol=2e-4), (f.logprobs, want)
    lead_ref = _reference_logprobs(model, prompt.input_ids, leader.tokens, comps[1])
    assert np.allclose(leader.logprobs, lead_ref, atol=2e-4)
    # the leader and the full cache decode the same tokens as without followers; the leader's log-probabilities
    # agree to float rounding only: a batch of another shape rounds differently in the linear layers (bit-equal on an
    # Intel AVX-512 CPU, 7th digit apart on an AMD EPYC with AVX2), so the contract is a declared tolerance
    plain = generate_variants(model, None, prompt, [FULL, rows[0]], opts)
    assert plain[1].tokens == leader.tokens
    assert np.allclose(plain[1].logprobs, leader.logprobs, rtol=0, atol=LEADER_ATOL)
    assert plain[0].tokens == res[0].tokens and res[0].own_tokens is None
    sig = agreement_of(leader, followers)
    assert sig.span == (1, min(leader.n_answer + 1, len(leader.tokens)))
    assert sig.disagreement == pytest.approx(
        np.mean([max(leader.logprobs[t] - f.logprobs[t] for t in range(*sig.span)) for f in followers])
    )
    # one row's bytes by hand: the full cache keeps every prompt position of every layer and KV head
    cfg = model.config
    per_entry = 2 * cfg.head_dim * 4  # keys and values, float32
    want_full = per_entry * cfg.num_hidden_layers * cfg.num_key_value_heads * (N + STEPS)
    assert union_kv_bytes(batch, [0], {0: STEPS}) == want_full
    appended = {i: STEPS for i in range(1, len(rows) + 1)}
    union = union_kv_bytes(batch, list(range(1, len(rows) + 1)), appended)
    one = union_kv_bytes(batch, [1], {1: STEPS})
    if variant == "split":  # memory-free: the halves hold the draw's kept set
        assert union == one + 2 * (one - union_kv_bytes(batch, [1], {1: 0}))
    else:
        assert one < union < 2 * one


def test_serving_mode_batch_has_the_same_followers(monkeypatch):
    model, _ = tiny_random_model("llama", seed=0)
    rows, follow = draw_policies(POLICY, Draws(count=3))
    opts = DecodeOptions(max_new_tokens=STEPS, oracle=False, backend="torch")
    batch = compress_while_reading(model, _prompt(), rows, opts)
    res = batch.decode(opts, None, follow=follow)
    assert all(r.tokens == res[0].tokens for r in res[1:]) and res[0].own_tokens is None
