"""Fitting the per-token certificate's calibration (`kvcert.serve.calibration.Calibration` is the file it writes):
per-layer split-conformal multipliers (study 2's S2 method), the token reduction chosen by held-out AUROC, and
escalation thresholds, fitted on examples run with the oracle on.

    kvcert calibrate --model smollm2-135m-instruct [--tasks single_needle,fact_qa | --data file.jsonl] \
        [--budgets 0.25,0.5] [--n 20] [--seed 5000] --out calib.json

Method. Every example is decoded with the full cache and with the policy at each budget, oracle on, so each cell
(step, layer, head) has its exact error beside its tight radius r_tight. The examples are split in two halves
(`analysis.coverage.split_examples`). On the calibration half, per compressed layer, m_layer is the level-quantile of
error / r_tight (`analysis.coverage.conformal_quantile`). On the other half the file reports the coverage of
m_layer * r_tight: overall (example-cluster bootstrap interval), the worst layer and the worst tail-mass bin
(quintiles of the cells' tail mass). The token certificate's reduction ("max" or "mean" over layers and heads) is
the one with the larger held-out AUROC for cache-induced failures (the full cache answers correctly, the policy does
not; an answer's score is its largest token certificate). The escalation thresholds are quantiles, on the
calibration half, of the answers' largest token certificate: escalating above the threshold for rate r escalates a
share r of such answers. Seeds: 5000 onwards by default, disjoint from study 1 (0-1999) and study 2 (2000-2999).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from kvcert.serve.certificate import LEVEL, REDUCTIONS, token_certificate

if TYPE_CHECKING:
    from kvcert.hf.draws import Draws

DEFAULT_RATES = (0.05, 0.1, 0.2, 0.3)


# ----------------------------------------------------------------------------------------------- the data
def _rows(policies, draws: Draws | None) -> tuple[list, list[int], dict[int, list[int]]]:
    """The rows to decode (the full cache first), each policy's row (its draw 0) and, with draws, the rows that
    follow it (its other draws, fed its tokens: kvcert.hf.draws)."""
    from kvcert.hf import FULL
    from kvcert.hf.draws import draw_policies

    rows, leads, followers = [FULL], [], {}
    for policy in policies:
        drawn, follow = draw_policies(policy, draws) if draws is not None else ([policy], {})
        leads.append(len(rows))
        followers[len(rows)] = [len(rows) + r for r in follow]
        rows += drawn
    return rows, leads, followers


def collect(
    model, tokenizer, examples, policies, *, prompt_format: str = "auto", log=print, draws: Draws | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Decode every example with the full cache and each policy, oracle on: (answers, cells).

    answers: example_id, task, budget, correct, full_correct, n_answer, token_max_{reduction} (filled by `fit`),
    and with draws (a kvcert.hf.draws.Draws) the draws' disagreement and differs about each policy's answer (its
    other draws decoded in the same batch, fed its tokens: its own tokens and statistics are those without them);
    cells: example_id, budget, step, layer, head, error, variance, trace_c2, out_norm, tail_mass."""
    from kvcert.hf import DecodeOptions, generate_variants, probe_prompt
    from kvcert.hf.draws import agreement_of
    from kvcert.serve.probe import probe_error
    from kvcert.tasks import render, score

    answers, cells = [], []
    rows, leads, followers = _rows(policies, draws)
    follow = {f: lead for lead, fol in followers.items() for f in fol} or None
    started = time.perf_counter()
    for i, example in enumerate(examples):
        prompt = render(example, tokenizer, prompt_format)
        opts = DecodeOptions(max_new_tokens=24, stop_strings=prompt.stop_strings, oracle=True, certificate=True)
        decoded = generate_variants(model, tokenizer, prompt, rows, opts, follow=follow)
        full, results = decoded[0], [decoded[j] for j in leads]
        full_correct = score(full.answer, example)[1]
        probes = probe_prompt(model, prompt, policies, DecodeOptions(max_new_tokens=1, oracle=False))
        for lead, r, probe in zip(leads, results, probes):
            answers.append(
                dict(
                    example_id=example.id,
                    task=example.task,
                    budget=r.policy.budget,
                    correct=score(r.answer, example)[1],
                    full_correct=full_correct,
                    n_answer=r.n_answer,
                    logprob=float(min(r.logprobs[: r.n_answer])) if r.n_answer else math.nan,
                    probe_error=probe_error(probe),
                )
            )
            if draws is not None:
                agree = agreement_of(r, [decoded[j] for j in followers[lead]])
                answers[-1].update(disagreement=agree.disagreement, differs=agree.differs)
            n = r.n_answer
            if n == 0 or "error" not in r.stats:
                continue
            steps, layers, heads = r.stats["error"].shape
            idx = np.indices((steps, layers, heads)).reshape(3, -1)
            frame = {"step": idx[0], "layer": idx[1], "head": idx[2]}
            for name in ("error", "variance", "trace_c2", "out_norm", "tail_mass"):
                frame[name] = r.stats[name].reshape(-1).astype(np.float64)
            cells.append(pd.DataFrame(frame).assign(example_id=example.id, budget=r.policy.budget))
        if log is not None:
            verdict = "right" if full_correct else "wrong"
            log(f"  {i + 1}/{len(examples)} {example.id}: full cache {verdict} ({time.perf_counter() - started:.0f} s)")
    return pd.DataFrame(answers), pd.concat(cells, ignore_index=True)


