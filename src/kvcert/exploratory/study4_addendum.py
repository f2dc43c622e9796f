"""Exploratory (not pre-registered, computed after the results): an independent recomputation over study 4's
published records (`results/study4/<model>/answers.jsonl`); nothing locked is read back or changed.

Same definitions as study 4's analysis (copied, not imported: the split by the id's SHA-256, 30% calibration; a
threshold is the (1 - r)-quantile of the calibration split's scores, an example escalates when its score is above
it; random is the seeded permutation of the confirmatory examples sorted by id; 2000 example-cluster resamples,
seed 20260101). At rate 20%, budgets 0.5 and 0.25, on the confirmatory split:

1. cell rule: knows only a prompt's task x length cell. Cells are ranked by the calibration split's escalation gain
   per example (mean full-cache correct minus compressed correct); whole cells are escalated in that order until the
   certificate's escalation count on the confirmatory split is reached, the last cell in part (each of its examples
   counts as escalated with probability left / n_cell: the expectation over a random choice inside the cell).
2. confidence against random, and what confidence's escalations were (cache-induced failure: full cache right and
   compressed wrong; the full cache wrong too; both right; a loss: compressed right, full cache wrong).
3. oracle: escalates exactly the cache-induced failures; each policy's gain over no escalation as its share of the
   oracle's gain.
4. confidence without the answer's first token (its log-probability comes from the full-cache prefill and is equal
   at every budget): minus the lowest log-probability over tokens 2.. (0 for a one-token answer, the convention the
   certificate uses for the first token); the P1 comparison with it, and AUROC for a cache-induced failure among
   examples the full cache got right, pooled and counting only pairs inside one cell.

    python -m kvcert.exploratory.study4_addendum   # -> results/study4/exploratory_addendum.{md,json}
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.bootstrap import bootstrap_many, paired_difference, weighted_mean
from kvcert.analysis.tables import markdown_table

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "results" / "study4"
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}
BUDGETS = (0.5, 0.25)
RATE = 0.2
CALIBRATION_SHARE = 0.3
N_BOOT, BOOT_SEED, RANDOM_SEED = 2000, 20260101, 4
SIGNALS = ("certificate", "confidence", "confidence_nofirst")
POLICIES = ("none", "certificate", "confidence", "confidence_nofirst", "random", "cell_rule", "oracle")
COMPARISONS = (
    ("certificate", "cell_rule"),
    ("confidence", "random"),
    ("certificate", "confidence"),
    ("certificate", "confidence_nofirst"),
    ("confidence_nofirst", "confidence"),
    ("confidence_nofirst", "random"),
)
AUROC_DIFFS = (
    ("certificate", "confidence"),
    ("confidence_nofirst", "confidence"),
    ("certificate", "confidence_nofirst"),
)
FIRST_LINE = (
    "**EXPLORATORY addendum** - computed after the results, from study 4's published records "
    "(results/study4/<model>/answers.jsonl); not pre-registered; nothing locked changed (plan, predictions, claims "
    "and reports are as published)."
)


def in_calibration_split(example_id: str, share: float = CALIBRATION_SHARE) -> bool:
    digest = int(hashlib.sha256(example_id.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < share


def confidence_without_first(logprobs: Sequence[float]) -> float:
    """Minus the lowest log-probability after the first token; 0 for a one-token answer, NaN for an empty one."""
    values = list(logprobs)
    if not values:
        return float("nan")
    return float(-min(values[1:])) if len(values) > 1 else 0.0


def first_is_lowest(logprobs: Sequence[float]) -> bool:
    values = list(logprobs)
    return bool(values) and int(np.argmin(values)) == 0


def prepare(answers: pd.DataFrame) -> pd.DataFrame:
    """Split, cell, cache-induced failure and the three score columns (larger: escalate first)."""
    out = answers.copy()
    out["split"] = np.where(out["example_id"].map(in_calibration_split), "calibration", "confirmatory")
    out["cell"] = out["task"].astype(str) + "@" + out["context_tokens"].astype(str)
    out["full_correct"] = out["full_correct"].astype(bool)
    out["correct"] = out["correct"].astype(bool)
    out["cache_failure"] = out["full_correct"] & ~out["correct"]
    out["score_certificate"] = out["certificate"].astype(float)
    out["score_confidence"] = -out["logprob"].astype(float)
    out["score_confidence_nofirst"] = out["token_logprobs"].map(confidence_without_first)
    out["first_is_lowest"] = out["token_logprobs"].map(first_is_lowest)
    return out


def threshold_escalation(conf: pd.DataFrame, cal: pd.DataFrame, signal: str, rate: float) -> np.ndarray:
    cal_scores = cal[f"score_{signal}"].dropna().to_numpy(np.float64)
    threshold = float(np.quantile(cal_scores, 1 - rate)) if len(cal_scores) else float("inf")
    scores = conf[f"score_{signal}"].to_numpy(np.float64)
    return ((scores > threshold) & np.isfinite(scores)).astype(float)


def random_escalation(n: int, rate: float, seed: int = RANDOM_SEED) -> np.ndarray:
    esc = np.zeros(n)
    esc[np.random.default_rng(seed).permutation(n)[: round(rate * n)]] = 1.0
    return esc


def cell_gains(cal: pd.DataFrame) -> pd.Series:
    """Per cell, the calibration split's escalation gain per example; largest first (ties by cell name)."""
    gain = (cal["full_correct"].astype(float) - cal["correct"].astype(float)).groupby(cal["cell"]).mean()
    return gain.sort_index().sort_values(ascending=False, kind="stable")


