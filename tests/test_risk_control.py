"""The budget selection rules (kvcert.core.risk_control) on simulated loss curves whose true risk per rung is known,
and the stream monitor (kvcert.core.risk_monitor) on simulated streams. Monte Carlo tolerances are declared per
test: with M repeats, a share's standard error is at most sqrt(0.25 / M); each test allows about 3 of them."""

from __future__ import annotations

import numpy as np
import pytest

from kvcert.core.risk_control import (
    RiskControlError,
    binomial_pvalue,
    hb_pvalue,
    min_n,
    monotone,
    repeat_splits,
    select,
    select_groups,
)
from kvcert.core.risk_monitor import RiskMonitor

LADDER = [0.1, 0.25, 0.5, 0.75]


def simulate(rng, n: int, risks) -> np.ndarray:
    """Monotone binary losses with true risk risks[k] at rung k: one uniform per prompt, lost where u < risk."""
    u = rng.random((n, 1))
    return (u < np.asarray(risks)[None, :]).astype(float)


def true_risk(budget: float, risks) -> float:
    return 0.0 if budget >= 1.0 else float(risks[LADDER.index(budget)])


def naive(losses, alpha: float) -> float:
    """The rule the guarantee protects against: the smallest rung whose empirical risk is within alpha."""
    risk = monotone(losses).mean(axis=0)
    ok = [b for b, r in zip(LADDER, risk) if r <= alpha]
    return ok[0] if ok else 1.0


def test_ltt_guarantee_holds_in_at_least_1_minus_delta_of_repeat_splits():
    """alpha = delta = 0.1, n = 100, a rung just above alpha (0.12): over 2,000 calibration draws the chosen budget's
    true risk exceeds alpha in at most delta (+ 0.02 Monte Carlo tolerance, 3 standard errors) of them. The naive
    empirical rule on the same draws violates far more often (the check has power: it could fail)."""
    rng = np.random.default_rng(0)
    risks = [0.5, 0.12, 0.06, 0.02]
    alpha, delta, m = 0.1, 0.1, 2000
    bad_ltt = bad_naive = 0
    chosen = []
    for _ in range(m):
        losses = simulate(rng, 100, risks)
        sel = select(losses, LADDER, alpha, delta, "ltt")
        chosen.append(sel.budget)
        bad_ltt += true_risk(sel.budget, risks) > alpha
        bad_naive += true_risk(naive(losses, alpha), risks) > alpha
    assert bad_ltt / m <= delta + 0.02
    assert bad_naive / m > 0.2
    assert 0.5 in chosen  # it does compress: the rung of risk 0.06 is chosen in some draws


def test_ltt_with_hoeffding_bentkus_on_continuous_losses_holds_too():
    """Losses in {0, 0.5, 1} (accuracy lost), not binary: the Hoeffding-Bentkus p-value, the same coverage (1,000
    draws, + 0.03). A lost prompt loses 0.5 or 1 with equal odds, so the true risk is 0.75 x the loss rate: 0.105
    at 0.25, just above alpha."""
    rng = np.random.default_rng(1)
    alpha, delta, m = 0.1, 0.1, 1000
    rates = np.array([0.6, 0.14, 0.06, 0.02])
    bad = 0
    for _ in range(m):
        u = rng.random((150, 1))
        size = rng.choice([0.5, 1.0], size=(150, 1))
        losses = (u < rates[None, :]) * size
        sel = select(losses, LADDER, alpha, delta, "ltt")
        assert sel.pvalue == "hoeffding-bentkus"
        bad += 0.75 * true_risk(sel.budget, rates) > alpha
    assert bad / m <= delta + 0.03


def test_crc_expected_risk_is_at_most_alpha():
    """CRC's promise is in expectation: over 4,000 draws of (calibration set, new prompt), the mean loss of the new
    prompt at the chosen budget is at most alpha (+ 0.015: 3 standard errors of a 0.1-mean Bernoulli at 4,000), on a
    curve whose smaller rungs sit just above alpha. It is not the full cache every time: compressed rungs are chosen
    and the new prompt's mean loss is well above 0."""
    rng = np.random.default_rng(2)
    risks = [0.13, 0.12, 0.11, 0.02]
    alpha, m, n = 0.1, 4000, 20
    new_loss, chosen = [], []
    for _ in range(m):
        losses = simulate(rng, n + 1, risks)
        cal, new = losses[:n], losses[n]
        sel = select(cal, LADDER, alpha, method="crc")
        new_loss.append(0.0 if sel.budget >= 1 else new[LADDER.index(sel.budget)])
        chosen.append(sel.budget)
    assert np.mean(new_loss) <= alpha + 0.015
    assert np.mean(new_loss) > 0.01 and np.mean(np.asarray(chosen) < 1) > 0.5


