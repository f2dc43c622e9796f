"""Study 5's analysis (preregistration/study5/PLAN.md section 6): claims P1-P5 per model on the confirmatory split,
the tables reported beside them, and the report. Pure pandas over results/study5/<model>/answers.jsonl.

Issue #52 (DEVIATIONS.md, written after the results): the report's table also shows every signal's overall row with
ties at the threshold drawn (`above_or_drawn`; the claims keep the strict `above`), the "differs" flag from the
draws' answers beside the recorded one, the oracle capped at the rate beside the uncapped one, and, under the
claims, how fragile P1 and P2 are (kvcert.studies.study5.fragility, exploratory).

    python -m kvcert.studies.study5 analyze [--partial]
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvcert.analysis.bootstrap import bootstrap_many, paired_difference, weighted_mean
from kvcert.analysis.tables import markdown_table
from kvcert.studies.study4.analysis import within_cell_auroc
from kvcert.studies.study4.claims import verdict
from kvcert.studies.study5 import fragility
from kvcert.studies.study5.common import MODELS, PREREG, RESULTS, load_rows
from kvcert.studies.study5.signals import (
    above,
    above_or_drawn,
    agreement_score,
    answers_differ_score,
    cell_rule,
    cells,
    outcome,
    random_score,
    seeded_uniform,
    threshold,
    with_split,
    within_cell_escalated,
)

N_BOOT, BOOT_SEED = 2000, 20260101
RATE = 0.2
MIB = 2**20


class Study5:
    """One model's records at one budget, split, with every signal's score (agreement per the design)."""

    def __init__(self, answers: pd.DataFrame, design: Mapping, budget: float):
        at = with_split(answers[np.isclose(answers["budget"], budget)])
        self.budget = budget
        self.cal = at[at["split"] == "calibration"].reset_index(drop=True)
        self.conf = at[at["split"] == "confirmatory"].sort_values("example_id").reset_index(drop=True)
        self.variant = "split" if design["variant"] == "split" else f"r{int(design['draws'])}"
        self.form = str(design["form"])
        self.kv_system = "kv_split" if self.variant == "split" else f"kv_{self.variant}"
        for frame in (self.cal, self.conf):
            frame["score_agreement"] = agreement_score(frame, self.variant, self.form, reference=self.cal)
            frame["score_confidence"] = frame["confidence"].astype(float)
            frame["score_certificate"] = frame["certificate"].astype(float)
            frame["score_differs"] = frame[f"differs_{self.variant}"].astype(float)  # as recorded: end tokens
            frame["score_differs_answers"] = answers_differ_score(frame, self.variant)  # answers, not end tokens
            frame["score_random"] = random_score(frame)

    def kv_column(self, signal: str) -> str:
        return self.kv_system if signal in ("agreement", "differs", "differs_answers") else "kv_one"

    def within(self, signal: str, rate: float = RATE) -> pd.DataFrame:
        esc = within_cell_escalated(self.conf, self.conf[f"score_{signal}"].to_numpy(np.float64), rate)
        return outcome(self.conf, esc, self.kv_column(signal))

    def overall(self, signal: str, rate: float = RATE, ties: str = "strict") -> pd.DataFrame:
        """The calibration's threshold at `rate`; ties "strict" (the claims' rule: a tie never escalates) or "drawn"
        (a seeded draw among the tied that holds the rate)."""
        cal = self.cal[f"score_{signal}"].to_numpy(np.float64)
        scores = self.conf[f"score_{signal}"].to_numpy(np.float64)
        cut = threshold(cal, rate)
        if ties == "strict":
            esc = above(scores, cut)
        elif ties == "drawn":
            esc = above_or_drawn(scores, cut, cal, rate, self.conf["example_id"])
        else:
            raise ValueError(f"ties={ties!r}: 'strict' or 'drawn'")
        return outcome(self.conf, esc, self.kv_column(signal))

    def cell_rule(self, count: float) -> pd.DataFrame:
        return outcome(self.conf, cell_rule(self.cal, self.conf, count), "kv_one")

    def oracle(self, rate: float | None = None, within: bool = False) -> pd.DataFrame:
        """Escalates cache-induced failures: every one (rate None, the pre-registered row) or at most round(rate n) of
        them (within: round(rate n_cell) per cell), the ones first in a seeded random order when there are more."""
        fail = self.conf["cache_failure"].to_numpy(bool)
        if rate is not None:
            order = seeded_uniform(self.conf["example_id"], BOOT_SEED)
            groups = cells(self.conf) if within else np.zeros(len(fail), dtype=int)
            esc = np.zeros(len(fail), bool)
            for g in np.unique(groups):
                at = np.flatnonzero(groups == g)
                failed = at[fail[at]]
                esc[failed[np.argsort(order[failed], kind="stable")][: round(rate * len(at))]] = True
            fail = esc
        return outcome(self.conf, fail, "kv_one")

    def kv_matched_confidence(self, rate: float = RATE) -> pd.DataFrame:
        """Confidence on one draw at the rate whose mean KV on the calibration split equals agreement's at `rate`."""
        agree = outcome(self.cal, above(self.cal["score_agreement"].to_numpy(np.float64),
                                        threshold(self.cal["score_agreement"].to_numpy(np.float64), rate)),
                        self.kv_system)["kv"].mean()  # fmt: skip
        conf_scores = self.cal["score_confidence"].to_numpy(np.float64)
        grid = np.round(np.arange(0, 1.0001, 0.005), 3)
        kv = [outcome(self.cal, above(conf_scores, threshold(conf_scores, r)), "kv_one")["kv"].mean() for r in grid]
        best = float(grid[int(np.argmin(np.abs(np.array(kv) - agree)))])
        return self.overall("confidence", best).assign(matched_rate=best)


