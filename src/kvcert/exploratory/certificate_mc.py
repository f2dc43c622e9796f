"""EXPLORATORY Monte Carlo: candidate certificate radii and remedies where the certificate fails.

    python -m kvcert.exploratory.certificate_mc [--draws 250] [--seeds 6] [--out results/exploratory]

Random attention problems (n = 1000, d = 64) in the four kvcert.core.simulate.FAILURE_REGIMES, randomized design
with the study-1 lock (tail fraction 0.75, floor 0.2) at budgets 0.25 and 0.5, plus the design remedy floor 0.5.
Every design draw is one "cell" with the per-cell statistics a decode step would record (V_hat, exact and
sketched tr(C^2), tail mass, tail ESS, ...). Candidate radii at 0.95 (kvcert.exploratory.certificate.radii) and
the split-conformal multiplier (fitted on a random half of the problems, checked on the other half) are compared
on coverage (pooled, worst regime, worst ESS bin), tightness (median radius / error) and, for the design change,
the accuracy proxy (root mean squared error of o_hat against floor 0.2). Writes certificate_mc.md / .csv and a
calibration figure. Not pre-registered.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from kvcert.analysis.tables import markdown_table
from kvcert.core.simulate import FAILURE_REGIMES, monte_carlo, random_problem
from kvcert.exploratory.certificate import (
    add_strata,
    calibration_curve,
    certificate_trusted,
    coverage_table,
    plot_calibration,
    radii,
    split_conformal,
)

STAT_KEYS = (
    "variance",
    "trace_c2",
    "trace_c2_sketch",
    "tail_mass",
    "ess_tail",
    "n_tail",
    "tail_max",
    "head_mass",
    "p_max",
)


def simulate_cells(
    draws: int = 250,
    seeds=range(1, 7),
    budgets=(0.25, 0.5),
    floors=(0.2, 0.5),
    tail_fraction: float = 0.75,
    sketch_k: int = 8,
) -> pd.DataFrame:
    """One row per design draw: regime, seed, budget, floor, example_id (the problem), error and the statistics."""
    frames = []
    for regime, kw in FAILURE_REGIMES.items():
        for seed in seeds:
            for budget in budgets:
                for floor in floors:
                    g = torch.Generator().manual_seed(1000 * seed + int(100 * budget))
                    prob = random_problem(generator=g, **kw)  # the same problem for both floors
                    r = monte_carlo(
                        prob,
                        budget=budget,
                        tail_fraction=tail_fraction,
                        floor=floor,
                        draws=draws,
                        generator=g,
                        moments=True,
                        sketch_k=sketch_k,
                    )
                    df = pd.DataFrame({k: r[k].double().numpy() for k in STAT_KEYS})
                    df["error"] = r["sq_err"].sqrt().numpy()
                    df["exact_norm"] = r["exact_norm"]
                    frames.append(
                        df.assign(
                            regime=regime, seed=seed, budget=budget, floor=floor, example_id=f"{regime}|{seed}|{budget}"
                        )
                    )
    return pd.concat(frames, ignore_index=True)


def _with_sketch(cells: pd.DataFrame) -> pd.DataFrame:
    return cells.drop(columns="trace_c2").rename(columns={"trace_c2_sketch": "trace_c2"})


def candidate_table(cells: pd.DataFrame, level: float = 0.95, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Coverage at `level` of every candidate: pooled, per regime (worst), per ESS bin (worst with n >= 100),
    median r / error; the conformal multipliers; returns (summary, long table by regime and ESS bin)."""
    rows, long = [], []
    for floor in sorted(cells["floor"].unique()):
        sub = add_strata(cells[cells["floor"] == floor].reset_index(drop=True))
        variants = {"": radii(sub, level), " (sketch k=8)": radii(_with_sketch(sub), level)}
        for tag, rf in variants.items():
            names = ["conservative", "tight", "conservative_ess", "tight_ess"] if not tag else ["tight", "tight_ess"]
            rf = rf.copy()
            conf = {}
            if not tag:
                for base in ("conservative", "tight", "tight_ess"):
                    sc = split_conformal(sub, base, level=level, n_boot=100, seed=seed, radius_frame=rf)
                    m = float(sc["multiplier"].mean())
                    conf[base] = sc
                    rf[f"r_conformal_{base}"] = rf[f"r_{base}"] * m
                    names.append(f"conformal_{base}")
                    long.append(sc.assign(floor=floor, table="conformal"))
                # one multiplier per tail-ESS bin (the stratum the failure concentrates in)
                sc = split_conformal(
                    sub, "tight_ess", level=level, per="ess_bin", n_boot=100, seed=seed, radius_frame=rf
                )
                mult = sc.groupby("stratum")["multiplier"].mean()
                rf["r_conformal_tight_ess_by_ess"] = rf["r_tight_ess"] * sub["ess_bin"].astype(str).map(mult).to_numpy()
                names.append("conformal_tight_ess_by_ess")
                conf["tight_ess_by_ess"] = sc
                long.append(sc.assign(floor=floor, table="conformal_by_ess"))
                sc = split_conformal(
                    sub, "tight", level=level, per="ess_ratio_bin", n_boot=100, seed=seed, radius_frame=rf
                )
                mult = sc.groupby("stratum")["multiplier"].mean()
                rf["r_conformal_tight_by_ess_ratio"] = (
                    rf["r_tight"] * sub["ess_ratio_bin"].astype(str).map(mult).to_numpy()
                )
                names.append("conformal_tight_by_ess_ratio")
                conf["tight_by_ess_ratio"] = sc
                long.append(sc.assign(floor=floor, table="conformal_by_ess_ratio"))
            for by in ("regime", "ess_bin", "tail_mass_bin", "ess_ratio_bin"):
                t = coverage_table(sub, by, level=level, radius_frame=rf, names=names)
                long.append(t.assign(floor=floor, variant=tag, table=by))
            pooled = coverage_table(sub, None, level=level, radius_frame=rf, names=names)
            by_regime = coverage_table(sub, "regime", level=level, radius_frame=rf, names=names)
            by_ess = coverage_table(sub, "ess_bin", level=level, radius_frame=rf, names=names)
            by_ess = by_ess[by_ess["n"] >= 100] if (by_ess["n"] >= 100).any() else by_ess
            trusted = certificate_trusted(sub)
            tr_tab = coverage_table(sub[trusted], None, level=level, radius_frame=rf[trusted], names=names)
            for n in names:
                worst_reg = by_regime.loc[by_regime[f"coverage_{n}"].fillna(np.inf).idxmin()]
                worst_ess = by_ess.loc[by_ess[f"coverage_{n}"].fillna(np.inf).idxmin()]
                rows.append(
                    {
                        "floor": floor,
                        "radius": n + tag,
                        "coverage_pooled": pooled[f"coverage_{n}"].iloc[0],
                        "worst_regime": worst_reg["regime"],
                        "coverage_worst_regime": worst_reg[f"coverage_{n}"],
                        "worst_ess_bin": worst_ess["ess_bin"],
                        "coverage_worst_ess_bin": worst_ess[f"coverage_{n}"],
                        "coverage_trusted": tr_tab[f"coverage_{n}"].iloc[0],
                        "share_trusted": float(trusted.mean()),
                        "median_r_over_err": pooled[f"median_r_over_err_{n}"].iloc[0],
                        "multiplier": (
                            " ".join(
                                f"{k}:{m:.2f}" if k is not None else f"{m:.2f}"
                                for k, m in conf[n[len("conformal_") :]]
                                .fillna({"stratum": "all"})
                                .groupby("stratum", sort=False)["multiplier"]
                                .mean()
                                .items()
                            )
                            if n.startswith("conformal_")
                            else ""
                        ),
                    }
                )
    return pd.DataFrame(rows), pd.concat(long, ignore_index=True)


