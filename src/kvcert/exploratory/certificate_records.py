"""EXPLORATORY: the certificate's coverage on real step records, by stratum, with the split-conformal multiplier.

    python -m kvcert.exploratory.certificate_records RUN_DIR [--out results/exploratory] [--n-boot 200]

RUN_DIR holds examples.parquet and steps.parquet (or, while a run is in flight, shards/*.parquet). Scope: the C1
rows (randomized design, window_question scorer, budgets 0.25 / 0.5, the locked tail fraction / floor), plus the
same tables over every randomized variant. Records without trace_c2 / eff_dim cannot give the tight radius; the
isotropic bound (h = d = 64, the smallest the Satterthwaite radius can be) is reported instead, so the tight
radius's coverage is bracketed by [isotropic bound, conservative]. Not pre-registered.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.tables import markdown_table
from kvcert.exploratory.certificate import (
    add_strata,
    calibration_curve,
    coverage_table,
    multiplier_for_coverage,
    nominal_level_of_multiplier,
    plot_calibration,
    radii,
    split_conformal,
)

META = ["task", "budget", "context_tokens", "design", "scorer", "tail_fraction", "floor"]
P_MAX_EDGES = (0.0, 0.1, 0.3, 0.6, 1.01)
P_MAX_LABELS = ("<0.1", "[0.1,0.3)", "[0.3,0.6)", ">=0.6")


def load(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    run_dir = Path(run_dir)
    if (run_dir / "steps.parquet").exists() and (run_dir / "examples.parquet").exists():
        return pd.read_parquet(run_dir / "examples.parquet"), pd.read_parquet(run_dir / "steps.parquet"), "merged"
    ex = sorted((run_dir / "shards").glob("*.examples.parquet"))
    st = [p.with_name(p.name.replace(".examples.", ".steps.")) for p in ex]
    pairs = [(e, s) for e, s in zip(ex, st) if s.exists()]
    return (
        pd.concat([pd.read_parquet(e) for e, _ in pairs], ignore_index=True),
        pd.concat([pd.read_parquet(s) for _, s in pairs], ignore_index=True),
        f"{len(pairs)} shards",
    )


def prepare(examples: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Certified cells (finite error and variance) of randomized variants with the example metadata attached."""
    meta = examples[["run", "example_id", "variant"] + META].drop_duplicates(["run", "example_id", "variant"])
    s = steps.merge(meta, on=["run", "example_id", "variant"], how="inner")
    s = s[(s["design"] == "randomized") & np.isfinite(s["error"]) & np.isfinite(s["variance"]) & (s["variance"] >= 0)]
    s = add_strata(s.reset_index(drop=True))
    s["p_max_bin"] = pd.cut(s["p_max"], P_MAX_EDGES, right=False, labels=P_MAX_LABELS)
    s["context_k"] = (s["context_tokens"] / 1000).round().astype(int).astype(str) + "k"  # nominal length
    # the isotropic bound on the tight radius (h = 64) where trace_c2 / eff_dim are not recorded
    if "trace_c2" not in s and "eff_dim" not in s:
        s["eff_dim"] = 64.0
    return s


