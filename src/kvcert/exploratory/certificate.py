"""EXPLORATORY: candidate certificate radii evaluated on step records (pure pandas / numpy / scipy).

Input: a steps frame with one row per (example, variant, step, layer, head) cell and at least `error` and
`variance` (V_hat); optional per-cell statistics `tail_mass`, `p_max`, `ess_tail`, `n_tail`, `tail_max`,
`head_mass`, and `trace_c2` or `eff_dim` (needed by the tight radii); metadata columns (example_id, layer, head,
task, budget, context_tokens, ...) for strata. Nothing here is wired into the confirmatory analysis.

Candidate radii at a level (column names r_<name>):
  conservative      z_{1-alpha/2} sqrt(V_hat)                     (the study-1 certificate)
  tight             sqrt(V_hat * chi2.ppf(level, h) / h)           (Satterthwaite, h = V_hat^2 / tr(C^2))
  conservative_ess  t_{nu, 1-alpha/2} sqrt(V_hat), nu = max(ess_tail - 1, 1)   (small-sample studentization)
  tight_ess         sqrt(V_hat * F.ppf(level, h, nu))              (scaled F: chi2_h / h over chi2_nu / nu)
and, from `split_conformal`, any of them times a multiplier fitted on half of the examples.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from kvcert.core.certificate import TRUSTED_ESS_MIN, TRUSTED_ESS_RATIO_MIN, TRUSTED_TAIL_MASS_MIN

TAIL_MASS_EDGES = (0.0, 1e-3, 1e-2, 0.1, np.inf)
TAIL_MASS_LABELS = ("<1e-3", "[1e-3,1e-2)", "[1e-2,0.1)", ">=0.1")
ESS_EDGES = (0.0, 2.0, 5.0, 10.0, 30.0, np.inf)
ESS_LABELS = ("<2", "[2,5)", "[5,10)", "[10,30)", ">=30")
ESS_RATIO_EDGES = (0.0, 0.02, 0.05, 0.1, 0.3, np.inf)
ESS_RATIO_LABELS = ("<0.02", "[0.02,0.05)", "[0.05,0.1)", "[0.1,0.3)", ">=0.3")
RADII = ("conservative", "tight", "conservative_ess", "tight_ess")


def _z(level: float) -> float:
    return float(stats.norm.ppf(0.5 + level / 2))


def effective_dimension(steps: pd.DataFrame, d: int = 64) -> np.ndarray:
    """h per cell: the `eff_dim` column, else variance^2 / trace_c2, clipped to [1, d]; NaN where unknown."""
    if "eff_dim" in steps:
        h = steps["eff_dim"].to_numpy(np.float64)
    elif "trace_c2" in steps:
        v = steps["variance"].to_numpy(np.float64)
        t2 = steps["trace_c2"].to_numpy(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = np.where(t2 > 0, v**2 / t2, 1.0)
    else:
        return np.full(len(steps), np.nan)
    return np.clip(h, 1.0, d)


def ess_dof(steps: pd.DataFrame) -> np.ndarray:
    """Small-sample degrees of freedom nu = max(ess_tail - 1, 1); NaN without an ess_tail column."""
    if "ess_tail" not in steps:
        return np.full(len(steps), np.nan)
    return np.maximum(steps["ess_tail"].to_numpy(np.float64) - 1.0, 1.0)


def radii(steps: pd.DataFrame, level: float = 0.95, d: int = 64) -> pd.DataFrame:
    """The four candidate radii (columns r_conservative, r_tight, r_conservative_ess, r_tight_ess); NaN where a
    radius needs a column the records lack. z * sqrt(V_hat) is computed at every level (it is a conservative
    region only above ~0.785, SPEC section 2)."""
    v = np.maximum(steps["variance"].to_numpy(np.float64), 0.0)
    h = effective_dimension(steps, d)
    nu = ess_dof(steps)
    out = pd.DataFrame(index=steps.index)
    out["r_conservative"] = _z(level) * np.sqrt(v)
    out["r_tight"] = np.sqrt(v * stats.chi2.ppf(level, h) / h)
    out["r_conservative_ess"] = stats.t.ppf(0.5 + level / 2, nu) * np.sqrt(v)
    out["r_tight_ess"] = np.sqrt(v * stats.f.ppf(level, h, nu))
    return out


def add_strata(steps: pd.DataFrame) -> pd.DataFrame:
    """Copy of steps with tail_mass_bin / ess_bin categorical columns where the statistics exist."""
    out = steps.copy()
    if "tail_mass" in out:
        out["tail_mass_bin"] = pd.cut(out["tail_mass"], TAIL_MASS_EDGES, right=False, labels=TAIL_MASS_LABELS)
    if "ess_tail" in out:
        out["ess_bin"] = pd.cut(out["ess_tail"], ESS_EDGES, right=False, labels=ESS_LABELS)
        if "n_tail" in out:
            out["ess_ratio_bin"] = pd.cut(ess_ratio(out), ESS_RATIO_EDGES, right=False, labels=ESS_RATIO_LABELS)
    return out


def ess_ratio(steps: pd.DataFrame) -> pd.Series:
    """ess_tail / n_tail: 1 when the Hajek weights w_i / pi_i are equal over the tail (pi proportional to the decode
    query's attention, the ideal design); small when the scorer mis-ranks or a few tail tokens dominate."""
    return steps["ess_tail"] / steps["n_tail"].where(steps["n_tail"] > 0)


def coverage_table(
    steps: pd.DataFrame,
    by: str | Sequence[str] | None = None,
    *,
    level: float = 0.95,
    radius_frame: pd.DataFrame | None = None,
    names: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Per stratum: n, and for each radius coverage (error <= r) and tightness (median r / error).

    radius_frame: precomputed r_* columns (default `radii(steps, level)`); names: which of them (default: those
    not entirely NaN). by=None pools everything into one row."""
    rf = radii(steps, level) if radius_frame is None else radius_frame
    if names is None:
        names = [c[2:] for c in rf.columns if c.startswith("r_") and rf[c].notna().any()]
    err = steps["error"].to_numpy(np.float64)
    df = pd.DataFrame(index=steps.index)
    for n in names:
        r = rf[f"r_{n}"].to_numpy(np.float64)
        ok = np.isfinite(r) & np.isfinite(err)
        df[f"cov_{n}"] = np.where(ok, (err <= r).astype(np.float64), np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            df[f"tight_{n}"] = np.where(ok, r / err, np.nan)
    keys = ["_g"] if by is None else ([by] if isinstance(by, str) else list(by))
    for k in keys:
        df[k] = 0 if by is None else steps[k].values  # .values keeps a Categorical's order
    agg = {"n": (f"cov_{names[0]}", "count")}
    for n in names:
        agg[f"coverage_{n}"] = (f"cov_{n}", "mean")
        agg[f"median_r_over_err_{n}"] = (f"tight_{n}", "median")
    table = df.groupby(keys, observed=True).agg(**agg).reset_index()
    return table.drop(columns="_g") if by is None else table


def conformal_quantile(scores: np.ndarray, level: float) -> float:
    """Split-conformal quantile: the ceil((n + 1) level)-th smallest score (inf when that exceeds n)."""
    s = np.sort(scores[np.isfinite(scores)])
    n = s.size
    k = int(np.ceil((n + 1) * level))
    return float(s[k - 1]) if 1 <= k <= n else float("inf")


def _halves(groups: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    uniq = np.unique(groups)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(uniq)
    a = set(perm[: len(perm) // 2].tolist())
    in_a = np.array([g in a for g in groups])
    return in_a, ~in_a


def split_conformal(
    steps: pd.DataFrame,
    radius: str = "conservative",
    *,
    level: float = 0.95,
    group: str = "example_id",
    per: str | None = None,
    n_boot: int = 200,
    seed: int = 0,
    radius_frame: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Split-conformal multiplier m on a radius: the examples (`group`) are split in two halves at random; m is
    fitted on one half (conformal quantile of error / r at `level`) and its coverage checked on the other, both
    ways. The interval of m is a percentile bootstrap over examples within each half (n_boot replicates).

    per: a column (e.g. "layer") for one multiplier per stratum. Returns one row per (stratum, fit half) with
    multiplier, its 95% bootstrap interval, held-out coverage of m * r and of r, and tightness (median m r / e).
    """
    rf = radii(steps, level) if radius_frame is None else radius_frame
    r = rf[f"r_{radius}"].to_numpy(np.float64)
    err = steps["error"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(r > 0, err / r, np.where(err > 0, np.inf, 0.0))
    groups = steps[group].to_numpy()
    in_a, in_b = _halves(groups, seed)
    strata = (
        [(None, np.ones(len(steps), bool))]
        if per is None
        else [(k, (steps[per] == k).to_numpy()) for k in sorted(steps[per].unique())]
    )
    rng = np.random.default_rng(seed + 1)
    rows = []
    for key, mask in strata:
        for fit_name, fit, test in (("A", in_a, in_b), ("B", in_b, in_a)):
            fm, tm = mask & fit, mask & test
            if not fm.any() or not tm.any():
                continue
            m = conformal_quantile(score[fm], level)
            # bootstrap over the examples of the fitting half
            g_fit = groups[fm]
            s_fit = score[fm]
            uniq, inv = np.unique(g_fit, return_inverse=True)
            order = np.argsort(inv, kind="stable")
            bounds = np.searchsorted(inv[order], np.arange(len(uniq) + 1))
            boots = []
            for _ in range(n_boot):
                pick = rng.integers(0, len(uniq), len(uniq))
                idx = np.concatenate([order[bounds[i] : bounds[i + 1]] for i in pick])
                boots.append(conformal_quantile(s_fit[idx], level))
            with np.errstate(invalid="ignore"):  # infinite multipliers (strata smaller than 1 / (1 - level))
                lo, hi = np.percentile(boots, [2.5, 97.5]) if boots else (np.nan, np.nan)
            with np.errstate(divide="ignore", invalid="ignore"):
                tight = np.nanmedian(np.where(err[tm] > 0, m * r[tm] / err[tm], np.nan))
            rows.append(
                {
                    "stratum": key,
                    "fit_half": fit_name,
                    "radius": radius,
                    "level": level,
                    "multiplier": m,
                    "multiplier_lo": lo,
                    "multiplier_hi": hi,
                    "n_fit": int(fm.sum()),
                    "n_test": int(tm.sum()),
                    "heldout_coverage": float(np.mean(err[tm] <= m * r[tm])),
                    "heldout_coverage_raw": float(np.mean(err[tm] <= r[tm])),
                    "heldout_median_r_over_err": float(tight),
                }
            )
    return pd.DataFrame(rows)


def calibration_curve(
    steps: pd.DataFrame,
    levels: Sequence[float] = tuple(np.round(np.arange(0.5, 0.99, 0.05), 2)) + (0.99,),
    names: Sequence[str] = ("conservative", "tight"),
) -> pd.DataFrame:
    """Empirical coverage of each radius at each nominal level (rows: level, radius, coverage, n)."""
    rows = []
    err = steps["error"].to_numpy(np.float64)
    for level in levels:
        rf = radii(steps, level)
        for n in names:
            r = rf[f"r_{n}"].to_numpy(np.float64)
            ok = np.isfinite(r) & np.isfinite(err)
            if ok.any():
                rows.append(
                    {
                        "level": float(level),
                        "radius": n,
                        "coverage": float(np.mean(err[ok] <= r[ok])),
                        "n": int(ok.sum()),
                    }
                )
    return pd.DataFrame(rows)


def plot_calibration(curve: pd.DataFrame, path: str | Path, title: str = "EXPLORATORY: certificate calibration"):
    """Nominal level vs empirical coverage, one line per radius (conservative z sqrt(V_hat) vs tight)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    ax.plot([0.5, 1.0], [0.5, 1.0], color="grey", lw=0.8, ls="--", label="nominal")
    for name, g in curve.groupby("radius", sort=False):
        ax.plot(g["level"], g["coverage"], marker="o", ms=3, label=name)
    ax.axvline(0.785, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("nominal level")
    ax.set_ylabel("empirical coverage")
    ax.set_xlim(0.48, 1.0)
    ax.set_ylim(min(0.3, float(curve["coverage"].min()) - 0.02), 1.005)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def multiplier_for_coverage(
    steps: pd.DataFrame, target: float = 0.97, radius: str = "conservative", level: float = 0.95
) -> float:
    """The multiplier m with empirical coverage of m * r equal to target (the target quantile of error / r)."""
    r = radii(steps, level)[f"r_{radius}"].to_numpy(np.float64)
    err = steps["error"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(r > 0, err / r, np.where(err > 0, np.inf, 0.0))
    return float(np.quantile(s[np.isfinite(err)], target))


def nominal_level_of_multiplier(m: float, level: float = 0.95) -> float:
    """The two-sided normal level whose z equals m * z_level (how far the nominal level must be pushed)."""
    return float(2 * stats.norm.cdf(m * _z(level)) - 1)


def certificate_trusted(
    steps: pd.DataFrame,
    *,
    ess_min: float = TRUSTED_ESS_MIN,
    tail_mass_min: float = TRUSTED_TAIL_MASS_MIN,
    ess_ratio_min: float = TRUSTED_ESS_RATIO_MIN,
) -> pd.Series:
    """Regime flag from recorded per-cell statistics: the certificate is reported as trusted only where the tail
    has at least ess_min effective samples AND carries at least tail_mass_min of the attention AND (when
    ess_ratio_min > 0) ess_tail / n_tail >= ess_ratio_min (thresholds from the Monte Carlo in
    kvcert.exploratory.certificate_mc, where ess_tail / n_tail >= 0.3 isolates the cells whose V_hat is unbiased:
    the tail's Hajek weights w_i / pi_i are nearly equal, i.e. the scorer's pi tracks the decode query's attention;
    a missing column is not checked)."""
    ok = pd.Series(True, index=steps.index)
    if ess_ratio_min > 0 and "ess_tail" in steps and "n_tail" in steps:
        ok &= (ess_ratio(steps) >= ess_ratio_min).fillna(False)
    if "ess_tail" in steps:
        ok &= steps["ess_tail"] >= ess_min
    if "tail_mass" in steps:
        ok &= steps["tail_mass"] >= tail_mass_min
    return ok