def _difference(conf: pd.DataFrame, a: pd.DataFrame, b: pd.DataFrame) -> dict:
    ca, cb = a["correct"].to_numpy(float), b["correct"].to_numpy(float)
    ci = paired_difference(
        weighted_mean(ca), weighted_mean(cb), conf["example_id"], N_BOOT, BOOT_SEED, diff=weighted_mean(ca - cb)
    )["diff"].scaled(100)
    return dict(
        estimate=ci.estimate,
        lo=ci.lo,
        hi=ci.hi,
        n=len(conf),
        accuracy_a=100 * float(ca.mean()),
        accuracy_b=100 * float(cb.mean()),
        rate_a=float(a["escalated"].mean()),
        rate_b=float(b["escalated"].mean()),
        kv_mib_a=float(a["kv"].mean()) / MIB,
        kv_mib_b=float(b["kv"].mean()) / MIB,
    )


def auroc_difference(s: Study5, a: str, b: str) -> dict:
    """Within-cell AUROC(a) - AUROC(b) for a cache-induced failure among confirmatory rows the full cache got right."""
    right = s.conf[s.conf["full_correct"].astype(bool)].reset_index(drop=True)
    labels, c = right["cache_failure"].to_numpy(bool), cells(right)

    def of(column: str) -> Callable[[np.ndarray], float]:
        scores = np.nan_to_num(right[f"score_{column}"].to_numpy(np.float64), nan=-np.inf)

        def stat(w: np.ndarray) -> float:
            rep = np.repeat(np.arange(len(w)), w.astype(int))
            return within_cell_auroc(labels[rep], scores[rep], c[rep])

        return stat

    res = bootstrap_many({"a": of(a), "b": of(b)}, right["example_id"], N_BOOT, BOOT_SEED,
                         derived={"diff": lambda v: v["a"] - v["b"]})  # fmt: skip
    d = res["diff"]
    return dict(estimate=d.estimate, lo=d.lo, hi=d.hi, n=len(right), n_cache_failures=int(labels.sum()),
                auroc_a=res["a"].estimate, auroc_b=res["b"].estimate)  # fmt: skip


def evaluate_claim(answers: pd.DataFrame, design: Mapping, spec: Mapping) -> dict:
    s = Study5(answers, design, float(spec["budget"]))
    test = spec["test"]
    if test == "within_cell_gain":
        result = _difference(s.conf, s.within(spec["a"]), s.within(spec["b"]))
    elif test == "against_cell_rule":
        a = s.overall(spec["a"])
        result = _difference(s.conf, a, s.cell_rule(float(a["escalated"].sum())))
    elif test == "within_cell_auroc":
        result = auroc_difference(s, spec["a"], spec["b"])
    elif test == "kv_matched":
        b = s.kv_matched_confidence()
        result = _difference(s.conf, s.overall(spec["a"]), b) | {"confidence_rate": float(b["matched_rate"].iloc[0])}
        if s.variant == "split":
            return dict(result, verdict="reported, not decided (split halves: the KV is one draw's)", unit="points")
    else:
        raise ValueError(f"unknown study-5 test {test!r}")
    return dict(result, verdict=verdict(spec["rule"], result, float(spec.get("margin", 0.0))), unit=spec["unit"])


