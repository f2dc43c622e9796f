"""EXPLORATORY power analysis (kvcert.exploratory.power): synthetic records whose answer is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcert.analysis import accuracy, auroc, coverage
from kvcert.analysis.bootstrap import cluster_bootstrap, weighted_mean
from kvcert.exploratory import power as P
from synthetic import NB, synthetic_examples, synthetic_steps


def test_known_sd_gives_known_n():
    # 1.96 * 10 / sqrt(N) <= 1.96  <=>  N >= 100
    assert P.n_for_half_width(10.0, P.Z) == 100
    assert P.n_for_half_width(10.0, P.Z * 1.0001) == 100
    assert P.n_for_half_width(10.0, P.Z * 0.999) == 101
    assert P.half_width(10.0, 100) == pytest.approx(P.Z)
    assert P.sd_from_interval(-P.Z, P.Z, 100) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        P.n_for_half_width(1.0, 0.0)


def test_power_is_one_half_when_effect_sits_one_critical_value_above_threshold():
    sd, n = 10.0, 100
    assert P.power_one_sided(2.0 + P.Z * sd / math.sqrt(n), 2.0, sd, n) == pytest.approx(0.5)
    assert P.power_one_sided(100.0, 2.0, sd, n) > 0.999


def test_ratio_cluster_sd_equals_sd_of_cluster_means_when_clusters_are_equal():
    rng = np.random.default_rng(0)
    means = rng.normal(size=50)
    est, sd = P.ratio_cluster_sd(means * 9, np.full(50, 9.0))
    assert est == pytest.approx(means.mean())
    assert sd == pytest.approx(means.std(ddof=1))


def test_cluster_sd_matches_the_locked_bootstrap_and_recovers_the_planted_sd():
    # 400 examples, each with 9 paired units; the per-example mean difference has SD 0.3 by construction
    rng = np.random.default_rng(1)
    n, k, sd_true = 400, 9, 0.3
    ex_effect = rng.normal(0.0, sd_true, size=n)
    clusters = np.repeat(np.arange(n), k)
    values = np.repeat(ex_effect, k)  # no within-example noise: the cluster SD is exactly the planted SD
    est, sd, n_clusters = P.cluster_mean_sd(values, clusters)
    assert n_clusters == n
    assert sd == pytest.approx(sd_true, rel=0.1)
    ci = cluster_bootstrap(weighted_mean(values), clusters, n_boot=1000, seed=3)
    assert (ci.hi - ci.lo) / 2 == pytest.approx(P.half_width(sd, n), rel=0.1)
    # and the N for a target half-width is the textbook one
    assert P.n_for_half_width(sd_true, 0.03) == math.ceil((P.Z * sd_true / 0.03) ** 2)


def test_hanley_mcneil_matches_the_preregistered_power_section():
    # PREREGISTRATION.md section 2: half-width 0.096 at AUROC 0.75 with 50 / 50, 0.124 with 30 / 30
    assert P.Z * P.hanley_mcneil_se(0.75, 50, 50) == pytest.approx(0.096, abs=0.002)
    assert P.Z * P.hanley_mcneil_se(0.75, 30, 30) == pytest.approx(0.124, abs=0.002)


def test_auroc_scaling_is_consistent():
    se0, npos, nneg = 0.07, 50, 70
    assert P.auroc_se_at(se0, npos, nneg, 4 * npos, 4 * nneg) == pytest.approx(se0 / 2)
    # at the original rates (npos / 140, nneg / 140), the N for half-width z * se0 is the original 140
    assert P.n_for_auroc_half_width(se0, npos, nneg, npos / 140, nneg / 140, P.Z * se0) == 140
    assert P.n_for_auroc_half_width(se0, npos, nneg, 0.0, 0.5, 0.1) == -1
    assert P.n_for_counts(0.25, 50) == 200
    assert P.n_for_counts(0.0, 50) == -1


def test_failure_counts_known():
    ex = synthetic_examples(n=100, seed=2)
    tab = P.failure_counts(ex).set_index(["scorer", "design", "budget"])
    sub = ex[(ex["design"] == "randomized") & (ex["budget"] == 0.5)]
    fail = ~sub["correct"]
    row = tab.loc[("window_question", "randomized", 0.5)]
    assert row["cache_induced"] == int((fail & sub["full_correct"]).sum())
    assert row["inherent"] == int((fail & ~sub["full_correct"]).sum())
    assert row["failures"] == row["cache_induced"] + row["inherent"]
    # the full cache's own failures are the inherent ones at every budget
    assert (tab["inherent"] == int((~ex[ex["design"] == "full"]["full_correct"]).sum())).all()


def test_c2_and_c3_estimates_equal_the_locked_analysis():
    ex = synthetic_examples(n=120, seed=4, rand_penalty=0.1)
    c2 = P.c2_units_sd(ex, c2_scorers=("window_question",))
    locked = accuracy.paired_accuracy_difference(
        ex, {**P.LOCKED, "design": "randomized"}, {"design": "topk"}, ["scorer", "budget"], n_boot=NB, seed=0
    )
    assert c2["estimate"] == pytest.approx(locked["diff"]["estimate"])
    assert (locked["diff"]["hi"] - locked["diff"]["lo"]) / 2 == pytest.approx(P.half_width(c2["sd"], 120), rel=0.25)
    c3 = P.c3_drop_sd(ex)
    ref = accuracy.drop_vs_full(
        accuracy.select_rows(ex, {"scorer": "window_question", "design": "topk", "budget": [0.25, 0.5]}), n_boot=NB
    )
    assert c3["estimate"] == pytest.approx(ref["drop"]["estimate"])


def test_c1_sd_matches_the_locked_pooled_coverage():
    ex = synthetic_examples(n=60, seed=5)
    st = synthetic_steps(ex, inflate=1.2)
    rows = {**P.LOCKED, "design": "randomized", "scorer": "window_question", "budget": [0.25, 0.5]}
    res = P.c1_coverage_sd(ex, st, rows)
    sel = accuracy.select_rows(ex, rows)
    locked = coverage.pooled_coverage(coverage.steps_for(sel, st), n_boot=1000)
    assert res["estimate"] == pytest.approx(locked["coverage"])
    assert (locked["hi"] - locked["lo"]) / 2 == pytest.approx(P.half_width(res["sd"], res["n"]), rel=0.2)
    trusted = P.c1_coverage_sd(ex, st, rows, min_tail_mass=0.1)
    assert trusted["n_cells"] < res["n_cells"]


def test_attribution_and_escalation_read_the_locked_functions():
    ex = synthetic_examples(n=150, seed=6)
    att = P.attribution_at(ex, 0.5, n_boot=NB)
    sel = accuracy.select_rows(ex, {**P.LOCKED, "design": "randomized", "scorer": "window_question", "budget": 0.5})
    ref = auroc.failure_attribution(sel, n_boot=NB, seed=20260101)
    assert att["c6_auc_diff"]["estimate"] == pytest.approx(ref["diff"]["estimate"])
    assert att["cache_induced"] == ref["n_pos"] and att["inherent"] == ref["n_neg"]
    assert att["c6_auc_diff"]["sd"] > 0
    esc = P.escalation_at(ex, 0.25, 0.5, n_boot=NB)
    assert esc["n_units"] == 150
    assert math.isfinite(esc["gain_random"]["sd"])


def test_budget_choice_follows_the_rarer_failure_kind():
    ex = synthetic_examples(n=200, seed=7)
    # half the examples at 1k, half at 2k tokens
    ex = ex.assign(context_tokens=np.where(ex["example_id"].str[-1].astype(int) % 2 == 0, 1000, 2000))
    budget, rates = P.choose_attribution_budget(ex)
    # synthetic keep rates 0.3 / 0.6 / 0.85: the lowest budget has the most cache-induced failures
    assert budget == 0.25
    assert rates[0.25]["mean"]["cache_induced"] > rates[0.75]["mean"]["cache_induced"]
    assert P.extrapolate_rate(0.4, 0.2) == pytest.approx(0.1)
    assert P.extrapolate_rate(0.0, 0.2) == pytest.approx(0.2)


def test_power_table_runs_on_synthetic_records():
    ex = synthetic_examples(n=150, seed=8, scorers=P.SCORERS_C2)
    ex = ex.assign(context_tokens=np.where(ex["example_id"].str[-1].astype(int) % 2 == 0, 1000, 2000))
    st = synthetic_steps(ex, cells=6)
    table, info = P.power_table(
        ex, st, attribution_budget=0.5, c4_budget=0.75, escalation=(0.5, 0.75), n_proposed=300, n_boot=NB
    )
    assert set(table["claim"]) >= {"C1", "C2", "C3", "C4", "C5", "C6", "C7"}
    assert (table["n_needed"] >= 1).all()
    c2 = table.set_index("claim").loc["C2"]
    assert c2["n_needed"] == P.n_for_half_width(c2["sd_per_example"], 2.0)
    assert isinstance(info["attribution_rates"]["4k"]["cache_induced"], float)


def test_variants_and_wall_time():
    need = P.variants_by_claim(0.25, (0.5, 0.75))
    union = set().union(*need.values())
    assert len(union) == 19  # the 21-variant grid less the two descriptive ablations
    assert ("window_question", "uniform", 0.5) not in union
    tab = P.variant_table(0.25, (0.5, 0.75))
    assert (tab["claims"] == "none (descriptive)").sum() == 2
    # 1 example per cell, 21 variants, one worker: (8 + 12.8 + 28) s x 5 tasks
    assert P.wall_minutes(1, 21, workers=1) == pytest.approx(5 * 8.0 * (1 + 1.6 + 3.5) / 60)
    assert P.wall_minutes(2, 21, workers=2) == pytest.approx(P.wall_minutes(1, 21, workers=1))
    assert P.seconds_per_example(1000, 0) == pytest.approx(8.0 * 0.12)
    # the claims column is the inverse of variants_by_claim: every (variant, claim) pair once, in claim order
    by_variant = tab.set_index(["scorer", "design", "budget"])["claims"]
    assert len(by_variant) == 21 and by_variant.index.is_unique
    assert by_variant[("none", "full", 1.0)] == "C1, C2, C3, C4, C5, C6, C7"
    assert by_variant[("window_question", "randomized", 0.25)] == "C1, C2, C6, C7"
    assert by_variant[("window_question", "randomized", 0.75)] == "C2, C4, C5"
    pairs = {(v, c) for v, claims in by_variant.items() for c in claims.split(", ") if c.startswith("C")}
    assert pairs == {(v, c) for c, vs in need.items() for v in vs}
    # the decode share scales with the variants, the rest is fixed: 4k at 21 variants is 3.5 x 8 s
    assert P.seconds_per_example(4000, 21) == pytest.approx(28.0)
    assert P.seconds_per_example(2000, 42) == pytest.approx(8.0 * 1.6 * (0.12 + 0.88 * 2))
