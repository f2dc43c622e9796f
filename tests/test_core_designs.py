"""Designs and inclusion probabilities: exact budgets, valid probabilities, determinism, input errors."""

import pytest
import torch

from kvcert.core import get_design, inclusion_probabilities, keep_count, split_head_tail
from kvcert.core.perturb import evicted_mask


def _scores(shape=(2, 3, 200), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) ** 3


@pytest.mark.parametrize("floor", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_inclusion_probabilities_exact_size_cap_and_floor(floor, power):
    s = _scores()
    s[..., 0] = 1e6  # a token that must be capped at 1
    cand = torch.ones_like(s, dtype=torch.bool)
    cand[..., :10] = False
    t = 37.0
    pi = inclusion_probabilities(s, cand, t, floor=floor, score_power=power)
    assert torch.allclose(pi.sum(-1), torch.full(pi.shape[:-1], t, dtype=torch.float64), atol=1e-6)
    assert (pi[~cand] == 0).all()
    assert (pi <= 1).all()
    if floor > 0:
        assert (pi[cand] > 0).all()
        # the floor: pi_i >= c * floor / n_cand, and c >= t (sum u = 1, caps only raise c)
        assert (pi[cand] >= min(1.0, t * floor / 190) * (1 - 1e-9)).all()


def test_inclusion_probabilities_capped_tokens_are_one():
    s = torch.tensor([[100.0, 50.0, 1.0, 1.0, 1.0, 1.0]])
    pi = inclusion_probabilities(s, torch.ones_like(s, dtype=torch.bool), 3.0, floor=0.0, score_power=1.0)
    assert pi[0, 0] == 1 and pi[0, 1] == 1
    assert torch.allclose(pi[0, 2:], torch.full((4,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("design", ["randomized", "randomized_no_offset", "uniform"])
def test_randomized_designs_head_tail_and_expected_size(design):
    s = _scores((4000, 300))
    n_keep, tau = 90, 0.5
    n_head, n_tail = split_head_tail(n_keep, tau)
    sel = get_design(design)(s, n_keep, tail_fraction=tau, floor=0.2, generator=torch.Generator().manual_seed(1))
    # the n_head best tokens of every row are kept with pi = 1 (log pi = 0)
    top = s.topk(n_head, dim=-1).indices
    kept = ~evicted_mask(sel.indices, sel.valid, s.shape[-1])
    assert kept.gather(-1, top).all()
    head_entries = sel.valid & (sel.log_pi == 0)
    assert (head_entries.sum(-1) >= n_head).all()
    # tail first: every tail entry sits in the first tail_slots columns
    tail_entries = sel.valid & (sel.log_pi < 0)
    assert not tail_entries[:, sel.tail_slots :].any()
    # the realized tail size averages tau * budget (Poisson sampling: sd sqrt(sum pi(1-pi)) per row)
    mean_kept = sel.kept_counts.double().mean()
    assert abs(mean_kept - n_keep) < 0.5
    assert torch.isinf(sel.offset[~sel.valid]).all()
    if design == "randomized_no_offset":
        assert (sel.offset[sel.valid] == 0).all()
    else:
        assert torch.allclose(sel.offset[sel.valid], -sel.log_pi[sel.valid])


def test_topk_keeps_exactly_the_best_and_has_no_certificate():
    s = _scores()
    sel = get_design("topk")(s, 20)
    assert not sel.has_certificate
    assert (sel.kept_counts == 20).all()
    assert torch.equal(sel.indices.sort(-1).values, s.topk(20, dim=-1).indices.sort(-1).values)
    assert (sel.log_pi == 0).all() and sel.tail_slots == 0


def test_same_seed_same_selection_and_different_seed_differs():
    s = _scores()
    draw = lambda seed: get_design("randomized")(s, 60, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = draw(5), draw(5), draw(6)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.log_pi, b.log_pi)
    assert not torch.equal(a.indices, c.indices)


def test_keep_all_selects_every_token():
    s = _scores((3, 50))
    for name in ["topk", "randomized", "uniform"]:
        sel = get_design(name)(s, 50, generator=torch.Generator().manual_seed(0))
        assert (sel.kept_counts == 50).all()
        assert (sel.log_pi[sel.valid] == 0).all()
        assert not evicted_mask(sel.indices, sel.valid, 50).any()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_keep=10, tail_fraction=1.0), "tail_fraction"),
        (dict(n_keep=10, tail_fraction=-0.1), "tail_fraction"),
        (dict(n_keep=500), "n_keep"),
        (dict(n_keep=10, floor=1.5), "floor"),
        (dict(n_keep=10, score_power=0.0), "score_power"),
    ],
)
def test_bad_design_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_design("randomized")(_scores(), generator=torch.Generator(), **kwargs)


