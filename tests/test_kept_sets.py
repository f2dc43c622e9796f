"""The kept set of every scorer x design equals its specification, on hand-built keys, through the engine's own
compression step (`Prefill._compress_one` -> kvcert.hf.compress.compress, no model).

Specifications (re-derived here in float64, not read from kvcert):
- key_norm keeps the LOWEST-norm keys (small keys attract attention, Devoto et al.);
- streaming keeps the 4 sink tokens and then the most recent ones;
- random keeps the top of a seeded Uniform(0, 1) draw (a seeded permutation), independent of the keys;
- window_question / window_context (SnapKV-style) keep the tokens the observation window attends to most, after a
  width-5 max pooling (neighbours of a needle come with it), ties to the earlier position;
- the observation window (the question, or the last context tokens) is always kept and counted inside the budget:
  per head, drawn + forced = keep_count(budget, region) = round(budget * region) (Python's round: halves to even);
- top-k keeps exactly that many; the randomized design keeps the n_head = n_keep - round(tail_fraction * n_keep)
  best-scored candidates with pi = 1 and draws the others independently with pi = min(1, c u),
  u = (1 - floor) s / sum(s) + floor / n_cand, sum(pi) = the expected tail size, offset -log(pi).
"""

from __future__ import annotations

import sys

import pytest
import torch

from kvcert.core import keep_count, split_head_tail
from kvcert.core.scorers import SCORERS, ScorerSpec
from kvcert.hf.prefill import Prefill
from kvcert.policy import FULL, Policy

L, HKV, HQ, D = 2, 2, 4, 8
N, QS, CTX_LO = 80, 70, 62  # prompt, question start (10-token question), context window [62, 70)
NEEDLES = (5, 17, 29, 41, 53)  # window scorers: positions the observation window attends to (strongest first)
EXAMPLE = "kept-sets"
SINKS = 4


def _keys(seed: int = 0) -> torch.Tensor:
    """(L, HKV, N, D): distinct norms in a random order; the needles share a direction the windows look along."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.nn.functional.normalize(torch.randn(L, HKV, N, D, generator=g), dim=-1)
    direction[..., 0] = 0.0  # feature 0 is the needles' alone
    direction = torch.nn.functional.normalize(direction, dim=-1)
    norms = 0.5 + torch.stack([torch.randperm(N, generator=g) for _ in range(L * HKV)]).view(L, HKV, N) * 0.05
    keys = direction * norms.unsqueeze(-1)
    for rank, pos in enumerate(NEEDLES):  # decreasing strength along feature 0
        keys[..., pos, :] = 0.0
        keys[..., pos, 0] = 3.0 - 0.4 * rank
    return keys


def _window(width: int) -> torch.Tensor:
    """(L, HQ, width, D) queries looking along feature 0 (what a question about the needles would do)."""
    q = torch.zeros(L, HQ, width, D)
    q[..., 0] = 4.0
    return q


def _prefill(keys: torch.Tensor) -> Prefill:
    return Prefill(
        model=None,
        input_ids=list(range(N)),
        question_start=QS,
        example_id=EXAMPLE,
        full_keys=[k[None] for k in keys],
        full_values=[torch.zeros_like(k)[None] for k in keys],
        window_queries={"question": [w[None] for w in _window(N - QS)], "context": [w[None] for w in _window(8)]},
        context_window=(CTX_LO, QS),
        scale=D**-0.5,
        last_logits=torch.zeros(1, 1),
        layer_windows=[None] * L,
    )


# ----------------------------------------------------------------------------------------- the specification
def spec_scores(scorer: str, keys: torch.Tensor, window: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """(L, HKV, n) float64 scores over the candidate keys (L, HKV, n, D), larger = keep."""
    n = keys.shape[-2]
    if scorer == "key_norm":
        return 1.0 / keys.double().norm(dim=-1)
    if scorer == "streaming":
        s = (torch.arange(n, dtype=torch.float64) + 1) / n
        s[:SINKS] = 2.0
        return s.expand(L, HKV, n).clone()
    if scorer == "random":
        return torch.rand((L, HKV, n), generator=gen).double()
    group = HQ // HKV
    out = torch.empty(L, HKV, n, dtype=torch.float64)
    for layer in range(L):
        for kv in range(HKV):
            q = window[layer, kv * group : (kv + 1) * group].reshape(-1, D).double()
            attn = torch.softmax(q @ keys[layer, kv].double().T * D**-0.5, -1).mean(0)
            out[layer, kv] = torch.stack([attn[max(0, i - 2) : i + 3].max() for i in range(n)])  # max pool, width 5
    return out


def top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(..., n) bool: the k highest scores, ties to the earlier position."""
    n = scores.shape[-1]
    order = sorted(range(n), key=lambda i: (-float(scores[i]), i))[:k]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order] = True
    return mask