SIGNAL_ROWS = {  # the table's row name of each signal (the flag from the answers beside the recorded one)
    "agreement": "agreement",
    "confidence": "confidence",
    "certificate": "certificate",
    "differs": "differs (recorded: end tokens compared)",
    "differs_answers": "differs (answers compared)",
    "random": "random",
}
ORACLE_UNCAPPED = "oracle (uncapped: every cache-induced failure)"
ORACLE_CAPPED = "oracle (capped at the rate)"
LEGEND = (
    "Each budget's table: `within_*` escalates the top 20% of each task x length cell; `overall_*` escalates the\n"
    "scores above the calibration split's 20% threshold, a score equal to it never (strict `>`, the pre-registered\n"
    "rule every claim uses); `drawn_*` is the same threshold with the rows tied at it escalated by a seeded draw that\n"
    "holds the rate on the calibration split (kvcert.serve.escalator's tie rule; reported, no verdict).\n"
    '"differs (recorded: end tokens compared)" is the pre-registered flag (`differs_r3` of the records: a different\n'
    'token ending the same answer counts as a difference); "differs (answers compared)" compares the draws\' answers\n'
    '(texts up to the stop). "oracle (uncapped ...)" escalates every cache-induced failure (the pre-registered row,\n'
    'at whatever rate that is); "oracle (capped at the rate)" escalates at most 20% of the rows (within: of each\n'
    "cell), cache-induced failures only: the most any rule at that rate can recover. Deviations: DEVIATIONS.md."
)


def signal_table(answers: pd.DataFrame, design: Mapping, budget: float) -> pd.DataFrame:
    """Every signal at rate 20%, within cells and overall (ties at the threshold strict, the claims' rule, and drawn):
    accuracy, realized rate, mean KV; AUROCs. The cell rule, the oracle (uncapped and capped at the rate), none."""
    s = Study5(answers, design, budget)
    right = s.conf[s.conf["full_correct"].astype(bool)]
    rows = []
    for signal, name in SIGNAL_ROWS.items():
        w, o, d = s.within(signal), s.overall(signal), s.overall(signal, ties="drawn")
        scores = np.nan_to_num(right[f"score_{signal}"].to_numpy(np.float64), nan=-np.inf)
        lab = right["cache_failure"].to_numpy(bool)
        rows.append(dict(signal=name, within_accuracy=100 * w["correct"].mean(), within_kv_mib=w["kv"].mean() / MIB,
                         overall_accuracy=100 * o["correct"].mean(), overall_rate=o["escalated"].mean(),
                         overall_kv_mib=o["kv"].mean() / MIB,
                         drawn_accuracy=100 * d["correct"].mean(), drawn_rate=d["escalated"].mean(),
                         drawn_kv_mib=d["kv"].mean() / MIB,
                         auroc_within=within_cell_auroc(lab, scores, cells(right)),
                         auroc_pooled=within_cell_auroc(lab, scores, np.zeros(len(right)))))  # fmt: skip
    agree = s.overall("agreement")
    capped, capped_within = s.oracle(RATE), s.oracle(RATE, within=True)
    rows.append(dict(signal="cell rule", **_overall(s.cell_rule(float(agree["escalated"].sum())))))
    rows.append(dict(signal=ORACLE_UNCAPPED, **_overall(s.oracle())))
    rows.append(dict(signal=ORACLE_CAPPED, within_accuracy=100 * capped_within["correct"].mean(),
                     within_kv_mib=capped_within["kv"].mean() / MIB, **_overall(capped)))  # fmt: skip
    rows.append(dict(signal="none", **_overall(outcome(s.conf, np.zeros(len(s.conf)), "kv_one"))))
    return pd.DataFrame(rows)


def _overall(frame: pd.DataFrame) -> dict:
    return dict(overall_accuracy=100 * frame["correct"].mean(), overall_rate=frame["escalated"].mean(),
                overall_kv_mib=frame["kv"].mean() / MIB)  # fmt: skip