# ----------------------------------------------------------------------------------------------- the fit
def _column(cells: pd.DataFrame, name: str) -> torch.Tensor:
    return torch.tensor(cells[name].to_numpy(np.float64))


def _stats(cells: pd.DataFrame) -> dict[str, torch.Tensor]:
    return {k: _column(cells, k) for k in ("variance", "trace_c2", "out_norm")}


def _cluster_interval(covered: np.ndarray, clusters: np.ndarray, n_boot: int = 2000, seed: int = 0) -> list[float]:
    from kvcert.analysis.bootstrap import ratio_of_sums

    ids, codes = np.unique(clusters, return_inverse=True)
    hits = np.bincount(codes, weights=covered.astype(np.float64), minlength=len(ids))
    totals = np.bincount(codes, minlength=len(ids)).astype(np.float64)
    stat = ratio_of_sums(hits, totals, n_boot, seed, 0.05)
    return [float(stat.lo), float(stat.hi)]


def token_scores(cells: pd.DataFrame, multipliers: torch.Tensor, reduction: str) -> pd.DataFrame:
    """Per (example, budget, step): the token certificate under `reduction`."""
    keys = ["example_id", "budget", "step"]
    ordered = cells.sort_values([*keys, "layer", "head"])
    n_layers, n_heads = int(ordered["layer"].max()) + 1, int(ordered["head"].max()) + 1
    grouped = ordered.groupby(keys, sort=False)
    index = grouped.size().index
    shape = (len(index), n_layers, n_heads)
    stats = {k: v.reshape(shape) for k, v in _stats(ordered).items()}
    value, _ = token_certificate(stats, multipliers, reduction)
    return pd.DataFrame({"certificate": value.numpy()}, index=index).reset_index()


def _rate_thresholds(scores: pd.Series, rates) -> dict[str, float]:
    """{rate: the score above which that share of answers escalates} (the 1 - rate quantile); {} without scores."""
    values = scores.dropna().to_numpy()
    return {f"{r:g}": float(np.quantile(values, 1 - r)) for r in rates} if len(values) else {}


