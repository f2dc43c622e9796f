"""Monte Carlo over Poisson draws: the certificate's variance is unbiased where the theory holds, and covers.

The README's regime table (well-scored, mis-scored, very peaked) is regenerated and compared digit for digit, so the
ranges it states are the ones the code gives. Run `pytest -s tests/test_core_montecarlo.py` to see the numbers.
"""

import re
from pathlib import Path

import torch

from kvcert.core.simulate import monte_carlo, random_problem, regime_table

DRAWS = 2000


def _run(seed, budget=0.5, design="randomized", **problem):
    g = torch.Generator().manual_seed(seed)
    p = random_problem(n=1000, d=64, generator=g, **problem)
    return monte_carlo(p, design=design, budget=budget, tail_fraction=0.5, floor=0.2, draws=DRAWS, generator=g)


def test_vhat_is_unbiased_and_covers_in_the_well_scored_regime():
    for seed, budget in [(1, 0.25), (2, 0.5), (3, 0.5)]:
        r = _run(seed, budget, peakedness=1.5, window_noise=0.3)
        assert abs(r["vhat_over_mse"] - 1) < 0.05, r["vhat_over_mse"]
        assert r["coverage"] >= 0.93, r["coverage"]


def test_without_the_offset_the_estimator_is_biased():
    for seed in [1, 2]:
        with_offset = _run(seed, 0.25, peakedness=1.5, window_noise=0.3)
        without = _run(seed, 0.25, design="randomized_no_offset", peakedness=1.5, window_noise=0.3)
        # Hajek bias is within a few Monte Carlo standard errors; the uncorrected one is many times larger
        assert with_offset["bias_norm"] < 4 * with_offset["bias_se"] + 1e-3
        assert without["bias_norm"] > 10 * with_offset["bias_norm"]
        assert without["bias_norm"] > 10 * without["bias_se"]


def _readme_rows() -> dict:
    """The README's regime table: (regime, budget, floor) -> the coverage and E[V_hat]/MSE ranges as printed."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {}
    for m in re.finditer(
        r"^\| (well-scored|mis-scored|very peaked) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.-]+) +\| ([\d.-]+) +\|$",
        text,
        re.M,
    ):  # cells padded to their column's width (kvcert.analysis.tables.markdown_table)
        rows[(m[1], float(m[2]), float(m[3]))] = (m[4], m[5])
    return rows


def test_regime_table_reproduces_the_readme_ranges(capsys):
    """`python -m kvcert.core.simulate` regenerates the README's table (floor 0.2 rows) digit for digit."""
    readme = _readme_rows()
    assert len(readme) == 12
    rows = []
    for r in regime_table(floors=(0.2,)):
        cov = f"{r['coverage_min']:.3f}-{r['coverage_max']:.3f}"
        ratio = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        assert readme[(r["regime"], r["budget"], r["floor"])] == (cov, ratio), r
        rows.append(f"{r['regime']:12s} budget {r['budget']:.2f}: coverage {cov}, E[V_hat]/MSE {ratio}")
    with capsys.disabled():
        print("\n" + "\n".join(rows))


def test_failure_regimes_reproduce_the_study1_pattern():
    """FAILURE_REGIMES: coverage falls where the tail's mass / effective sample size is small (SPEC section 9)."""
    from kvcert.core.simulate import FAILURE_REGIMES

    out = {}
    for name, kw in FAILURE_REGIMES.items():
        g = torch.Generator().manual_seed(1025)
        p = random_problem(n=1000, d=64, generator=g, **kw)
        r = monte_carlo(p, budget=0.25, tail_fraction=0.75, floor=0.2, draws=300, generator=g, moments=True)
        out[name] = dict(
            cov=r["coverage"],
            ratio=r["vhat_over_mse"],
            tail=float(r["tail_mass"].median()),
            ess=float(r["ess_tail"].median()),
            design_effect=float((r["ess_tail"] / r["n_tail"]).median()),
        )
    well, mis, peak, both = (out[k] for k in FAILURE_REGIMES)
    assert abs(well["ratio"] - 1) < 0.1 and well["cov"] > 0.99 and well["design_effect"] > 0.3
    assert mis["ratio"] < 0.9 and mis["design_effect"] < 0.3
    assert peak["tail"] < 2e-3 and peak["ess"] < 10 and peak["cov"] < 0.93
    assert both["ratio"] < 0.5 and both["ess"] < 5 and both["cov"] < 0.8