def cell_rule_escalation(conf: pd.DataFrame, cal: pd.DataFrame, count: float) -> np.ndarray:
    """Escalation probability per confirmatory example: whole cells by calibration gain until `count` is reached."""
    gains = cell_gains(cal)
    cells = conf["cell"].to_numpy()
    order = list(gains.index) + sorted(set(cells) - set(gains.index))  # cells absent from calibration go last
    esc, left = np.zeros(len(conf)), float(count)
    for cell in order:
        at = cells == cell
        n = int(at.sum())
        if left <= 0:
            break
        if n:
            esc[at] = min(1.0, left / n)
            left -= min(left, n)
    return esc


def outcome(conf: pd.DataFrame, esc: np.ndarray) -> dict[str, np.ndarray]:
    full, comp = conf["full_correct"].to_numpy(float), conf["correct"].to_numpy(float)
    kv_full, kv = conf["full_kv_bytes"].to_numpy(float), conf["kv_bytes"].to_numpy(float)
    return dict(escalated=esc, correct=esc * full + (1 - esc) * comp, kv_bytes=esc * kv_full + (1 - esc) * kv)


def escalation_kinds(conf: pd.DataFrame, esc: np.ndarray) -> dict[str, float]:
    """(Expected) counts of escalated examples by (full cache, compressed) correctness."""
    full, comp = conf["full_correct"].to_numpy(bool), conf["correct"].to_numpy(bool)
    return dict(
        cache_induced=float(esc[full & ~comp].sum()),
        full_also_wrong=float(esc[~full & ~comp].sum()),
        both_right=float(esc[full & comp].sum()),
        lost=float(esc[~full & comp].sum()),
    )


def paired(a: np.ndarray, b: np.ndarray, ids: pd.Series, n_boot: int) -> dict[str, float]:
    """a - b in points, paired 95% example-cluster bootstrap."""
    ci = paired_difference(weighted_mean(a), weighted_mean(b), ids, n_boot, BOOT_SEED, diff=weighted_mean(a - b))
    d = ci["diff"].scaled(100)
    return dict(estimate=d.estimate, lo=d.lo, hi=d.hi)


