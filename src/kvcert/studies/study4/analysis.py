"""Study 4's evaluation (draft, preregistration/study4/PLAN.md): answer-level escalation signals at matched rates,
pure pandas over `kvcert.studies.study4.collect`'s rows.

A policy "escalate by signal s at rate r" at budget b gives each example the full cache's answer when its score under
s is above the threshold, else the compressed answer. The threshold is the (1 - r)-quantile of the scores on the
calibration split (never on the confirmatory examples, where the realized rate is reported beside r). Scores:

    certificate  the answer's largest token certificate     confidence  minus its lowest token log-probability
    probe        the prefill probe's error                  combined    a logistic model over the three (+ budget)
    random       a seeded permutation: the first round(r n) confirmatory examples (the control)

Per (budget, signal, rate): accuracy, realized rate, mean KV bytes held (the full cache's for an escalated answer,
which the restart ends with), mean extra prefill tokens (the prompt read again for an escalated answer), and, for
each pair of signals, the paired accuracy difference with a 95% example-cluster bootstrap interval
(kvcert.analysis.bootstrap). Discrimination (AUROC for a cache-induced failure, among examples the full cache got
right) is reported pooled and counting only pairs inside one task x length cell.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvcert.analysis.bootstrap import paired_difference, weighted_mean
from kvcert.serve.signals import COMBINED_FEATURES, fit_logistic, predict

RATES = (0.1, 0.2, 0.3, 0.5)
SIGNALS = ("certificate", "confidence", "probe", "combined", "random")
CALIBRATION_SHARE = 0.3
N_BOOT, BOOT_SEED, RANDOM_SEED = 2000, 20260101, 4


def within_cell_auroc(labels: np.ndarray, scores: np.ndarray, cells: np.ndarray) -> float:
    """Share of (positive, negative) pairs inside one cell ranked right (ties count half)."""
    hits = pairs = 0.0
    for cell in np.unique(cells):
        at = cells == cell
        pos, neg = scores[at & labels], scores[at & ~labels]
        if len(pos) and len(neg):
            diff = pos[:, None] - neg[None, :]
            hits += (diff > 0).sum() + 0.5 * (diff == 0).sum()
            pairs += diff.size
    return hits / pairs if pairs else float("nan")


def pooled_auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    return within_cell_auroc(labels, scores, np.zeros(len(labels)))


def in_calibration_split(example_id: str, share: float = CALIBRATION_SHARE) -> bool:
    """A fixed, seed-free assignment by the id's SHA-256: the same for every run, model and machine."""
    digest = int(hashlib.sha256(example_id.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < share


def add_scores(answers: pd.DataFrame, calibration: pd.DataFrame) -> pd.DataFrame:
    """The signals' score columns (larger: escalate first); `combined` fitted on the calibration rows only."""
    out = answers.assign(
        score_certificate=answers["certificate"],
        score_confidence=-answers["logprob"],
        score_probe=answers["probe_error"],
        cache_failure=answers["full_correct"].astype(bool) & ~answers["correct"].astype(bool),
    )
    cal = calibration.assign(cache_failure=calibration["full_correct"].astype(bool) & ~calibration["correct"])
    model = fit_logistic(cal[cal["full_correct"].astype(bool)], COMBINED_FEATURES, "cache_failure")
    ok = out[list(COMBINED_FEATURES)].notna().all(axis=1)
    out["score_combined"] = np.nan
    if model is not None:
        out.loc[ok, "score_combined"] = predict(model, out[ok])
    return out


def escalated(scores: pd.Series, threshold: float) -> np.ndarray:
    return (scores.to_numpy(np.float64) > threshold) & np.isfinite(scores.to_numpy(np.float64))


def policy_outcomes(
    confirmatory: pd.DataFrame, calibration: pd.DataFrame, signal: str, rate: float
) -> tuple[pd.DataFrame, float]:
    """Per confirmatory example: escalated?, correct, kv_bytes, extra prefill tokens; and the threshold used."""
    if signal == "random":
        order = np.random.default_rng(RANDOM_SEED).permutation(len(confirmatory))
        esc = np.zeros(len(confirmatory), bool)
        esc[order[: round(rate * len(confirmatory))]] = True
        threshold = float("nan")
    else:
        cal_scores = calibration[f"score_{signal}"].dropna().to_numpy(np.float64)
        threshold = float(np.quantile(cal_scores, 1 - rate)) if len(cal_scores) else float("inf")
        esc = escalated(confirmatory[f"score_{signal}"], threshold)
    out = pd.DataFrame(
        dict(
            example_id=confirmatory["example_id"].to_numpy(),
            escalated=esc,
            correct=np.where(esc, confirmatory["full_correct"], confirmatory["correct"]).astype(float),
            kv_bytes=np.where(esc, confirmatory["full_kv_bytes"], confirmatory["kv_bytes"]).astype(float),
            extra_prefill=np.where(esc, confirmatory["prompt_tokens"], 0).astype(float),
        )
    )
    return out, threshold


def kv_matched_threshold(calibration: pd.DataFrame, signal: str, rate: float) -> float:
    """The lowest threshold whose policy holds, on the calibration split, no more mean KV bytes than random
    escalation at `rate` holds there in expectation ((1 - rate) compressed + rate full cache)."""
    kv, full = calibration["kv_bytes"].to_numpy(float), calibration["full_kv_bytes"].to_numpy(float)
    target = (1 - rate) * kv.mean() + rate * full.mean()
    scores = calibration[f"score_{signal}"].to_numpy(np.float64)
    best = float("inf")
    # descending: each step escalates more examples (escalated: score > t; -inf escalates every scored example)
    for t in [*np.unique(scores[np.isfinite(scores)])[::-1], -np.inf]:
        esc = escalated(calibration[f"score_{signal}"], t)
        if np.where(esc, full, kv).mean() > target:
            break
        best = float(t)
    return best


def kv_matched_outcomes(conf: pd.DataFrame, cal: pd.DataFrame, budget: float, rates: Sequence[float]) -> list[dict]:
    rows = []
    for rate in rates:
        for signal in ("certificate", "confidence", "probe", "combined"):
            threshold = kv_matched_threshold(cal, signal, rate)
            esc = escalated(conf[f"score_{signal}"], threshold)
            rows.append(
                dict(
                    budget=budget,
                    kv_of_random_at=rate,
                    signal=signal,
                    threshold=threshold,
                    realized_rate=esc.mean(),
                    accuracy=100 * np.where(esc, conf["full_correct"], conf["correct"]).astype(float).mean(),
                    mean_kv_mib=np.where(esc, conf["full_kv_bytes"], conf["kv_bytes"]).astype(float).mean() / 2**20,
                )
            )
    return rows


def evaluate(
    answers: pd.DataFrame, rates: Sequence[float] = RATES, signals: Sequence[str] = SIGNALS, n_boot: int = N_BOOT
) -> dict[str, pd.DataFrame]:
    """The outcome table, the paired differences and the discrimination table (see the module docstring)."""
    answers = answers.copy()
    answers["split"] = np.where(answers["example_id"].map(in_calibration_split), "calibration", "confirmatory")
    rows, diffs, disc, matched = [], [], [], []
    for budget, at in answers.groupby("budget", sort=True):
        cal = at[at["split"] == "calibration"]
        scored = add_scores(at, cal)
        cal, conf = scored[scored["split"] == "calibration"], scored[scored["split"] == "confirmatory"]
        conf = conf.sort_values("example_id").reset_index(drop=True)
        for rate in rates:
            outcomes = {}
            for signal in signals:
                res, threshold = policy_outcomes(conf, cal, signal, rate)
                outcomes[signal] = res
                rows.append(
                    dict(
                        budget=budget,
                        rate=rate,
                        signal=signal,
                        threshold=threshold,
                        realized_rate=res["escalated"].mean(),
                        accuracy=100 * res["correct"].mean(),
                        mean_kv_mib=res["kv_bytes"].mean() / 2**20,
                        mean_extra_prefill=res["extra_prefill"].mean(),
                        n=len(res),
                    )
                )
            for a, b in [("certificate", s) for s in signals if s != "certificate"] + [("combined", "confidence")]:
                if a not in outcomes or b not in outcomes:
                    continue
                ca, cb = outcomes[a]["correct"].to_numpy(), outcomes[b]["correct"].to_numpy()
                ci = paired_difference(
                    weighted_mean(ca),
                    weighted_mean(cb),
                    conf["example_id"],
                    n_boot,
                    BOOT_SEED,
                    diff=weighted_mean(ca - cb),
                )["diff"].scaled(100)
                diffs.append(dict(budget=budget, rate=rate, a=a, b=b, diff=ci.estimate, lo=ci.lo, hi=ci.hi))
        matched += kv_matched_outcomes(conf, cal, budget, rates)
        right = conf[conf["full_correct"].astype(bool)]
        labels = right["cache_failure"].to_numpy(bool)
        cells = (right["task"].astype(str) + "@" + right["context_tokens"].astype(str)).to_numpy()
        for signal in ("certificate", "confidence", "probe", "combined"):
            scores = right[f"score_{signal}"].to_numpy(np.float64)
            ok = np.isfinite(scores)
            disc.append(
                dict(
                    budget=budget,
                    signal=signal,
                    auroc_pooled=pooled_auroc(labels[ok], scores[ok]),
                    auroc_within_cells=within_cell_auroc(labels[ok], scores[ok], cells[ok]),
                    n=int(ok.sum()),
                    n_cache_failures=int(labels[ok].sum()),
                )
            )
    return dict(
        outcomes=pd.DataFrame(rows),
        differences=pd.DataFrame(diffs),
        discrimination=pd.DataFrame(disc),
        kv_matched=pd.DataFrame(matched),
    )


def report(answers: pd.DataFrame, title: str, n_boot: int = N_BOOT) -> str:
    """The three tables as Markdown, plus full-cache and compressed accuracy per task and budget."""
    from kvcert.analysis.tables import markdown_table

    res = evaluate(answers, n_boot=n_boot)
    acc = answers.groupby(["task", "budget"]).agg(
        n=("example_id", "size"), full=("full_correct", "mean"), compressed=("correct", "mean")
    )
    parts = [
        f"# {title}",
        "Accuracy per task and budget (share of examples; full: the full cache):",
        markdown_table(acc.reset_index(), floatfmt=".3f"),
        "Escalation at matched rates (thresholds from the calibration split; confirmatory split shown):",
        markdown_table(res["outcomes"], floatfmt=".3g"),
        "Paired accuracy differences a - b (points, 95% example-cluster bootstrap):",
        markdown_table(res["differences"], floatfmt=".3g"),
        "AUROC for a cache-induced failure among examples the full cache got right (pooled; within task x length):",
        markdown_table(res["discrimination"], floatfmt=".3f"),
        "At matched mean KV memory (threshold chosen on the calibration split so that the mean KV there is random "
        "escalation's at the rate named; confirmatory split shown):",
        markdown_table(res["kv_matched"], floatfmt=".3g"),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    from kvcert.studies.study4.collect import load_answers

    p = argparse.ArgumentParser(description="study 4's evaluation of an answers.jsonl (draft; exploratory)")
    p.add_argument("answers", nargs="+", help="answers.jsonl files (one per model)")
    p.add_argument("--out", default=None, help="write the report here (default: beside the first file)")
    args = p.parse_args(argv)
    texts = []
    for path in args.answers:
        texts.append(report(load_answers(path), f"{Path(path).parent.name} (exploratory: {path})"))
    out = Path(args.out) if args.out else Path(args.answers[0]).parent.parent / "pilot_report.md"
    out.write_text("\n".join(texts))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