def accuracy_cost(cells: pd.DataFrame) -> pd.DataFrame:
    """Design remedy cost: RMSE of o_hat per regime and budget at each floor, and the ratio to floor 0.2."""
    t = (
        cells.groupby(["regime", "budget", "floor"])
        .agg(rmse=("error", lambda e: float(np.sqrt(np.mean(e**2)))), mean_error=("error", "mean"))
        .reset_index()
    )
    base = t[t["floor"] == 0.2].set_index(["regime", "budget"])["rmse"]
    t["rmse_ratio_to_floor0.2"] = [r / base[(g, b)] for g, b, r in zip(t["regime"], t["budget"], t["rmse"])]
    return t


def threshold_grid(cells: pd.DataFrame, level: float = 0.95, radius: str = "tight_ess") -> pd.DataFrame:
    """Coverage of one radius inside / outside the trusted set over a grid of (ess_min, tail_mass_min)."""
    sub = cells[cells["floor"] == 0.2].reset_index(drop=True)
    rf = radii(sub, level)
    covered = (sub["error"] <= rf[f"r_{radius}"]).to_numpy()
    rows = []
    for ess_min, tm_min, ratio_min in [(e, t, 0.0) for e in (0, 2, 5, 10, 20) for t in (0, 1e-3, 1e-2, 0.1)] + [
        (e, 1e-2, r) for e in (0, 10) for r in (0.05, 0.1, 0.2, 0.3, 0.5)
    ]:
        ok = certificate_trusted(sub, ess_min=ess_min, tail_mass_min=tm_min, ess_ratio_min=ratio_min).to_numpy()
        rows.append(
            {
                "radius": radius,
                "ess_min": ess_min,
                "tail_mass_min": tm_min,
                "ess_ratio_min": ratio_min,
                "share_trusted": ok.mean(),
                "coverage_trusted": covered[ok].mean() if ok.any() else np.nan,
                "coverage_untrusted": covered[~ok].mean() if (~ok).any() else np.nan,
            }
        )
    return pd.DataFrame(rows)