def weighted_auroc(labels: np.ndarray, scores: np.ndarray, cells: np.ndarray) -> Callable[[np.ndarray], float]:
    """AUROC counting only (positive, negative) pairs inside one cell, as a function of per-example resample counts
    (a pair weighs w_pos * w_neg: the same as repeating each example as often as drawn). Ties count half."""
    ok = np.isfinite(scores)
    blocks = []
    for cell in np.unique(cells):
        pos, neg = np.flatnonzero((cells == cell) & labels & ok), np.flatnonzero((cells == cell) & ~labels & ok)
        if len(pos) and len(neg):
            diff = scores[pos][:, None] - scores[neg][None, :]
            blocks.append((pos, neg, (diff > 0) + 0.5 * (diff == 0)))

    def stat(w: np.ndarray) -> float:
        hits = sum(float(w[p] @ m @ w[n]) for p, n, m in blocks)
        pairs = sum(float(w[p].sum() * w[n].sum()) for p, n, _ in blocks)
        return hits / pairs if pairs else float("nan")

    return stat


def auroc_table(conf: pd.DataFrame, n_boot: int) -> list[dict]:
    right = conf[conf["full_correct"]].reset_index(drop=True)
    labels = right["cache_failure"].to_numpy(bool)
    rows = []
    for scope, cells in (("within cells", right["cell"].to_numpy()), ("pooled", np.zeros(len(right)))):
        stats = {s: weighted_auroc(labels, right[f"score_{s}"].to_numpy(np.float64), cells) for s in SIGNALS}
        derived = {f"{a} - {b}": (lambda v, a=a, b=b: v[a] - v[b]) for a, b in AUROC_DIFFS}
        res = bootstrap_many(stats, right["example_id"], n_boot, BOOT_SEED, derived=derived)
        for name, ci in res.items():
            rows.append(dict(scope=scope, auroc=name, estimate=ci.estimate, lo=ci.lo, hi=ci.hi))
    for row in rows:
        row.update(n=len(right), n_cache_failures=int(labels.sum()))
    return rows


def analyse_budget(frame: pd.DataFrame, budget: float, rate: float = RATE, n_boot: int = N_BOOT) -> dict:
    at = frame[np.isclose(frame["budget"], budget)]
    cal = at[at["split"] == "calibration"]
    conf = at[at["split"] == "confirmatory"].sort_values("example_id").reset_index(drop=True)
    esc = {s: threshold_escalation(conf, cal, s, rate) for s in SIGNALS}
    esc["none"] = np.zeros(len(conf))
    esc["random"] = random_escalation(len(conf), rate)
    esc["cell_rule"] = cell_rule_escalation(conf, cal, esc["certificate"].sum())
    esc["oracle"] = conf["cache_failure"].to_numpy(float)
    out = {p: outcome(conf, esc[p]) for p in POLICIES}
    base, oracle = out["none"]["correct"].mean(), out["oracle"]["correct"].mean()
    policies = []
    for p in POLICIES:
        acc = out[p]["correct"].mean()
        share = (acc - base) / (oracle - base) if oracle > base else float("nan")
        policies.append(dict(policy=p, accuracy=100 * acc, realized_rate=esc[p].mean(), escalated=float(esc[p].sum()),
                             mean_kv_mib=out[p]["kv_bytes"].mean() / 2**20, share_of_oracle_gain=share,
                             **escalation_kinds(conf, esc[p])))  # fmt: skip
    diffs = [
        dict(a=a, b=b, **paired(out[a]["correct"], out[b]["correct"], conf["example_id"], n_boot))
        for a, b in COMPARISONS
    ]
    return dict(
        budget=budget,
        rate=rate,
        n=len(conf),
        n_calibration=len(cal),
        policies=policies,
        differences=diffs,
        auroc=auroc_table(conf, n_boot),
        cell_gains={c: float(g) for c, g in cell_gains(cal).items()},
        ceiling_at_certificate_count=100 * (base + min(esc["certificate"].sum(), esc["oracle"].sum()) / len(conf)),
    )