def fit(
    answers: pd.DataFrame,
    cells: pd.DataFrame,
    *,
    n_layers: int,
    split_seed: int = 0,
    level: float = LEVEL,
    rates=DEFAULT_RATES,
) -> dict:
    """Multipliers, held-out coverage, the reduction by held-out AUROC, and thresholds (see the module docstring)."""
    from kvcert.analysis.auroc import auroc
    from kvcert.analysis.coverage import conformal_quantile, split_examples
    from kvcert.core.certificate import tight_radius

    cal_ids, test_ids = split_examples(answers["example_id"].to_numpy(), split_seed)
    radius = tight_radius(_column(cells, "variance"), _column(cells, "trace_c2"), level).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = cells["error"].to_numpy(np.float64) / radius
    certified = np.isfinite(cells["variance"].to_numpy()) & np.isfinite(ratio) & (radius > 0)
    all_cells, cells = cells, cells.assign(ratio=ratio)[certified]
    in_cal = cells["example_id"].isin(cal_ids).to_numpy()
    multipliers: list[float | None] = [None] * n_layers
    for layer, group in cells[in_cal].groupby("layer"):
        multipliers[int(layer)] = conformal_quantile(group["ratio"].to_numpy(), level)
    m = torch.tensor([math.nan if x is None else x for x in multipliers], dtype=torch.float64)
    test = cells[~in_cal]
    covered = test["ratio"].to_numpy() <= m.numpy()[test["layer"].to_numpy()]
    by_layer = pd.Series(covered).groupby(test["layer"].to_numpy()).mean()
    bins = pd.qcut(test["tail_mass"], 5, duplicates="drop")
    by_bin = pd.Series(covered, index=test.index).groupby(bins, observed=True).mean()
    worst_bin = by_bin.idxmin()
    report = {
        "level": level,
        "coverage": float(covered.mean()),
        "coverage_ci": _cluster_interval(covered, test["example_id"].to_numpy()),
        "worst_layer": {"layer": int(by_layer.idxmin()), "coverage": float(by_layer.min())},
        "worst_tail_mass_bin": {
            "tail_mass": [float(worst_bin.left), float(worst_bin.right)],
            "coverage": float(by_bin.min()),
        },
        "n_cal_examples": len(cal_ids),
        "n_test_examples": len(test_ids),
        "n_cal_cells": int(in_cal.sum()),
        "n_test_cells": int((~in_cal).sum()),
    }
    # the reduction: held-out AUROC of each answer's largest token certificate for cache-induced failures
    answers = answers.copy()
    answers["cache_failure"] = answers["full_correct"] & ~answers["correct"]
    for reduction in REDUCTIONS:
        tokens = token_scores(all_cells, m, reduction)  # every cell of a step: the certificate's own NaNs
        top = tokens.groupby(["example_id", "budget"])["certificate"].max().rename(f"cert_{reduction}")
        answers = answers.join(top, on=["example_id", "budget"])
    report["auroc"] = {}
    held = answers[answers["example_id"].isin(test_ids) & answers["full_correct"]]
    for reduction in REDUCTIONS:
        ok = held[f"cert_{reduction}"].notna()
        labels, scores = held.loc[ok, "cache_failure"].to_numpy(), held.loc[ok, f"cert_{reduction}"].to_numpy()
        value = auroc(labels, scores) if 0 < labels.sum() < len(labels) else float("nan")
        report["auroc"][reduction] = float(value)
    report["n_test_answers"] = int(len(held))
    report["n_test_cache_failures"] = int(held["cache_failure"].sum())
    finite = {r: v for r, v in report["auroc"].items() if math.isfinite(v)}
    chosen = max(finite, key=finite.get) if finite else "max"
    report["reduction_rule"] = "the larger held-out AUROC (max when neither is defined)"
    cal_answers = answers[answers["example_id"].isin(cal_ids)]
    thresholds = _rate_thresholds(cal_answers[f"cert_{chosen}"], rates)
    test_scores = answers.loc[answers["example_id"].isin(test_ids), f"cert_{chosen}"].dropna().to_numpy()
    budget_thresholds = {
        f"{b:g}": _rate_thresholds(g[f"cert_{chosen}"], rates) for b, g in cal_answers.groupby("budget")
    }
    budget_thresholds = {b: table for b, table in budget_thresholds.items() if table}
    report["held_out_escalation_rate"] = {r: float((test_scores > t).mean()) for r, t in thresholds.items()}
    models, signal_thresholds, signal_budget_thresholds = {}, {}, {}
    if {"probe_error", "logprob"} <= set(answers.columns):  # collections made before the probe lack them
        from kvcert.serve.signals import fit_signals

        signals = fit_signals(answers.assign(certificate=answers[f"cert_{chosen}"]), cal_ids, test_ids, rates)
        models, signal_thresholds = signals["models"], signals["signal_thresholds"]
        report.update(signals["report"])
    if "disagreement" in answers.columns:  # collected with draws: the agreement signal, per budget as the certificate
        pooled = _rate_thresholds(cal_answers["disagreement"], rates)
        if pooled:
            signal_thresholds["agreement"] = pooled
        per_budget = {f"{b:g}": _rate_thresholds(g["disagreement"], rates) for b, g in cal_answers.groupby("budget")}
        signal_budget_thresholds["agreement"] = {b: table for b, table in per_budget.items() if table}
    return dict(
        multipliers=multipliers,
        reduction=chosen,
        thresholds=thresholds,
        budget_thresholds=budget_thresholds,
        report=report,
        answers=answers,
        models=models,
        signal_thresholds=signal_thresholds,
        signal_budget_thresholds=signal_budget_thresholds,
    )


