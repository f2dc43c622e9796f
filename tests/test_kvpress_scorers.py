"""The scorers ported from kvpress 0.5.5, each against an independent float64 computation of kvpress's definition,
and each end to end under the randomized design (finite certificates)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvcert import Policy, generate
from kvcert.core.scorers import (
    SCORERS,
    ScorerInputs,
    critical_scores,
    expected_attention_scores,
    observed_attention_scores,
    snapkv_scores,
    tova_scores,
)
from kvcert.core.scorers.critical import EPSILON, value_output_norm
from kvcert.core.scorers.expected_attention import N_FUTURE, N_SINK, unrotate

L, HQ, HKV, N, D, HIDDEN = 2, 6, 2, 40, 8, 12
SCALE = D**-0.5
PORTED = ("snapkv", "tova", "observed_attention", "expected_attention", "critical_snapkv")


def _rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain rotate-half RoPE (base 10000): cos, sin (T, D) in float32."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = positions.double()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)
    return emb.cos().float(), emb.sin().float()


def _rotate(x: torch.Tensor, cos, sin) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _inputs(seed: int = 0) -> tuple[ScorerInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cos, sin = _rope(torch.arange(N))
    pre_q = torch.randn(L, HQ, N, D, generator=g)
    keys = _rotate(torch.randn(L, HKV, N, D, generator=g), cos, sin)
    values = torch.randn(L, HKV, N, D, generator=g)
    out_proj = torch.randn(L, HIDDEN, HQ * D, generator=g)
    inputs = ScorerInputs(keys=keys, values=values, queries=_rotate(pre_q, cos, sin), rotary=_rope, out_proj=out_proj)
    return inputs, pre_q


def _probs64(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Causal softmax (float64) of queries at positions `rows` over keys: (Hq, len(rows), N), KV head h // group."""
    k = k.double().repeat_interleave(HQ // HKV, 0)
    logits = q.double() @ k.transpose(-1, -2) * SCALE
    logits[:, torch.arange(N)[None, :] > rows[:, None]] = -math.inf
    return logits.softmax(-1)


def test_tova_is_the_last_querys_attention_averaged_over_all_heads():
    inputs, _ = _inputs()
    got = tova_scores(inputs, scale=SCALE, n_candidates=N - 1)
    for layer in range(L):
        p = _probs64(inputs.queries[layer, :, -1:], inputs.keys[layer], torch.tensor([N - 1]))[:, 0]
        want = p.mean(0)[: N - 1]  # every query head, the same scores for each KV head
        for h in range(HKV):
            torch.testing.assert_close(got[layer, h].double(), want, rtol=1e-5, atol=1e-7)


def test_observed_attention_is_the_column_mean_of_the_dense_causal_matrix():
    inputs, _ = _inputs(1)
    got = observed_attention_scores(inputs, scale=SCALE, n_candidates=N)
    group = HQ // HKV
    for layer in range(L):
        p = _probs64(inputs.queries[layer], inputs.keys[layer], torch.arange(N))  # (Hq, N, N)
        per_head = p.sum(1) / torch.arange(N, 0, -1, dtype=torch.float64)
        want = per_head.reshape(HKV, group, N).mean(1)
        torch.testing.assert_close(got[layer].double(), want, rtol=1e-5, atol=1e-7)


def test_observed_attention_blocks_of_queries_change_nothing(monkeypatch):
    from kvcert.core.scorers import observed_attention

    inputs, _ = _inputs(2)
    whole = observed_attention_scores(inputs, scale=SCALE, n_candidates=N)
    monkeypatch.setattr(observed_attention, "QUERY_BLOCK", 7)
    torch.testing.assert_close(observed_attention_scores(inputs, scale=SCALE, n_candidates=N), whole)


def test_snapkv_follows_kvpress_softmax_over_every_key_then_avg_pool_then_group_mean():
    inputs, _ = _inputs(3)
    w, kernel = 6, 5
    lo = N - w
    got = snapkv_scores(inputs.queries[:, :, lo:], inputs, scale=SCALE, pool_kernel=kernel, n_candidates=lo)
    for layer in range(L):
        p = _probs64(inputs.queries[layer, :, lo:], inputs.keys[layer], torch.arange(lo, N))[..., :lo].mean(1)
        padded = F.pad(p, (kernel // 2, kernel // 2))  # zeros, counted in the mean (avg_pool1d's default)
        pooled = torch.stack([padded[:, j : j + kernel].mean(-1) for j in range(lo)], -1)
        want = pooled.reshape(HKV, HQ // HKV, lo).mean(1)
        torch.testing.assert_close(got[layer].double(), want, rtol=1e-5, atol=1e-8)


def test_unrotate_inverts_rope():
    inputs, pre_q = _inputs(4)
    cos, sin = _rope(torch.arange(N))
    torch.testing.assert_close(unrotate(inputs.queries, cos, sin), pre_q, rtol=1e-5, atol=1e-5)


def test_expected_attention_follows_kvpress_gaussian_model_in_float64():
    inputs, pre_q = _inputs(5)
    got = expected_attention_scores(inputs, n_candidates=N)
    q = pre_q[:, :, N_SINK:].double()
    mu = q.mean(2)  # (L, Hq, D)
    cov = torch.einsum("lhsi,lhsj->lhij", q - mu[:, :, None], q - mu[:, :, None]) / q.shape[2]
    # the mean rotation over the future positions, each one an explicit block rotation matrix
    cos, sin = _rope(torch.arange(N, N + N_FUTURE))
    rots = []
    for c, s in zip(cos.double(), sin.double()):
        r = torch.zeros(D, D, dtype=torch.float64)
        for i in range(D // 2):  # (x_i, x_{i+D/2}) -> (x_i c - x_{i+D/2} s, x_{i+D/2} c + x_i s)
            j = i + D // 2
            r[i, i], r[i, j], r[j, i], r[j, j] = c[i], -s[i], s[i], c[i]
        rots.append(r)
    rot = torch.stack(rots).mean(0)
    mu, cov = mu @ rot.T, rot @ cov @ rot.T
    for layer in range(L):
        keys = inputs.keys[layer, :, N_SINK:].double().repeat_interleave(HQ // HKV, 0)  # (Hq, n, D)
        logits = torch.einsum("hnd,hd->hn", keys, mu[layer]) / math.sqrt(D)
        logits += torch.einsum("hnd,hde,hne->hn", keys, cov[layer], keys) / D / 2
        want = logits.softmax(-1).reshape(HKV, HQ // HKV, -1).mean(1)
        want = want * inputs.values[layer, :, N_SINK:].double().norm(dim=-1)
        torch.testing.assert_close(got[layer, :, N_SINK:].double(), want, rtol=1e-4, atol=1e-8)
    assert torch.all(got[..., :N_SINK] == got[..., N_SINK:].max() + 1)  # the sinks: kvpress's max + 1


def test_critical_weighting_and_its_first_stage():
    inputs, _ = _inputs(6)
    norm = value_output_norm(inputs.values, inputs.out_proj, HQ)
    group = HQ // HKV
    for layer in range(L):
        wo = inputs.out_proj[layer].double().T.reshape(HQ, D, HIDDEN)
        per_head = torch.stack([(inputs.values[layer, h // group].double() @ wo[h]).abs().sum(-1) for h in range(HQ)])
        torch.testing.assert_close(norm[layer].double(), per_head.reshape(HKV, group, N).mean(1), rtol=1e-5, atol=1e-5)
    base = torch.rand(L, HKV, N - 4, generator=torch.Generator().manual_seed(7))
    n_keep, n_forced = 16, 4  # kept 20: stage 1 keeps int(20 / 2) = 10 tokens, 4 of them the forced window
    got = critical_scores(base, inputs, n_keep=n_keep, n_forced=n_forced, n_q_heads=HQ)
    weighted = (base.double() + EPSILON) * norm[..., : N - 4].double()
    first = base.topk(6, dim=-1).indices
    stage1 = torch.zeros_like(base, dtype=torch.bool).scatter(-1, first, True)
    torch.testing.assert_close(got[~stage1].double(), weighted[~stage1], rtol=1e-5, atol=1e-7)
    assert torch.all(got[stage1].reshape(L, HKV, 6).amin(-1) > got.masked_fill(stage1, -1).amax(-1))


@pytest.mark.parametrize("scorer", PORTED)
def test_each_ported_scorer_runs_under_the_randomized_design_with_finite_certificates(scorer, tiny_smol):
    model, tok = tiny_smol
    assert SCORERS[scorer].reads_inputs
    policy = Policy(scorer=scorer, design="randomized", budget=0.5, tail_fraction=0.75, compress_after="context")
    context = "The quick brown fox jumps over the lazy dog. " * 6 + "The secret code is 4711. " + "Dogs sleep. " * 6
    out = generate(model, tok, context=context, question="What is the secret code?", policy=policy, max_new_tokens=4)
    # the first token comes from reading the question (no certificate by design); every decode step has one
    assert len(out.steps) > 1 and all(math.isfinite(t.certificate) for t in out.steps[1:])
    assert all(math.isfinite(v) for t in out.steps[1:] for v in t.layers)


def test_serving_and_verification_modes_give_the_ported_scorers_the_same_inputs():
    """compress_while_reading builds ScorerInputs inside the prefill forward, Prefill.record from its captures: the
    same kept tokens, hence the same answers, for every ported scorer, both compression times."""
    from kvcert.hf import DecodeOptions, Prompt, generate_variants
    from kvcert.testing import tiny_random_model

    model, _ = tiny_random_model("qwen2")
    ids = torch.randint(3, 128, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt = Prompt(input_ids=ids, question_start=70, example_id="ported")
    policies = [
        Policy(scorer=s, design=d, budget=0.4, compress_after=c)
        for s in PORTED
        for d in ("topk", "randomized")
        for c in (("context",) if SCORERS[s].window == "context" else ("context", "prompt"))
    ]
    runs = [
        generate_variants(model, None, prompt, policies, DecodeOptions(max_new_tokens=3, oracle=o, backend="torch"))
        for o in (True, False)
    ]
    for p, a, b in zip(policies, *runs):
        assert a.tokens == b.tokens and a.kept_tokens == b.kept_tokens, p.label