def majority_correct(frame: pd.DataFrame, r: int) -> np.ndarray:
    """The majority answer of the first r draws (ties: draw 0's) is right."""
    out = []
    for answers, correct in zip(frame["draw_answers"], frame["draw_correct"]):
        votes = pd.Series([a.strip() for a in answers[:r]])
        counts = votes.value_counts()
        top = counts[counts == counts.max()].index
        winner = votes.iloc[0] if votes.iloc[0] in top else top[0]
        out.append(bool(correct[int(votes[votes == winner].index[0])]))
    return np.array(out, float)


def secondary(answers: pd.DataFrame, design: Mapping) -> dict:
    r = 2 if design["variant"] == "split" else int(design["draws"])
    s5, s25 = Study5(answers, design, 0.5), Study5(answers, design, 0.25)
    out = {}
    if r >= 2 and "draw_answers" in s5.conf:
        maj = pd.DataFrame(dict(correct=majority_correct(s5.conf, r), escalated=0.0, kv=s5.conf[s5.kv_system]))
        one = outcome(s5.conf, np.zeros(len(s5.conf)), "kv_one")
        out["majority_vs_draw0_b0.5"] = _difference(s5.conf, maj, one)
    small = s25.overall("agreement")
    out["draws_b0.25_vs_one_draw_b0.5"] = {
        "no escalation": _difference(s25.conf, small, outcome(s5.conf, np.zeros(len(s5.conf)), "kv_one")),
        "confidence 20%": _difference(s25.conf, small, s5.overall("confidence")),
    }
    return out


def analyze(root: Path = Path("."), partial: bool = False, n_boot: int | None = None) -> dict:
    """Claims (results/study5/claims.json, complete models only) and the report; n_boot: fewer resamples (tests)."""
    global N_BOOT
    kept, N_BOOT = N_BOOT, n_boot or N_BOOT
    try:
        return _analyze(root, partial)
    finally:
        N_BOOT = kept


def _analyze(root: Path, partial: bool) -> dict:
    design = yaml.safe_load((root / PREREG / "design.yaml").read_text())
    out: dict = {}
    lines = [f"# Study 5 {'interim report (incomplete records, no claims)' if partial else 'report'}", "", LEGEND, ""]
    for tag in MODELS:
        path = root / RESULTS / tag / "answers.jsonl"
        if not path.is_file():
            continue
        answers = load_rows(path)
        planned = len(design["models"][tag]["tasks"]) * len(design["lengths"]) * design["models"][tag]["n_per_cell"]
        done = answers["example_id"].nunique()
        lines += [f"## {tag}: {done} / {planned} examples", ""]
        if done < planned and not partial:
            lines += ["Records incomplete: no claim is decided (`analyze --partial` for an interim table).", ""]
            continue
        for budget in design["budgets"]:
            table = signal_table(answers, design, float(budget)).round(3)
            lines += [f"### budget {budget:g}, rate 20% (confirmatory split)", "", markdown_table(table), ""]
        if partial:
            continue
        preds = yaml.safe_load((root / PREREG / f"predictions_{tag}.yaml").read_text())
        claims = {cid: evaluate_claim(answers, design, spec) for cid, spec in preds["claims"].items()}
        out[tag] = dict(claims=claims, secondary=secondary(answers, design))
        rows = [dict(claim=cid, estimate=c["estimate"], lo=c["lo"], hi=c["hi"], verdict=c["verdict"])
                for cid, c in claims.items()]  # fmt: skip
        lines += ["### claims", "", markdown_table(pd.DataFrame(rows).round(3)), ""]
        studies = {cid: Study5(answers, design, float(preds["claims"][cid]["budget"])) for cid in fragility.CLAIMS
                   if preds["claims"].get(cid, {}).get("test") == "within_cell_gain"}  # fmt: skip
        lines += fragility.lines(tag, studies, preds["claims"], claims, N_BOOT, BOOT_SEED, RATE)
    name = "interim_report.md" if partial else "report.md"
    (root / RESULTS).mkdir(parents=True, exist_ok=True)
    (root / RESULTS / name).write_text("\n".join(lines))
    if not partial and out:
        (root / RESULTS / "claims.json").write_text(json.dumps(out, indent=2, default=_json))
    return out


def _json(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return float("nan") if isinstance(value, float) and math.isnan(value) else str(value)
