"""Figures for the scorecard (PNG, Agg backend). Each function takes analysis output and returns the file path."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvcert.analysis.accuracy import accuracy_vs_budget  # noqa: E402
from kvcert.analysis.claims import ClaimResult  # noqa: E402


def _save(fig: plt.Figure, out_dir: str | Path, name: str) -> Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # no Software (matplotlib version) entry: the PNG's bytes depend on the data alone
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def _frame(data: pd.DataFrame | list[dict]) -> pd.DataFrame:
    return data if isinstance(data, pd.DataFrame) else pd.DataFrame(data)


def plot_calibration(
    calibration: pd.DataFrame | list[dict], out_dir: str | Path, name: str = "c1_calibration.png"
) -> Path:
    """Empirical vs nominal coverage of z * sqrt(V_hat), with the example-cluster band."""
    df = _frame(calibration)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0.5, 1.0], [0.5, 1.0], "k--", lw=1, label="nominal")
    if len(df):
        ax.fill_between(df["nominal"], df["lo"], df["hi"], alpha=0.25)
        ax.plot(df["nominal"], df["coverage"], "o-", label="empirical")
    ax.set(
        xlabel="nominal level",
        ylabel="empirical coverage",
        title="C1: certificate calibration",
        xlim=(0.48, 1.0),
        ylim=(0.0, 1.01),
    )
    ax.legend()
    return _save(fig, out_dir, name)


def plot_accuracy_vs_budget(table: pd.DataFrame, out_dir: str | Path, name: str = "accuracy_vs_budget.png") -> Path:
    """Accuracy per policy (scorer x design) against budget; the full cache as a horizontal line."""
    fig, ax = plt.subplots(figsize=(7, 5))
    if len(table):
        for (scorer, design), g in table.groupby(["scorer", "design"], sort=True):
            g = g.sort_values("budget")
            ax.errorbar(
                g["budget"],
                g["accuracy"],
                yerr=[g["accuracy"] - g["lo"], g["hi"] - g["accuracy"]],
                marker="o",
                capsize=2,
                label=f"{scorer} / {design}",
            )
        ax.axhline(float(table["full_accuracy"].mean()), color="k", ls="--", label="full cache")
    ax.set(xlabel="budget (fraction of prompt kept)", ylabel="accuracy (%)", title="Accuracy vs budget", ylim=(0, 100))
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out_dir, name)


def plot_roc(
    curves: Mapping[str, pd.DataFrame | list[dict]],
    out_dir: str | Path,
    name: str,
    title: str,
    aucs: Mapping[str, float] | None = None,
) -> Path:
    """ROC curves for several scores of one labelling (C4: failure; C6: cache-induced among failures)."""
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    for label, pts in curves.items():
        df = _frame(pts)
        if len(df):
            auc = (aucs or {}).get(label)
            suffix = f" (AUC {auc:.2f})" if auc is not None and np.isfinite(auc) else ""
            ax.plot(df["fpr"], df["tpr"], label=label + suffix)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title)
    ax.legend()
    return _save(fig, out_dir, name)


def plot_policy_curves(
    curves: pd.DataFrame | list[dict], x: str, out_dir: str | Path, name: str, title: str, xlabel: str
) -> Path:
    """Accuracy per policy against a rate (escalation, C5) or a recompute budget (C7)."""
    df = _frame(curves)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if len(df):
        for policy, g in df.groupby("policy", sort=False):
            g = g.sort_values(x)
            ax.plot(g[x], g["accuracy"], marker="o", ms=3, label=policy, ls=":" if policy == "oracle" else "-")
        if "full_accuracy" in df:
            ax.axhline(float(df["full_accuracy"].iloc[0]), color="k", ls="--", label="full cache")
    ax.set(xlabel=xlabel, ylabel="accuracy (%)", title=title)
    ax.legend()
    return _save(fig, out_dir, name)


def plot_t1(t1_result: Mapping[str, list], out_dir: str | Path, name: str = "t1_nonidentifiability.png") -> Path:
    """Left: deterministic true error grows with lambda while its estimate is flat. Right: randomized mean V_hat
    tracks the MSE."""
    lam = np.asarray(t1_result["lambda"], dtype=np.float64)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(lam, t1_result["true_error_deterministic"], "o-", label="true error")
    a.plot(lam, t1_result["estimate_deterministic"], "s--", label="any retained-data estimate")
    a.set(xlabel="lambda (perturbation of evicted values)", ylabel="error", title="Deterministic top-k")
    a.legend()
    b.plot(lam, t1_result["mse_randomized"], "o-", label="MSE over draws")
    b.plot(lam, t1_result["mean_vhat_randomized"], "s--", label="mean V_hat")
    b.set(xlabel="lambda", ylabel="squared error", title="Randomized design")
    b.legend()
    return _save(fig, out_dir, name)


def make_figures(
    claim_results: Mapping[str, ClaimResult],
    examples: pd.DataFrame | None,
    t1_result: Mapping[str, list] | None,
    out_dir: str | Path,
    n_boot: int = 500,
    seed: int = 0,
) -> list[Path]:
    """Every figure available from evaluated claims (by id), the examples table and the T1 result."""
    paths: list[Path] = []
    c1 = claim_results.get("C1")
    if c1 is not None and c1.details.get("calibration"):
        paths.append(plot_calibration(c1.details["calibration"], out_dir))
    if examples is not None and len(examples):
        paths.append(plot_accuracy_vs_budget(accuracy_vs_budget(examples, n_boot=n_boot, seed=seed), out_dir))
    for cid, title in (("C4", "C4: predicting failure"), ("C6", "C6: cache-induced vs inherent failures")):
        res = claim_results.get(cid)
        if res:
            d, m = res.details, res.metrics
            paths.append(
                plot_roc(
                    {"certificate": d["roc_cert"], "confidence (-logprob)": d["roc_confidence"]},
                    out_dir,
                    f"{cid.lower()}_roc.png",
                    title,
                    {"certificate": m["auc_cert"]["estimate"], "confidence (-logprob)": m["auc_conf"]["estimate"]},
                )
            )
    if claim_results.get("C5"):
        paths.append(
            plot_policy_curves(
                claim_results["C5"].details["curves"],
                "rate",
                out_dir,
                "c5_escalation.png",
                "C5: budget escalation",
                "escalation rate",
            )
        )
    if claim_results.get("C7"):
        paths.append(
            plot_policy_curves(
                claim_results["C7"].details["curves"],
                "budget",
                out_dir,
                "c7_recompute.png",
                "C7: recomputation with the full cache",
                "recompute budget (fraction of examples)",
            )
        )
    if t1_result:
        paths.append(plot_t1(t1_result, out_dir))
    return paths