def spec_pi(scores: torch.Tensor, cand: torch.Tensor, t: float, floor: float) -> torch.Tensor:
    """Inclusion probabilities by iterated capping: pi = min(1, c u), sum over the candidates = t."""
    u = (1 - floor) * scores * cand / (scores * cand).sum() + floor * cand / cand.sum()
    capped = torch.zeros_like(cand)
    while True:
        free = cand & ~capped
        c = (t - capped.sum()) / u[free].sum()
        over = free & (c * u > 1)
        if not over.any():
            break
        capped |= over
    pi = torch.where(capped, 1.0, c * u)
    return torch.where(cand, pi, torch.zeros_like(pi))


def kept_sets(comp, layer: int):
    """Per KV head: (kept positions, {position: offset}, tail positions with 1 - pi > 0) of a Compressed."""
    out = []
    for kv in range(HKV):
        idx, off = comp.indices[layer][kv], comp.offset[layer][kv]
        valid = torch.isfinite(off)
        s = comp.tail_slots[layer]
        tail = idx[:s][comp.one_minus_pi[layer][kv, :s] > 0] if s else idx[:0]
        out.append((set(idx[valid].tolist()), dict(zip(idx[valid].tolist(), off[valid].tolist())), set(tail.tolist())))
    return out


def region_and_forced(policy: Policy) -> tuple[int, tuple[int, int] | None]:
    if policy.scorer_window == "context":
        return QS, (CTX_LO, QS)
    region = N if policy.compress_after == "prompt" else QS
    return region, ((QS, N) if policy.compress_after == "prompt" and policy.protect_question else None)


def check_against_spec(policy: Policy, keys: torch.Tensor) -> None:
    comp = _prefill(keys)._compress_one(policy, pool_kernel=5)
    region, forced = region_and_forced(policy)
    lo, hi = forced if forced is not None else (region, region)
    n_forced = hi - lo
    total = keep_count(policy.budget, region)
    assert total == round(policy.budget * region)
    n_keep = total - n_forced
    gen = torch.Generator().manual_seed(policy.generator_seed(EXAMPLE))
    window = {"question": _window(N - QS), "context": _window(8)}.get(policy.scorer_window)
    scores = spec_scores(policy.scorer, keys[..., :lo, :], window, gen)
    n_head, n_tail = split_head_tail(n_keep, policy.tail_fraction) if policy.design != "topk" else (n_keep, 0)
    assert n_head == n_keep - round(policy.tail_fraction * n_keep) or policy.design == "topk"
    draws = torch.rand((L, HKV, lo), generator=gen, dtype=torch.float64) if policy.design != "topk" else None
    kept_counts = []
    for layer in range(L):
        for kv, (kept, offsets, tail) in enumerate(kept_sets(comp, layer)):
            where = (policy.label, layer, kv)
            assert set(range(lo, hi)) <= kept, ("the forced window is always kept", where)
            assert all(offsets[i] == 0 for i in range(lo, hi)), where
            assert all(i < hi for i in kept), where
            drawn = kept - set(range(lo, hi))
            head = top(scores[layer, kv], n_head)
            head_set = set(torch.nonzero(head).flatten().tolist())
            if policy.design == "topk":
                assert drawn == head_set, where
                assert len(kept) == total, ("keep_count: forced tokens inside the budget", where)
                assert not tail and all(v == 0 for v in offsets.values()), where
                continue
            assert head_set <= drawn, ("the n_head best candidates are kept", where)
            pi = spec_pi(scores[layer, kv], ~head, n_tail, policy.floor)
            assert float(pi.sum()) == pytest.approx(n_tail, abs=1e-9), "expected tail size"
            expected_tail = set(torch.nonzero((draws[layer, kv] < pi) & ~head).flatten().tolist())
            assert drawn - head_set == expected_tail, ("the tail is the seeded Poisson draw at pi", where)
            # a candidate capped at pi = 1 is always drawn and carries 1 - pi = 0: a certain token, like the head
            assert tail == {i for i in expected_tail if pi[i] < 1}, where
            for i in expected_tail:
                want = 0.0 if policy.design == "randomized_no_offset" else -float(torch.log(pi[i]))
                assert offsets[i] == pytest.approx(want, rel=1e-5, abs=1e-6), where
            assert all(offsets[i] == 0 for i in head_set), where
            kept_counts.append(len(kept))
    if policy.design == "topk":
        assert comp.kept_tokens == total
    else:  # drawn tokens averaged over (layer, head), plus the forced ones
        assert comp.kept_tokens == pytest.approx(sum(kept_counts) / len(kept_counts))