def _md(df: pd.DataFrame, floatfmt: str = "{:.3f}") -> str:
    cols = list(df.columns)
    lines = []
    for _, r in df.iterrows():
        cells = [
            (str(int(v)) if float(v).is_integer() and abs(v) >= 1 else floatfmt.format(v))
            if isinstance(v, float) and not np.isnan(v)
            else ("" if isinstance(v, float) else str(v))
            for v in r
        ]
        lines.append(cells)
    return markdown_table(pd.DataFrame(lines, columns=cols), parse_numbers=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=250)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--out", default="results/exploratory")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cells = simulate_cells(draws=args.draws, seeds=range(1, args.seeds + 1))
    summary, long = candidate_table(cells)
    cost = accuracy_cost(cells)
    grid = pd.concat(
        [threshold_grid(cells, radius=r) for r in ("conservative", "tight", "tight_ess")], ignore_index=True
    )
    summary.to_csv(out / "certificate_mc.csv", index=False)
    long.to_csv(out / "certificate_mc_strata.csv", index=False)
    base = cells[cells["floor"] == 0.2]
    curve_all = calibration_curve(base, names=("conservative", "tight", "tight_ess"))
    curve_well = calibration_curve(base[base["regime"] == "well-scored"], names=("conservative", "tight"))
    plot_calibration(
        curve_all, out / "certificate_mc_calibration.png", "EXPLORATORY Monte Carlo, all regimes (floor 0.2)"
    )
    plot_calibration(
        curve_well, out / "certificate_mc_calibration_well_scored.png", "EXPLORATORY Monte Carlo, well-scored regime"
    )
    regimes = (
        cells[cells["floor"] == 0.2]
        .assign(ess_ratio=lambda c: c["ess_tail"] / c["n_tail"])
        .groupby("regime")
        .agg(
            tail_mass_median=("tail_mass", "median"),
            ess_median=("ess_tail", "median"),
            ess_ratio_median=("ess_ratio", "median"),
            n_tail_median=("n_tail", "median"),
        )
        .reset_index()
    )
    h = (base["variance"] ** 2 / base["trace_c2"]).groupby(base["regime"]).median()
    regimes["eff_dim_median"] = regimes["regime"].map(h)
    ratio = base.groupby("regime").apply(
        lambda g: g["variance"].mean() / (g["error"] ** 2).mean(), include_groups=False
    )
    regimes["E[V_hat]/MSE"] = regimes["regime"].map(ratio)
    by_regime = long[(long["table"] == "regime") & (long["variant"] == "") & (long["floor"] == 0.2)]
    by_ess = long[(long["table"] == "ess_bin") & (long["variant"] == "") & (long["floor"] == 0.2)]
    by_ratio = long[(long["table"] == "ess_ratio_bin") & (long["variant"] == "") & (long["floor"] == 0.2)]
    by_regime5 = long[(long["table"] == "regime") & (long["variant"] == "") & (long["floor"] == 0.5)]
    keep = ["n"] + [c for c in by_regime.columns if c.startswith("coverage_")]
    text = f"""# EXPLORATORY: certificate radii and remedies on Monte Carlo

Not pre-registered; input to the design of a future study. Generated by `python -m kvcert.exploratory.certificate_mc
--draws {args.draws} --seeds {args.seeds}` ({time.time() - t0:.0f} s). Data: random attention problems (n = 1000,
d = 64) in the regimes of `kvcert.core.simulate.FAILURE_REGIMES`, {args.seeds} problems per regime and budget
(0.25, 0.5), {args.draws} design draws each, randomized design at tail fraction 0.75 and floor 0.2 (the study-1
lock) and floor 0.5 (design remedy). One cell = one design draw. Level 0.95 throughout.

Radii: conservative = 1.96 sqrt(V_hat); tight = Satterthwaite sqrt(V_hat chi2_0.95(h) / h) with the debiased
tr(C^2) (exact; "sketch k=8" = the cheap estimator); *_ess = studentized by the tail's Kish ESS (t or F quantile,
nu = ESS - 1); conformal_* = split-conformal multiplier fitted on a random half of the problems, coverage on the
other half (multiplier = mean of the two fits).
Trusted = `certificate_trusted` (ESS >= 10, tail mass >= 0.01, ESS / n_tail >= 0.3).

## Regimes (floor 0.2)

{_md(regimes)}

## Candidates at 0.95

{_md(summary)}

## Coverage by regime (floor 0.2)

{_md(by_regime[["regime"] + keep])}

## Coverage by tail ESS bin (floor 0.2)

{_md(by_ess[["ess_bin"] + keep])}

## Coverage by ess_tail / n_tail bin (floor 0.2)

{_md(by_ratio[["ess_ratio_bin"] + keep])}

## Design remedy floor 0.5: coverage by regime

{_md(by_regime5[["regime"] + keep])}

## Design remedy: accuracy proxy (RMSE of o_hat) by floor

{_md(cost, "{:.4g}")}

## certificate_trusted thresholds (floor 0.2)

{_md(grid)}

Figures: `certificate_mc_calibration.png` (all regimes), `certificate_mc_calibration_well_scored.png`.
Per-stratum tables and the conformal fits with bootstrap intervals: `certificate_mc_strata.csv`.
"""
    (out / "certificate_mc.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