def test_refusal_fires_below_the_minimum_n_and_not_at_it():
    assert min_n("ltt", 0.1, 0.1) == 22  # 0.9^22 = 0.098 <= 0.1 < 0.9^21 = 0.109
    assert min_n("crc", 0.1) == 9 and min_n("crc", 0.05) == 19
    for method, delta in (("ltt", 0.1), ("crc", None)):
        need = min_n(method, 0.1, delta)
        zeros = np.zeros((need - 1, len(LADDER)))
        with pytest.raises(RiskControlError) as err:
            select(zeros, LADDER, 0.1, delta, method)
        assert str(err.value).count("\n") == 0 and f">= {'1/alpha - 1' if method == 'crc' else 'log'}" in str(err.value)
        assert "add prompts" in str(err.value)
        sel = select(np.zeros((need, len(LADDER))), LADDER, 0.1, delta, method)
        assert sel.budget == LADDER[0] and not sel.fallback  # at the minimum, zero losses certify the smallest rung
    assert (1 - 0.1) ** 22 <= 0.1 < (1 - 0.1) ** 21


def test_fallback_to_the_full_cache_when_no_budget_qualifies():
    losses = np.ones((200, len(LADDER)))
    for method in ("ltt", "crc"):
        sel = select(losses, LADDER, 0.1, 0.1, method)
        assert sel.budget == 1.0 and sel.fallback and "full cache" in sel.reason


def test_monotone_loss_and_selection_monotonicity():
    """The monotone loss bounds the loss and is non-increasing in the budget; a larger alpha never gives a larger
    budget, and adding losses never gives a smaller one."""
    rng = np.random.default_rng(3)
    raw = (rng.random((300, len(LADDER))) < [0.4, 0.2, 0.1, 0.05]).astype(float)
    mono = monotone(raw)
    assert (mono >= raw).all() and (np.diff(mono, axis=1) <= 0).all()
    for method in ("ltt", "crc"):
        chosen = [select(raw, LADDER, a, 0.1, method).budget for a in (0.05, 0.1, 0.2, 0.3, 0.5)]
        assert chosen == sorted(chosen, reverse=True)
        worse = raw.copy()
        worse[:60] = 1.0
        assert select(worse, LADDER, 0.2, 0.1, method).budget >= select(raw, LADDER, 0.2, 0.1, method).budget


def test_pvalues_are_valid_under_the_null():
    """At true risk exactly alpha, P(p <= delta) <= delta for both p-values (1,000 draws, + 0.03)."""
    rng = np.random.default_rng(4)
    n, alpha, delta = 80, 0.2, 0.1
    k = rng.binomial(n, alpha, size=1000)
    assert np.mean([binomial_pvalue(x / n, n, alpha) <= delta for x in k]) <= delta + 0.03
    assert np.mean([hb_pvalue(x / n, n, alpha) <= delta for x in k]) <= delta + 0.03
    assert hb_pvalue(0.0, 22, 0.1) == pytest.approx(0.9**22)


def test_per_group_budgets_each_with_its_guarantee_and_less_kv_than_pooled():
    """Two kinds of prompt: an easy one (risk 0.02 at 0.1) and a hard one (risk 0.3 until 0.75). Per group the easy
    kind gets the smallest budget and the hard one a large one; pooled must serve the hard kind too. The per-kind
    budgets hold less KV at the same alpha; a group with too few prompts is refused (full cache), the rest still
    chosen. Over repeat splits each group's realized risk stays near or below alpha."""
    rng = np.random.default_rng(5)
    easy = simulate(rng, 150, [0.02, 0.01, 0.0, 0.0])
    hard = simulate(rng, 150, [0.6, 0.4, 0.3, 0.02])
    tiny = simulate(rng, 5, [0.0, 0.0, 0.0, 0.0])
    losses = np.vstack([easy, hard, tiny])
    groups = ["easy"] * 150 + ["hard"] * 150 + ["tiny"] * 5
    kv = np.tile([*LADDER, 1.0], (len(losses), 1))
    pooled, per = select_groups(losses, groups, LADDER, 0.1, 0.1, "ltt", kv)
    assert per["easy"].budget == 0.1 and per["hard"].budget == 0.75
    assert per["tiny"].refused and per["tiny"].budget == 1.0 and "too few" in per["tiny"].refused
    assert pooled.budget == 0.75
    assert pooled.extra["per_kind_mean_kv"] < pooled.mean_kv
    two = np.vstack([easy, hard])
    val = repeat_splits(two, groups[:300], LADDER, 0.1, 0.1, "ltt", kv[:300], n_splits=40, seed=1)
    assert val["kind_kv"] < val["pooled_kv"]
    assert val["groups"]["easy"]["risk"] <= 0.1 and val["groups"]["hard"]["risk"] <= 0.1
    assert val["kind_within_alpha"] >= 0.9