def analyse_model(answers: pd.DataFrame, n_boot: int = N_BOOT) -> dict:
    frame = prepare(answers)
    nonempty = frame[frame["token_logprobs"].map(len) > 0]
    spread = nonempty.assign(first=nonempty["token_logprobs"].map(lambda x: x[0])).groupby("example_id")["first"]
    return dict(
        n_examples=int(frame["example_id"].nunique()),
        first_token_lowest_share=float(nonempty["first_is_lowest"].mean()),
        first_token_lowest_share_by_budget={
            str(b): float(g["first_is_lowest"].mean()) for b, g in nonempty.groupby("budget")
        },
        first_token_logprob_max_spread_across_budgets=float((spread.max() - spread.min()).max()),
        one_token_answers=int((frame["token_logprobs"].map(len) == 1).sum()),
        budgets=[analyse_budget(frame, b, n_boot=n_boot) for b in BUDGETS],
    )


def _fmt(v: object, digits: int) -> str:
    if isinstance(v, float):
        return "nan" if not np.isfinite(v) else f"{v:.{digits}f}"
    return str(v)


def md_table(rows: list[dict], columns: Sequence[str], digits: int = 1) -> str:
    cells = pd.DataFrame([[_fmt(r[c], digits) for c in columns] for r in rows], columns=list(columns))
    return markdown_table(cells, parse_numbers=False)


def _ci(d: dict, digits: int = 1) -> str:
    return f"{d['estimate']:+.{digits}f} [{d['lo']:+.{digits}f}, {d['hi']:+.{digits}f}]"


SUMMARY_COLUMNS = ("model", "budget", "cert - cell rule", "conf - random", "conf's cache-induced", "oracle rate / acc",
                   "cert - conf w/o first", "within-cell AUROC cert / conf / w/o first")  # fmt: skip
POLICY_COLUMNS = ("policy", "accuracy", "realized_rate", "escalated", "mean_kv_mib", "cache_induced",
                  "full_also_wrong", "both_right", "lost", "share_of_oracle_gain")  # fmt: skip


def summary_rows(results: dict[str, dict]) -> list[dict]:
    """One row per (model, budget): the headline of each of the four questions."""
    rows = []
    for key, res in results.items():
        for b in res["budgets"]:
            diff = {(d["a"], d["b"]): d for d in b["differences"]}
            pol = {p["policy"]: p for p in b["policies"]}
            auc = {r["auroc"]: r["estimate"] for r in b["auroc"] if r["scope"] == "within cells"}
            conf, oracle = pol["confidence"], pol["oracle"]
            rows.append(
                {
                    "model": key,
                    "budget": f"{b['budget']:g}",
                    "cert - cell rule": _ci(diff["certificate", "cell_rule"]),
                    "conf - random": _ci(diff["confidence", "random"]),
                    "conf's cache-induced": f"{conf['cache_induced']:.0f} of {conf['escalated']:.0f}",
                    "oracle rate / acc": f"{oracle['realized_rate']:.0%} / {oracle['accuracy']:.1f}",
                    "cert - conf w/o first": _ci(diff["certificate", "confidence_nofirst"]),
                    "within-cell AUROC cert / conf / w/o first": " / ".join(f"{auc[s]:.2f}" for s in SIGNALS),
                }
            )
    return rows