def test_bad_scores_and_budget_and_names():
    g = torch.Generator()
    with pytest.raises(ValueError, match="non-negative"):
        get_design("randomized")(-_scores(), 10, generator=g)
    bad = _scores()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        get_design("topk")(bad, 10)
    with pytest.raises(ValueError, match="generator"):
        get_design("randomized")(_scores(), 10)
    for budget in [0.0, 1.5, -1, float("nan")]:
        with pytest.raises(ValueError, match="budget"):
            keep_count(budget, 100)
    assert keep_count(0.25, 1000) == 250 and keep_count(1.0, 7) == 7
    with pytest.raises(ValueError, match="design must be one of"):
        get_design("nope")


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (4, 5, 300), (2, 0)])
def test_tail_first_order_is_the_stable_sort_by_class(shape):
    """Selections order each row tail, head, rest, each by position: the permutation a sort of a unique key per
    token (class, then position) gives, found here by counting."""
    from kvcert.core.selection import tail_first_order

    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        tail = torch.rand(shape, generator=g) < 0.3
        head = torch.rand(shape, generator=g) < 0.4  # overlapping the tail: the tail wins, as in a selection
        n = shape[-1]
        key = torch.where(tail, 0, torch.where(head, 1, 2)) * (n + 1) + torch.arange(n)
        assert torch.equal(tail_first_order(tail, head), key.argsort(dim=-1))


@pytest.mark.parametrize(
    "design, half",
    [("topk", None), ("randomized", None), ("randomized", 0), ("randomized_no_offset", None), ("uniform", None)],
)
@pytest.mark.parametrize("per_row", [False, True])
def test_a_design_given_the_scores_order_selects_what_it_selects_by_sorting(design, half, per_row, monkeypatch):
    """Several budgets over the same scores sort once (kvcert.hf.compress.select_together): with `order` every design
    keeps the same tokens with the same offsets, bit for bit, also with tied scores and a row of zeros, and sorts
    nothing itself."""
    from kvcert.core.selection import descending_order

    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 6, 300, generator=gen)
    scores[..., ::7] = 0.25  # ties
    scores[0, 0] = 0.0  # a row of zero scores: u is the floor alone
    n_keep = torch.randint(1, 300, (2, 6), generator=gen) if per_row else 90
    draws = torch.rand(scores.shape, generator=gen, dtype=torch.float64)
    extra = {} if half is None else {"half": half}
    kwargs = dict(tail_fraction=0.5, floor=0.2, score_power=1.5, generator=None, draws=draws, **extra)
    plain = get_design(design)(scores, n_keep, **kwargs)
    order = descending_order(scores)

    def no_sort(*args, **kwargs):
        raise AssertionError("sorted although the order was given")

    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    ordered = get_design(design)(scores, n_keep, order=order, **kwargs)
    monkeypatch.undo()
    for name in ("indices", "log_pi", "offset", "valid", "tail_counts"):
        assert torch.equal(getattr(plain, name), getattr(ordered, name)), name
    assert plain.tail_slots == ordered.tail_slots


def test_inclusion_probabilities_read_off_an_order_equal_the_sorted_ones_and_a_wrong_order_is_ignored():
    scores = torch.rand(4, 200, generator=torch.Generator().manual_seed(0)).double()
    candidates = torch.ones_like(scores, dtype=torch.bool)
    kwargs = dict(floor=0.1, score_power=2.0)
    plain = inclusion_probabilities(scores, candidates, 40.0, **kwargs)
    good = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    assert torch.equal(inclusion_probabilities(scores, candidates, 40.0, order=good, **kwargs), plain)
    wrong = good.flip(-1)  # u increasing along it: not used, u is sorted instead
    assert torch.equal(inclusion_probabilities(scores, candidates, 40.0, order=wrong, **kwargs), plain)
