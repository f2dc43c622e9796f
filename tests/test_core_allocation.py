"""Head-wise budgets (AdaKV): the allocation against a hand-written global top-k, the designs at per-head counts
against one call per head, and the certificate's per-head coverage under the allocation (Monte Carlo)."""

from dataclasses import replace

import pytest
import torch

from kvcert.core import get_design
from kvcert.core.allocation import adakv_counts, allocate
from kvcert.core.probabilities import uniform_draws
from kvcert.core.simulate import random_problem
from kvcert.core.simulate_composed import monte_carlo_heads


def _adakv_by_hand(scores: torch.Tensor, n_keep: int, alpha: float) -> list[int]:
    """kvpress AdaKVPress.compress, one layer, in plain Python: each head's top int(alpha n_keep) are safe, then the
    global top (H n_keep) over all (head, position) pairs; ties to the earlier (head, position)."""
    n_heads, n = scores.shape
    n_safe = int(n_keep * alpha)
    entries = []
    for h in range(n_heads):
        row = scores[h].tolist()
        safe = set(sorted(range(n), key=lambda i: (-row[i], i))[:n_safe])
        entries += [(float("inf") if i in safe else row[i], h, i) for i in range(n)]
    entries.sort(key=lambda e: (-e[0], e[1], e[2]))
    counts = [0] * n_heads
    for _, h, _ in entries[: n_heads * n_keep]:
        counts[h] += 1
    return counts


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_counts_are_the_safeguarded_global_top_k(alpha):
    g = torch.Generator().manual_seed(0)
    # heads with very different spreads, and ties (rounded scores), so the safeguard and tie order both matter
    scores = torch.stack([torch.rand(80, generator=g) ** p for p in (1, 4, 12, 0.3)])
    scores = (scores * 50).round() / 50
    for n_keep in (0, 1, 7, 20, 80):
        counts = adakv_counts(scores, n_keep, alpha_safeguard=alpha)
        assert counts.tolist() == _adakv_by_hand(scores, n_keep, alpha)
        assert int(counts.sum()) == 4 * n_keep
        assert (counts >= int(n_keep * alpha)).all()
    layers = torch.stack([scores, scores.flip(0)])  # leading dims: one allocation per layer
    assert adakv_counts(layers, 20)[1].tolist() == _adakv_by_hand(scores.flip(0), 20, 0.2)
    assert allocate("uniform", scores, 20) == 20


def test_topk_at_adakv_counts_keeps_adakvs_set():
    g = torch.Generator().manual_seed(1)
    scores = torch.stack([torch.rand(50, generator=g) ** p for p in (1, 6, 0.5)])
    counts = adakv_counts(scores, 10)
    sel = get_design("topk")(scores, counts)
    flat = scores.clone()
    safe = scores.topk(2, dim=-1).indices
    flat.scatter_(-1, safe, float("inf"))
    top = flat.reshape(-1).topk(30).indices
    expected = torch.zeros(150, dtype=torch.bool)
    expected[top] = True
    kept = torch.zeros(3, 50, dtype=torch.bool).scatter_(-1, sel.indices, sel.valid)
    assert torch.equal(kept.reshape(-1), expected)


@pytest.mark.parametrize("design", ["randomized", "randomized_no_offset", "uniform", "topk"])
def test_per_head_counts_draw_what_one_call_per_head_draws(design):
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(2, 4, 120, generator=g) ** 3
    counts = torch.tensor([[5, 40, 77, 0], [120, 1, 30, 60]])
    draws = uniform_draws(tuple(scores.shape), torch.Generator().manual_seed(3))
    sel = get_design(design)(scores, counts, tail_fraction=0.6, floor=0.2, draws=draws)
    for b in range(2):
        for h in range(4):
            one = get_design(design)(
                scores[b, h : h + 1], int(counts[b, h]), tail_fraction=0.6, floor=0.2, draws=draws[b, h : h + 1]
            )
            m = int(one.kept_counts[0])
            assert int(sel.kept_counts[b, h]) == m
            assert torch.equal(sel.indices[b, h, :m], one.indices[0, :m])
            assert torch.equal(sel.log_pi[b, h, :m], one.log_pi[0, :m])
            assert torch.equal(sel.offset[b, h, :m], one.offset[0, :m])


def test_certificate_coverage_per_head_is_unchanged_by_the_adakv_allocation():
    """Four heads of one layer with different spreads; the values are 2-dimensional, so that the 95% radius is
    near-exact (coverage ~0.97, not the ~1.0 of high-dimensional values) and a change would show."""
    g = torch.Generator().manual_seed(11)
    problems = [
        replace(p, values=p.values[:, :2])
        for p in (random_problem(n=600, d=32, peakedness=k, window_noise=0.3, generator=g) for k in (0.8, 1.5, 2.5, 1))
    ]
    draws = 4000
    runs = {
        a: monte_carlo_heads(
            problems, allocation=a, budget=0.25, draws=draws, generator=torch.Generator().manual_seed(1)
        )
        for a in ("uniform", "adakv")
    }
    uniform, adakv = runs["uniform"], runs["adakv"]
    assert uniform["counts"].tolist() == [150] * 4
    assert adakv["counts"].tolist() != [150] * 4 and int(adakv["counts"].sum()) == 600  # AdaKV moved budget
    assert torch.allclose(adakv["kept_mean"], adakv["counts"].double(), atol=1.5)  # each head's own tail size
    se = (2 * 0.95 * 0.05 / draws) ** 0.5  # standard error of a difference of two coverages
    assert ((adakv["coverage"] - uniform["coverage"]).abs() < 4 * se).all(), (adakv["coverage"], uniform["coverage"])
    assert (adakv["coverage"] > 0.93).all()
    assert ((adakv["vhat_over_mse"] - 1).abs() < 0.1).all(), adakv["vhat_over_mse"]