GRID = [
    Policy(scorer="key_norm", design="topk", budget=0.3),
    Policy(scorer="key_norm", design="randomized", budget=0.5, seed=3),
    Policy(scorer="key_norm", design="topk", budget=0.25, protect_question=True),  # forced question, counted
    Policy(scorer="streaming", design="topk", budget=0.25),
    Policy(scorer="streaming", design="randomized", budget=0.5, seed=2, tail_fraction=0.75),
    Policy(scorer="streaming", design="topk", budget=0.5, compress_after="context"),  # region = the context
    Policy(scorer="random", design="topk", budget=0.4, seed=5),
    Policy(scorer="random", design="randomized", budget=0.4, seed=5),
    Policy(scorer="window_question", design="topk", budget=0.35),  # 28 - 10 question = 18 drawn
    Policy(scorer="window_question", design="randomized", budget=0.5, seed=1, floor=0.5, tail_fraction=0.75),
    Policy(scorer="window_context", design="topk", budget=0.4),  # region 70, window [62, 70): 28 - 8 = 20 drawn
    Policy(scorer="window_context", design="randomized", budget=0.6, seed=4),
    Policy(scorer="key_norm", design="randomized_no_offset", budget=0.5, seed=3),
]


# the scorers ported from kvpress have their own specification (tests/test_kvpress_scorers.py)
SPECIFIED = {name for name, spec in SCORERS.items() if not spec.reads_inputs}


def test_the_grid_covers_every_registered_scorer_and_the_two_designs():
    assert {p.scorer for p in GRID} == SPECIFIED
    assert {(p.scorer, p.design) for p in GRID} >= {(s, d) for s in SPECIFIED for d in ("topk", "randomized")}


@pytest.fixture(params=[4, 14], ids=["group2", "group7"])
def query_heads(request, monkeypatch):
    """HQ query heads over the HKV = 2 KV heads: 2 per KV head (Llama-like) or 7 (Qwen2.5-0.5B's 14 / 2)."""
    monkeypatch.setattr(sys.modules[__name__], "HQ", request.param)
    return request.param


@pytest.mark.parametrize("policy", GRID, ids=[p.label for p in GRID])
def test_kept_set_equals_its_specification(policy, query_heads):
    check_against_spec(policy, _keys())