# ----------------------------------------------------------------------------------------------- the command
def calibration_fields(
    model,
    tokenizer,
    model_name: str,
    examples,
    *,
    policy_fields: dict,
    budgets: list[float],
    data: dict,
    split_seed: int = 0,
    prompt_format: str = "auto",
    work_dir: str | Path | None = None,
    log=print,
    draws: Draws | None = None,
) -> dict:
    """Collect (or reuse work_dir's answers.parquet / cells.parquet of an earlier collection with the same draws)
    and fit: the fields of the `Calibration` that `kvcert.serve.calibration.calibrate` builds from them. draws (a
    kvcert.hf.draws.Draws, or None): also collect and fit the agreement signal's thresholds."""
    from kvcert.policy import Policy

    policies = [Policy(**policy_fields, budget=b) for b in budgets]
    drawn = {"count": draws.count, "variant": draws.variant} if draws is not None else {}
    saved = Path(work_dir) if work_dir is not None else None
    timing = saved / "collect.json" if saved is not None else None
    earlier = json.loads(timing.read_text()) if timing is not None and timing.is_file() else {}
    if saved is not None and (saved / "cells.parquet").is_file() and earlier.get("draws", {}) == drawn:
        answers, cells = pd.read_parquet(saved / "answers.parquet"), pd.read_parquet(saved / "cells.parquet")
        collect_s = earlier.get("collect_s")
    else:
        started = time.perf_counter()
        answers, cells = collect(model, tokenizer, examples, policies, prompt_format=prompt_format, log=log,
                                 draws=draws)  # fmt: skip
        collect_s = round(time.perf_counter() - started)
        if saved is not None:
            saved.mkdir(parents=True, exist_ok=True)
            answers.to_parquet(saved / "answers.parquet")
            cells.to_parquet(saved / "cells.parquet")
            timing.write_text(json.dumps({"collect_s": collect_s, "draws": drawn}) + "\n")
    n_layers = int(model.config.num_hidden_layers)
    res = fit(answers, cells, n_layers=n_layers, split_seed=split_seed)
    full_acc = answers.drop_duplicates("example_id")["full_correct"].mean()
    res["report"]["full_cache_accuracy"] = float(full_acc)
    res["report"]["accuracy_by_budget"] = {f"{b:g}": float(g["correct"].mean()) for b, g in answers.groupby("budget")}
    return dict(
        model=model_name,
        n_layers=n_layers,
        policy=policy_fields,
        budgets=sorted(budgets),
        multipliers=res["multipliers"],
        reduction=res["reduction"],
        thresholds=res["thresholds"],
        budget_thresholds=res["budget_thresholds"],
        budget_thresholds_source="kvcert calibrate: the calibration half's answers at each budget",
        signal_thresholds=res["signal_thresholds"],
        signal_budget_thresholds=res["signal_budget_thresholds"],
        draws=drawn,
        models=res["models"],
        data={**data, "n_examples": len(examples), "split_seed": split_seed, "collect_s": collect_s},
        report=res["report"],
    )