# ----------------------------------------------------------------------------------------------- the monitor
def stream(rng, n: int, risk: float) -> np.ndarray:
    return (rng.random(n) < risk).astype(float)


def test_monitor_false_alarm_rate_is_at_most_delta_at_risk_alpha():
    """A stream at exactly alpha (the null's edge), 800 answers long, 300 repeats: flagged in at most delta
    (+ 0.05: 3.5 standard errors at 300) of them."""
    rng = np.random.default_rng(6)
    alarms = 0
    for _ in range(300):
        mon = RiskMonitor(alpha=0.1, delta=0.05)
        for loss in stream(rng, 800, 0.1):
            mon.update(loss)
        alarms += mon.flagged
    assert alarms / 300 <= 0.05 + 0.05


def test_monitor_flags_a_stream_that_drifts_and_not_before():
    """300 answers at risk 0.05, then the prompts change and the risk is 0.3: flagged after the drift in at least
    95% of 200 repeats, a median delay within 100 answers, and before it in at most delta (+ 0.05) of them."""
    rng = np.random.default_rng(7)
    early = late = 0
    delays = []
    for _ in range(200):
        mon = RiskMonitor(alpha=0.1, delta=0.05)
        losses = np.concatenate([stream(rng, 300, 0.05), stream(rng, 300, 0.3)])
        for loss in losses:
            mon.update(loss)
        if mon.flagged and mon.flagged_at <= 300:
            early += 1
        elif mon.flagged:
            late += 1
            delays.append(mon.flagged_at - 300)
    assert early / 200 <= 0.1
    assert late / 200 >= 0.95 - early / 200
    assert np.median(delays) <= 100  # about 46 here
    mon = RiskMonitor(alpha=0.1, delta=0.05)
    for loss in np.concatenate([stream(rng, 300, 0.05), stream(rng, 300, 0.3)]):
        mon.update(loss)
    line = mon.line()
    assert line.startswith("risk left the guarantee at answer") and "\n" not in line
    again = RiskMonitor.from_state(mon.state())
    assert again.flagged_at == mon.flagged_at and again.evidence == mon.evidence and again.n == mon.n


def test_monitor_line_within_the_guarantee():
    mon = RiskMonitor(alpha=0.1)
    assert "no checked answers" in mon.line()
    for loss in [0, 0, 1, 0, 0]:
        mon.update(loss)
    assert mon.line().startswith("risk within the guarantee so far: 1 lost of 5")
    with pytest.raises(ValueError):
        mon.update(2.0)


def test_the_validation_script_analyses_a_losses_file(tmp_path):
    """kvcert.exploratory.budget_validation analyse on simulated losses of two tasks: one easy at every budget, one
    that needs the full cache. Per kind holds less KV than pooled; the negative control serves the hard task with
    the easy task's budget, whose realized risk is far above alpha, and the monitor flags that stream."""
    import json

    from kvcert.exploratory.budget_validation import main

    rng = np.random.default_rng(8)
    prompts = []
    for task, risks in (("easy", [0.0, 0.0, 0.0, 0.0]), ("hard", [0.9, 0.9, 0.8, 0.6])):
        for length in (512, 1024):
            for i, row in enumerate(simulate(rng, 20, risks)):
                prompts.append(dict(id=f"{task}-{length}-{i}", group=f"{task}@{length}", loss=row.tolist(),
                                    kv=[*LADDER, 1.0]))  # fmt: skip
    data = dict(tasks=["easy", "hard"], lengths=[512, 1024], n_per_task=20, seed=0, wall_s=1.0, cpu="test", threads=1)
    losses = tmp_path / "losses.json"
    losses.write_text(json.dumps(dict(model="sim", ladder=LADDER, loss="differs", data=data, prompts=prompts)))
    assert main(["analyse", str(losses), "--splits", "20", "--out", str(tmp_path / "out")]) == 0
    got = json.loads((tmp_path / "out.json").read_text())
    ltt = got["methods"]["ltt"]
    assert ltt["kind_kv"] < ltt["pooled_kv"] and ltt["groups"]["easy@512"]["mean_budget"] == pytest.approx(0.1)
    (bad,) = [r for r in got["negative_control"] if r["calibrated_on"] == "easy@512"]
    assert bad["budget"] == 0.1 and bad["risk_served"] > 0.5 and bad["flagged_at"] is not None
    assert "| ltt | per kind |" in (tmp_path / "out.md").read_text()