def render(results: dict[str, dict], published: dict[str, dict]) -> str:
    parts = [
        FIRST_LINE,
        "# Study 4: exploratory addendum (an independent recomputation)",
        __doc__.split("\n\n", 1)[1].split("\n\n    python")[0],
        "Accuracy and paired differences in points; 95% example-cluster bootstrap intervals (2000 resamples, seed "
        "20260101); realized rate and mean KV (MiB) beside each accuracy; escalation kinds are (expected) counts of "
        "escalated confirmatory examples.",
    ]
    parts.append("## Summary\n\n" + md_table(summary_rows(results), SUMMARY_COLUMNS))
    for key, res in results.items():
        parts.append(f"## {MODELS.get(key, key)} ({res['n_examples']} examples)")
        spread = res["first_token_logprob_max_spread_across_budgets"]
        parts.append(
            f"The answer's first token has its lowest log-probability in {100 * res['first_token_lowest_share']:.0f}% "
            f"of rows (by budget: "
            + ", ".join(f"{b}: {100 * v:.0f}%" for b, v in res["first_token_lowest_share_by_budget"].items())
            + "); its log-probability "
            + ("is identical at every budget" if spread == 0 else f"differs across budgets by at most {spread:.2g}")
            + f"; one-token answers (confidence without the first token 0): {res['one_token_answers']} rows."
        )
        for b in res["budgets"]:
            parts.append(f"### Budget {b['budget']}, rate {b['rate']:.0%} (confirmatory n = {b['n']})")
            parts.append(
                md_table(
                    b["policies"],
                    POLICY_COLUMNS,
                    digits=2,
                )
            )
            diffs = [dict(comparison=f"{d['a']} - {d['b']}", points=_ci(d)) for d in b["differences"]]
            parts.append("Paired differences (points):\n\n" + md_table(diffs, ["comparison", "points"]))
            aur = [dict(scope=r["scope"], auroc=r["auroc"], value=_ci(r, 3)) for r in b["auroc"]]
            n_right, n_cf = b["auroc"][0]["n"], b["auroc"][0]["n_cache_failures"]
            parts.append(
                f"AUROC for a cache-induced failure among the {n_right} confirmatory examples the full cache got right "
                f"({n_cf} cache-induced failures):\n\n" + md_table(aur, ["scope", "auroc", "value"])
            )
            parts.append(
                f"Best possible at the certificate's escalation count: {b['ceiling_at_certificate_count']:.1f}. "
                "Cell ranking (calibration gain per example): "
                + ", ".join(f"{c} {g:+.2f}" for c, g in b["cell_gains"].items())
            )
        claim = published.get(key, {}).get("claims", {}).get("P1")
        p1 = next(d for d in res["budgets"][0]["differences"] if (d["a"], d["b"]) == ("certificate", "confidence"))
        if claim:
            parts.append(
                f"Check: certificate - confidence at budget 0.5 recomputed here {_ci(p1, 2)}; the published P1 "
                f"(claims.json) {_ci(claim, 2)}."
            )
    return "\n\n".join(parts) + "\n"


def _json_safe(x: object) -> object:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, float | np.floating):
        return float(f"{float(x):.10g}") if np.isfinite(x) else None
    if isinstance(x, np.integer | np.bool_):
        return x.item()
    return x


def load_answers(path: Path) -> pd.DataFrame:
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def run(results_dir: Path = RESULTS, out_dir: Path | None = None, n_boot: int = N_BOOT) -> dict[str, dict]:
    out_dir = out_dir or results_dir
    results, published = {}, {}
    for key in MODELS:
        path = results_dir / key / "answers.jsonl"
        if not path.exists():
            continue
        results[key] = analyse_model(load_answers(path), n_boot=n_boot)
        claims = results_dir / key / "claims.json"
        if claims.exists():
            published[key] = json.loads(claims.read_text())
    if not results:
        raise FileNotFoundError(f"no answers.jsonl under {results_dir}/<model>/")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "exploratory_addendum.md").write_text(render(results, published))
    payload = dict(note=FIRST_LINE, rate=RATE, budgets=list(BUDGETS), n_boot=n_boot, models=results)
    (out_dir / "exploratory_addendum.json").write_text(json.dumps(_json_safe(payload), indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="study 4's exploratory addendum from the published records")
    p.add_argument("--results", type=Path, default=RESULTS, help="results/study4 (holds <model>/answers.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: --results)")
    p.add_argument("--n-boot", type=int, default=N_BOOT)
    args = p.parse_args(argv)
    run(args.results, args.out, args.n_boot)
    print(f"wrote {(args.out or args.results) / 'exploratory_addendum.md'} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