def _md(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    out = []
    for _, r in df.iterrows():
        cells = []
        for v in r:
            if isinstance(v, (float, np.floating)):
                cells.append("" if np.isnan(v) else (str(int(v)) if float(v).is_integer() else f"{v:.3f}"))
            else:
                cells.append(str(v))
        out.append(cells)
    return markdown_table(pd.DataFrame(out, columns=[str(c) for c in cols]), parse_numbers=False)


def tables(cells: pd.DataFrame, level: float = 0.95) -> dict[str, pd.DataFrame]:
    rf = radii(cells, level)
    names = ["conservative", "tight"]
    out = {"pooled": coverage_table(cells, None, level=level, radius_frame=rf, names=names)}
    for by in ("tail_mass_bin", "p_max_bin", "layer", "head", "task", "budget", "context_k", "scorer"):
        if by in cells and cells[by].nunique() > 0:
            out[by] = coverage_table(cells, by, level=level, radius_frame=rf, names=names)
    v = cells["variance"].to_numpy(np.float64)
    e2 = cells["error"].to_numpy(np.float64) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.sqrt(e2) / np.sqrt(v)
    bias = (
        pd.DataFrame({"tail_mass_bin": cells["tail_mass_bin"].values, "e2": e2, "v": v, "z": z})
        .groupby("tail_mass_bin", observed=True)
        .agg(n=("e2", "size"), mse=("e2", "mean"), mean_vhat=("v", "mean"), median_err_over_sd=("z", "median"))
        .reset_index()
    )
    bias["mse_over_mean_vhat"] = bias["mse"] / bias["mean_vhat"]
    out["vhat_bias_by_tail_mass"] = bias
    return out


def proxy_grid(cells: pd.DataFrame, level: float = 0.95) -> pd.DataFrame:
    """Coverage inside / outside a trusted set defined by the old columns only (tail_mass, p_max)."""
    r = radii(cells, level)["r_conservative"].to_numpy()
    cov = cells["error"].to_numpy() <= r
    rows = []
    for tm in (0.0, 1e-3, 1e-2, 0.1):
        for pm in (1.01, 0.6, 0.3):
            ok = ((cells["tail_mass"] >= tm) & (cells["p_max"] < pm)).to_numpy()
            rows.append(
                {
                    "tail_mass_min": tm,
                    "p_max_below": pm,
                    "share": ok.mean(),
                    "coverage_in": cov[ok].mean() if ok.any() else np.nan,
                    "coverage_out": cov[~ok].mean() if (~ok).any() else np.nan,
                }
            )
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", default="results/exploratory")
    ap.add_argument("--n-boot", type=int, default=200)
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    examples, steps, how = load(Path(args.run_dir))
    cells_all = prepare(examples, steps)
    c1 = cells_all[(cells_all["scorer"] == "window_question") & cells_all["budget"].isin([0.25, 0.5])]
    lock = c1.groupby(["tail_fraction", "floor"]).size()
    tf, fl = lock.idxmax() if len(lock) else (np.nan, np.nan)
    c1 = c1[(c1["tail_fraction"] == tf) & (c1["floor"] == fl)].reset_index(drop=True)
    t_c1 = tables(c1)
    t_all = tables(cells_all)
    conf = split_conformal(c1, "conservative", n_boot=args.n_boot, seed=0)
    conf_layer = split_conformal(c1, "conservative", per="layer", n_boot=max(args.n_boot // 4, 20), seed=0)
    conf_tm = split_conformal(c1, "conservative", per="tail_mass_bin", n_boot=max(args.n_boot // 4, 20), seed=0)
    m97 = multiplier_for_coverage(c1, 0.97)
    m95 = multiplier_for_coverage(c1, 0.95)
    curve = calibration_curve(c1, names=("conservative", "tight"))
    curve["radius"] = curve["radius"].replace({"tight": "tight, isotropic bound (h = 64)"})
    plot_calibration(curve, out / "certificate_calibration_c1.png", "EXPLORATORY: study-1 records (C1 rows), old code")
    curve.to_csv(out / "certificate_calibration_c1.csv", index=False)
    for name, t in t_c1.items():
        t.to_csv(out / f"certificate_c1_by_{name}.csv", index=False)
    conf.to_csv(out / "certificate_conformal_c1.csv", index=False)
    conf_layer.to_csv(out / "certificate_conformal_c1_by_layer.csv", index=False)
    # where the paper's 0.97 is reached with the plain radius
    reach = {
        k: t_c1[k][t_c1[k]["coverage_conservative"] >= 0.97][k].astype(str).tolist()
        for k in ("tail_mass_bin", "p_max_bin", "layer", "head", "task", "budget", "context_k")
        if k in t_c1
    }
    keep = ["n", "coverage_conservative", "median_r_over_err_conservative", "coverage_tight"]

    def sec(tabs, key):
        t = tabs[key]
        return _md(t[[key] + [c for c in keep if c in t]])

    lay = (
        conf_layer.groupby("stratum")
        .agg(
            multiplier=("multiplier", "mean"),
            lo=("multiplier_lo", "min"),
            hi=("multiplier_hi", "max"),
            heldout_coverage=("heldout_coverage", "mean"),
        )
        .reset_index()
    )
    tm = (
        conf_tm.groupby("stratum")
        .agg(
            multiplier=("multiplier", "mean"),
            lo=("multiplier_lo", "min"),
            hi=("multiplier_hi", "max"),
            heldout_coverage=("heldout_coverage", "mean"),
        )
        .reset_index()
    )
    pooled = t_c1["pooled"].iloc[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        zs = c1["error"].to_numpy(np.float64) / np.sqrt(c1["variance"].to_numpy(np.float64))
    zq = np.nanquantile(np.where(np.isfinite(zs), zs, np.inf), [0.5, 0.75, 0.9, 0.95, 0.97, 0.99])
    text = f"""# EXPLORATORY: where the study-1 certificate covers (real records)

Not pre-registered; an input to the design of a future study. Data source: `{args.run_dir}` ({how}), raw
study-1 confirmatory records regenerated with the OLD code (no tr(C^2), ESS or head-mass columns). Scope: the C1
rows (randomized design, window_question scorer, budgets 0.25 and 0.5, tail fraction {tf}, floor {fl}):
{len(c1):,} cells (example x variant x decode step x layer x query head) from {c1["example_id"].nunique()}
examples. "tight, isotropic bound" is the Satterthwaite radius at h = 64, the smallest it can be: with trace_c2
unrecorded the tight radius's coverage lies between that and the conservative column. Level 0.95.
Generated by `python -m kvcert.exploratory.certificate_records` in {time.time() - t0:.0f} s.

## Pooled

coverage of 1.96 sqrt(V_hat): {pooled["coverage_conservative"]:.4f}; isotropic-bound tight radius:
{pooled["coverage_tight"]:.4f}; median radius / error {pooled["median_r_over_err_conservative"]:.2f}.
Multiplier on 1.96 sqrt(V_hat) for empirical coverage 0.95: {m95:.3f}; for the paper's 0.97: {m97:.3f}
(equivalent to a nominal Gaussian level of 1 - {1 - nominal_level_of_multiplier(m97):.1e}).
Quantiles of error / sqrt(V_hat) at 0.5 / 0.75 / 0.9 / 0.95 / 0.97 / 0.99: {" / ".join(f"{q:.2f}" for q in zq)}
(a 64-dimensional Gaussian error with E||e||^2 = V_hat would give 0.99 / 1.05 / 1.11 / 1.14 / 1.17 / 1.21;
a rank-one one 0.67 / 1.15 / 1.64 / 1.96 / 2.17 / 2.58).

Split-conformal (random halves of the examples, fit on one, check on the other; 95% bootstrap interval over
examples of the fitting half):

{
        _md(
            conf[
                [
                    "fit_half",
                    "multiplier",
                    "multiplier_lo",
                    "multiplier_hi",
                    "n_fit",
                    "n_test",
                    "heldout_coverage",
                    "heldout_coverage_raw",
                    "heldout_median_r_over_err",
                ]
            ]
        )
    }

Per layer (mean of the two fits, interval = union of the two bootstrap intervals):

{_md(lay)}

Per tail-mass bin:

{_md(tm)}

Strata where the plain radius reaches 0.97: {reach}

## A trusted set from the old columns only (conservative radius)

{_md(proxy_grid(c1))}

## Coverage by tail mass (sum of p over the tail)

{sec(t_c1, "tail_mass_bin")}

V_hat bias by tail mass (mean squared error / mean V_hat; median error / sqrt(V_hat)):

{_md(t_c1["vhat_bias_by_tail_mass"])}

## By largest attention weight p_max

{sec(t_c1, "p_max_bin")}

## By layer

{sec(t_c1, "layer")}

## By query head

{sec(t_c1, "head")}

## By task

{sec(t_c1, "task")}

## By budget

{sec(t_c1, "budget")}

## By context length (prompt tokens, nominal)

{sec(t_c1, "context_k")}

## All randomized variants (every scorer and budget, locked and ablation rows), by scorer and by budget

{sec(t_all, "scorer")}

{sec(t_all, "budget")}

Figures: `certificate_calibration_c1.png` (nominal 0.5-0.99 vs empirical; conservative and the isotropic bound).
CSV: `certificate_c1_by_*.csv`, `certificate_conformal_c1*.csv`, `certificate_calibration_c1.csv`.
"""
    (out / "certificate.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