def test_the_specification_itself_in_words():
    """The same sets in plain terms, so that the float64 specification above cannot drift with the code."""
    keys = _keys()
    # key_norm, top-k, 30% of 80 = 24: the 24 smallest norms of every head
    comp = _prefill(keys)._compress_one(Policy(scorer="key_norm", design="topk", budget=0.3), pool_kernel=5)
    for layer in range(L):
        for kv, (kept, _, _) in enumerate(kept_sets(comp, layer)):
            norms = keys[layer, kv].norm(dim=-1)
            assert kept == set(norms.argsort()[:24].tolist())
            assert max(norms[list(kept)]) < min(norms[[i for i in range(N) if i not in kept]])
    # streaming, top-k, 25% of 80 = 20: the 4 sinks and the 16 most recent candidates (the question is evictable)
    comp = _prefill(keys)._compress_one(Policy(scorer="streaming", design="topk", budget=0.25), pool_kernel=5)
    assert all(kept == {0, 1, 2, 3, *range(N - 16, N)} for kept, _, _ in kept_sets(comp, 0))
    # window_question, top-k, 35% of 80 = 28 = 10 question tokens + 18: the 5-wide neighbourhoods of the needles,
    # strongest first (5 + 5 + 5 + the first 3 of the fourth: ties to the earlier position)
    comp = _prefill(keys)._compress_one(Policy(scorer="window_question", design="topk", budget=0.35), pool_kernel=5)
    want = {*range(3, 8), *range(15, 20), *range(27, 32), 39, 40, 41, *range(QS, N)}
    assert all(kept == want for kept, _, _ in kept_sets(comp, 1))
    # window_context: the context window [62, 70) is kept; the budget is a fraction of the context (70 tokens)
    comp = _prefill(keys)._compress_one(Policy(scorer="window_context", design="topk", budget=0.4), pool_kernel=5)
    want = {*range(3, 8), *range(15, 20), *range(27, 32), *range(39, 44), *range(CTX_LO, QS)}
    assert all(kept == want for kept, _, _ in kept_sets(comp, 0))
    # the full cache keeps everything at pi = 1
    comp = _prefill(keys)._compress_one(FULL, pool_kernel=5)
    assert all(kept == set(range(N)) and set(off.values()) == {0.0} for kept, off, _ in kept_sets(comp, 0))


def test_random_scores_are_a_seeded_permutation_independent_of_the_keys():
    pol = Policy(scorer="random", design="topk", budget=0.4, seed=5)
    a = _prefill(_keys(0))._compress_one(pol, pool_kernel=5)
    b = _prefill(_keys(1))._compress_one(pol, pool_kernel=5)  # other keys, same seed: the same sets
    c = _prefill(_keys(0))._compress_one(Policy(scorer="random", design="topk", budget=0.4, seed=6), pool_kernel=5)
    assert all(torch.equal(x.sort().values, y.sort().values) for x, y in zip(a.indices, b.indices))
    assert any(not torch.equal(x.sort().values, y.sort().values) for x, y in zip(a.indices, c.indices))
    g = torch.Generator().manual_seed(pol.generator_seed(EXAMPLE))
    perm = torch.rand((L, HKV, N), generator=g).argsort(-1, descending=True)  # the seeded permutation
    for layer in range(L):
        for kv in range(HKV):
            assert set(a.indices[layer][kv].tolist()) == set(perm[layer, kv, :32].tolist())


def test_keep_count_rounding():
    """round(budget * n), Python's round (halves to even), capped at n: what every budget above relies on."""
    assert keep_count(0.25, 10) == 2 and keep_count(0.25, 14) == 4 and keep_count(0.5, 5) == 2
    assert keep_count(0.3, 80) == 24 and keep_count(1.0, 7) == 7 and keep_count(0.01, 10) == 0
    assert split_head_tail(5, 0.5) == (3, 2) and split_head_tail(7, 0.5) == (3, 4)  # round(2.5) = 2, round(3.5) = 4
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            keep_count(bad, 10)


def test_the_randomized_kept_count_averages_the_budget():
    """Over many seeds the randomized design keeps keep_count(budget, N) tokens per head on average (forced in)."""
    keys = _keys()
    counts = []
    for seed in range(40):
        pol = Policy(scorer="window_question", design="randomized", budget=0.5, seed=seed)
        comp = _prefill(keys)._compress_one(pol, pool_kernel=5)
        counts += [len(kept) for layer in range(L) for kept, _, _ in kept_sets(comp, layer)]
    mean = sum(counts) / len(counts)
    assert abs(mean - keep_count(0.5, N)) < 1.0, mean  # 160 heads, tail sd <= sqrt(15) each: sd of the mean ~0.3


def test_a_flipped_key_norm_scorer_is_caught(monkeypatch):
    """The check above fails if key_norm kept the HIGH-norm keys (the scorer returning ||k|| instead of 1 / ||k||)."""

    def flipped(keys, *, window_queries, scale, pool_kernel, generator):
        return keys.float().norm(dim=-1)

    monkeypatch.setitem(SCORERS, "key_norm", ScorerSpec("key_norm", flipped, window=None))
    for pol in (GRID[0], GRID[1]):
        with pytest.raises(AssertionError):
            check_against_spec(pol, _keys())
