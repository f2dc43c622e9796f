"""EXPLORATORY (issue #23, point 3): online escalation triggered by the certificate, by confidence and at random, at
matched escalation rates.

    python -m kvcert.exploratory.escalation --n-per-task 24 --out results/exploratory/escalation

Not pre-registered and not part of the scorecard. A generation runs from a compressed cache (the default policy of
`kvcert.serve.generate`: window_question x randomized, tail 0.75, floor 0.2, at budget 0.25). When a token's trigger
signal crosses a threshold, the prompt and the tokens generated so far are read again with the full cache and the
answer goes on from there (at most one escalation per answer). Three triggers:

- certificate: the token's calibrated certificate (`kvcert.serve.certificate`, the shipped calibration of the model
  when one exists, else the uncalibrated radius: the report says which) above a threshold;
- confidence: the token's negative log-probability above a threshold;
- random: a seeded random subset of answers, each escalated at a uniformly random token.

Greedy decoding is deterministic, so the study runs each example once without escalation and records every token's
signals; the tokens before the first firing index k are the same whatever the rule, and the escalated answer is
tokens[:k] followed by the full-cache continuation of that prefix (one real call per distinct (example, k),
`escalated_answer`; checked against `generate(..., escalate=...)` on real examples). As in `generate`, the first
token (read with exact attention over the whole prompt) never triggers, and the token that ended the answer (EOS,
stop string) can.

Matched rates: for a target rate r each signal's threshold is the quantile of its per-answer maximum (over the tokens
after the first) at which a share r of the answers escalate; random escalates a seeded subset of the same size.
The thresholds are matched in-sample on the held-out examples themselves (exploratory). Outcomes per (signal, rate):
accuracy (`kvcert.tasks.score`), mean KV memory held (the compressed cache for an answer that never escalates, the
full cache for one that does), mean extra prefill tokens (prompt + k for an escalated answer, 0 otherwise), and
paired example-bootstrap intervals of the accuracy differences certificate - confidence and certificate - random.

Files in --out: base.jsonl and continuations.jsonl (the work, appended as it goes; a rerun skips what is done),
answers.parquet (per example and rule), escalation.md (the table) and escalation.png (the figure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.tables import markdown_table
from kvcert.records import cpu_model

TASKS = ("single_needle", "multikey_needle", "fact_qa")
CONTEXT_TOKENS = 1024
SEED = 6000  # held-out examples: study 1 used 0-1999, study 2 2000-2999, the calibration 5000 onwards
RATES = (0.1, 0.2, 0.3, 0.5)
BUDGET = 0.25
MAX_NEW_TOKENS = 24  # kvcert.tasks.MAX_NEW_TOKENS
MODEL = "smollm2-135m-instruct"
N_BOOT = 2000
BOOT_SEED = 20260101
RANDOM_SEED = 23
SIGNALS = ("certificate", "confidence", "random")
HEADER = "EXPLORATORY: not pre-registered; thresholds matched in-sample"
MIB = 2**20


# ------------------------------------------------------------------------------------------- trigger rules
def first_firing(values: Sequence[float], threshold: float) -> int | None:
    """The first token index k >= 1 whose value is above `threshold` (NaN never fires), or None. Token 0 is read
    exactly from the prompt and never triggers (as in `generate`)."""
    for k in range(1, len(values)):
        v = values[k]
        if v is not None and not math.isnan(v) and v > threshold:
            return k
    return None


def answer_max(values: Sequence[float]) -> float:
    """The largest value over tokens 1.. (NaN ignored); -inf when there is none (then no threshold fires)."""
    finite = [v for v in values[1:] if v is not None and not math.isnan(v)]
    return max(finite) if finite else -math.inf


def matched_threshold(maxima: Sequence[float], rate: float) -> float:
    """A threshold t such that the share of answers with maximum > t is as close to `rate` as the ties allow (never
    above the requested count when two candidates are equally close). t is one of the maxima (or -inf)."""
    m = np.asarray(maxima, dtype=np.float64)
    target = int(round(rate * len(m)))
    best, best_key = math.inf, None
    for t in [-math.inf, *np.unique(m[np.isfinite(m)]).tolist(), math.inf]:
        count = int((m > t).sum())
        key = (abs(count - target), count > target)
        if best_key is None or key < best_key:
            best, best_key = t, key
    return float(best)


def random_escalations(lengths: dict[str, int], n_escalate: int, seed: int) -> dict[str, int]:
    """example_id -> k for a seeded random subset of `n_escalate` answers (those with a token after the first),
    each escalated at a uniformly random token index in 1..length-1."""
    rng = np.random.default_rng(seed)
    eligible = sorted(e for e, n in lengths.items() if n >= 2)
    chosen = rng.choice(len(eligible), size=min(n_escalate, len(eligible)), replace=False)
    return {eligible[i]: int(rng.integers(1, lengths[eligible[i]])) for i in sorted(chosen)}


def rule_firings(base: pd.DataFrame, rates: Sequence[float], seed: int = RANDOM_SEED) -> pd.DataFrame:
    """Per (signal, rate, example): the threshold and the escalation index k (NaN when the answer never escalates).
    base: one row per example with `certificate` and `neg_logprob` (lists over the recorded tokens)."""
    rows = []
    n = len(base)
    lengths = dict(zip(base["example_id"], base["certificate"].map(len), strict=True))
    for rate in rates:
        for signal, column in (("certificate", "certificate"), ("confidence", "neg_logprob")):
            maxima = base[column].map(answer_max).to_numpy()
            t = matched_threshold(maxima, rate)
            for eid, values in zip(base["example_id"], base[column], strict=True):
                k = first_firing(list(values), t)
                rows.append(dict(signal=signal, rate=rate, threshold=t, example_id=eid, k=math.nan if k is None else k))
        picked = random_escalations(lengths, int(round(rate * n)), seed + int(round(rate * 1000)))
        for eid in base["example_id"]:
            rows.append(
                dict(signal="random", rate=rate, threshold=math.nan, example_id=eid, k=picked.get(eid, math.nan))
            )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------- the model side
def prompt_format_for(model) -> str:
    """What `generate` uses by default: the packaged model's prompt format, else auto."""
    from kvcert.hf.loading import EMBEDDED_MODELS, embedded_prompt_format

    name = getattr(model, "kvcert_name", None)
    return embedded_prompt_format(name) if name in EMBEDDED_MODELS else "auto"


def escalated_answer(
    model, tokenizer, *, context: str, question: str, prefix: list[int], max_new_tokens: int, prompt_format: str
) -> tuple[list[int], str]:
    """(tokens, answer text) of the answer that keeps `prefix` (the tokens before the escalation) and continues with
    the full cache from the prompt plus the prefix: what `generate` returns when it escalates to the full cache at
    token len(prefix)."""
    from kvcert.hf import FULL, DecodeOptions, Prompt, compress_while_reading
    from kvcert.hf.decode import answer_length, eos_ids
    from kvcert.serve.generate import build_prompt

    ids, qs, stops = build_prompt(
        tokenizer, context=context, question=question, messages=None, prompt_format=prompt_format
    )
    opts = DecodeOptions(
        max_new_tokens=max_new_tokens - len(prefix), stop_strings=tuple(stops), oracle=False, certificate=False
    )
    batch = compress_while_reading(
        model, Prompt(input_ids=ids + list(prefix), question_start=qs, example_id="kvcert-escalation"), [FULL], opts
    )
    (result,) = batch.decode(opts, tokenizer)
    tokens = list(prefix) + list(result.tokens)
    n_answer, text = answer_length(tokenizer, tokens, eos_ids(model, tokenizer), tuple(stops))
    return tokens[:n_answer], text


def run_base(model, tokenizer, example, *, calibration, seed: int, max_new_tokens: int, budget: float) -> dict:
    """One example without escalation (every decoded token's certificate and log-probability, the terminating token
    included) and with the full cache."""
    import torch

    from kvcert.policy import FULL
    from kvcert.serve.generate import generate
    from kvcert.tasks import score

    started = time.perf_counter()
    streamed = []
    with torch.no_grad():
        prompt = dict(context=example.context, question=example.question, max_new_tokens=max_new_tokens, seed=seed)
        out = generate(model, tokenizer, **prompt, budget=budget, calibration=calibration, escalate=None,
                       on_token=streamed.append)  # fmt: skip
        full = generate(model, tokenizer, **prompt, policy=FULL, calibration=None)
    sc, ok = score(out.text, example)
    fsc, fok = score(full.text, example)
    return dict(
        example_id=example.id,
        task=example.task,
        seed=seed,
        prompt_tokens=out.prompt_tokens,
        tokens=[t.id for t in streamed],
        certificate=[float(t.certificate) for t in streamed],
        neg_logprob=[-float(t.logprob) for t in streamed],
        n_answer=len(out.steps),
        stopped=out.stopped,
        text=out.text,
        score=float(sc),
        correct=bool(ok),
        kv_bytes=int(out.kv_bytes),
        full_kv_bytes=int(out.full_kv_bytes),
        full_measured_kv_bytes=int(full.kv_bytes),
        full_text=full.text,
        full_score=float(fsc),
        full_correct=bool(fok),
        calibration=out.calibration,
        reduction=out.reduction,
        wall_s=time.perf_counter() - started,
    )


# ------------------------------------------------------------------------------------------- work files
def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by an interrupted run: redone
                rows.append(json.loads(line))
    return rows


def _append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------- outcomes
def answers_table(base: pd.DataFrame, firings: pd.DataFrame, conts: pd.DataFrame) -> pd.DataFrame:
    """Per example and rule: escalated, k, correct, score, kv_bytes, extra_prefill, text. Rules: never (budget
    0.25 throughout), always_full (the full cache from the start) and each (signal, rate)."""
    b = base.set_index("example_id")
    c = conts.set_index(["example_id", "k"]) if len(conts) else None
    rows = []
    for eid, r in b.iterrows():
        common = dict(example_id=eid, task=r["task"], threshold=math.nan, k=math.nan, escalated=False, extra_prefill=0)
        rows.append(common | dict(signal="never", rate=0.0, correct=r["correct"], score=r["score"],
                                  kv_bytes=r["kv_bytes"], text=r["text"]))  # fmt: skip
        rows.append(common | dict(signal="always_full", rate=1.0, correct=r["full_correct"], score=r["full_score"],
                                  kv_bytes=r["full_kv_bytes"], text=r["full_text"]))  # fmt: skip
    for f in firings.itertuples(index=False):
        r = b.loc[f.example_id]
        row = dict(example_id=f.example_id, task=r["task"], signal=f.signal, rate=f.rate, threshold=f.threshold, k=f.k)
        if math.isnan(f.k):
            row |= dict(escalated=False, extra_prefill=0, correct=r["correct"], score=r["score"],
                        kv_bytes=r["kv_bytes"], text=r["text"])  # fmt: skip
        else:
            key = (f.example_id, int(f.k))
            if c is None or key not in c.index:
                continue  # continuation not computed yet (a partial run)
            cont = c.loc[key]
            row |= dict(escalated=True, extra_prefill=int(r["prompt_tokens"]) + int(f.k), correct=bool(cont["correct"]),
                        score=float(cont["score"]), kv_bytes=r["full_kv_bytes"], text=cont["text"])  # fmt: skip
        rows.append(row)
    out = pd.DataFrame(rows)
    out["correct"] = out["correct"].astype(bool)
    return out


def summarize(answers: pd.DataFrame, n_boot: int = N_BOOT, seed: int = BOOT_SEED) -> pd.DataFrame:
    """Per rule: escalated share, accuracy with its example-bootstrap interval, mean KV MiB, mean extra prefill,
    and for confidence / random the paired difference certificate - that rule (same example resamples)."""
    from kvcert.analysis.bootstrap import cluster_bootstrap, paired_difference, weighted_mean

    rules = answers[["signal", "rate"]].drop_duplicates().sort_values(["rate", "signal"])
    order = {"never": 0, "certificate": 1, "confidence": 2, "random": 3, "always_full": 4}
    rows = []
    for signal, rate in sorted(
        rules.itertuples(index=False), key=lambda x: (x[1] if x[0] != "always_full" else 2, order[x[0]])
    ):
        a = answers[(answers["signal"] == signal) & (answers["rate"] == rate)].sort_values("example_id")
        acc = cluster_bootstrap(weighted_mean(a["correct"].to_numpy(float)), a["example_id"], n_boot, seed)
        row = dict(
            signal=signal,
            rate=rate,
            n=len(a),
            escalated=float(a["escalated"].mean()),
            threshold=float(a["threshold"].iloc[0]) if len(a) else math.nan,
            accuracy=acc.estimate,
            acc_lo=acc.lo,
            acc_hi=acc.hi,
            kv_mib=float(a["kv_bytes"].mean() / MIB),
            extra_prefill=float(a["extra_prefill"].mean()),
            diff=math.nan,
            diff_lo=math.nan,
            diff_hi=math.nan,
        )
        if signal in ("confidence", "random"):
            cert = answers[(answers["signal"] == "certificate") & (answers["rate"] == rate)].sort_values("example_id")
            both = cert.merge(a, on="example_id", suffixes=("_c", "_o"))
            d = paired_difference(
                weighted_mean(both["correct_c"].to_numpy(float)),
                weighted_mean(both["correct_o"].to_numpy(float)),
                both["example_id"],
                n_boot,
                seed,
            )["diff"]
            row |= dict(diff=d.estimate, diff_lo=d.lo, diff_hi=d.hi)
        rows.append(row)
    return pd.DataFrame(rows)


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.1f}"


def write_report(
    out: Path, summary: pd.DataFrame, answers: pd.DataFrame, base: pd.DataFrame, meta: dict, checks: list[dict]
) -> Path:
    lines = [
        HEADER,
        "",
        f"# Online escalation: certificate vs confidence vs random triggers ({meta['model']})",
        "",
        f"- CPU: {meta['cpu']} ({meta['threads']} torch thread); wall time: {meta['wall_s'] / 60:.1f} min this "
        f"invocation, {meta['compute_s'] / 60:.1f} min of model calls recorded over all invocations",
        f"- Held-out examples: {meta['n_examples']} ({meta['n_per_task']} per task; tasks "
        f"{', '.join(meta['tasks'])} at {meta['context_tokens']} tokens; make_examples seed {meta['seed']}), "
        f"max_new_tokens {meta['max_new_tokens']}; {meta['n_continuations']} distinct (example, k) full-cache "
        "continuations computed",
        f"- Policy: window_question x randomized, tail 0.75, floor 0.2, budget {meta['budget']:g}; escalation: "
        "re-read the prompt and the tokens so far with the full cache (budget 1.0) and continue; at most one "
        "escalation per answer",
        f"- Certificate: {meta['certificate']}",
        "- Confidence: a token's negative log-probability under the compressed cache. Both signals fire at the first "
        "token after the first (token 0 is read exactly) whose value is above the threshold; the token that ended the "
        "answer (EOS / stop string) can fire, as in `generate`",
        "- Matched rates: each signal's threshold is the in-sample quantile of its per-answer maximum on these same "
        "examples; random escalates a seeded subset of the same size at a uniformly random token (one draw per rate)",
        "- KV memory: the compressed cache's bytes for an answer that never escalates, the full cache's "
        "(prompt + max_new_tokens) for one that does; extra prefill: prompt + k tokens re-read for an escalated "
        "answer, 0 otherwise (always-full reads the prompt once, with the full cache: 0 extra)",
        f"- Intervals: 95% percentile bootstrap over examples, {meta['n_boot']} resamples, seed {meta['boot_seed']}; "
        "differences are paired (same resamples, per-example correctness of both rules)",
        "",
    ]
    header = ["signal", "target rate", "escalated", "accuracy % [95% CI]", "mean KV MiB", "mean extra prefill tokens"]
    header.append("certificate - this rule (points) [95% CI]")
    rows = []
    for r in summary.itertuples(index=False):
        rate = "-" if r.signal in ("never", "always_full") else f"{r.rate:g}"
        escalated = "-" if r.signal == "always_full" else f"{r.escalated:.2f}"
        diff = "" if not math.isfinite(r.diff) else f"{_pct(r.diff)} [{_pct(r.diff_lo)}, {_pct(r.diff_hi)}]"
        accuracy = f"{_pct(r.accuracy)} [{_pct(r.acc_lo)}, {_pct(r.acc_hi)}]"
        rows.append([f"{r.signal}", rate, escalated, accuracy, f"{r.kv_mib:.1f}", f"{r.extra_prefill:.0f}", diff])
    lines.append(markdown_table(pd.DataFrame(rows, columns=header), parse_numbers=False))
    # per task accuracy
    lines += ["", "Accuracy % by task:", ""]
    tasks = list(meta["tasks"])
    by_task = answers.groupby(["signal", "rate", "task"])["correct"].mean()
    rows = []
    for r in summary.itertuples(index=False):
        rate = "-" if r.signal in ("never", "always_full") else f"{r.rate:g}"
        vals = [_pct(float(by_task.get((r.signal, r.rate, t), math.nan))) for t in tasks]
        rows.append([f"{r.signal}", rate, *vals])
    lines.append(markdown_table(pd.DataFrame(rows, columns=["signal", "target rate", *tasks]), parse_numbers=False))
    never = base["correct"].to_numpy(bool)
    full = base["full_correct"].to_numpy(bool)
    lines += [
        "",
        f"Cache-induced failures (full cache right, budget {meta['budget']:g} wrong): {int((full & ~never).sum())} of "
        f"{len(base)}; full cache wrong, budget {meta['budget']:g} right: {int((~full & never).sum())}; both wrong: "
        f"{int((~full & ~never).sum())}.",
    ]
    ids = base.set_index("example_id")
    for rate in meta["rates"]:
        parts = []
        for signal in SIGNALS:
            a = answers[(answers["signal"] == signal) & (answers["rate"] == rate) & answers["escalated"]]
            hit = int(
                (
                    ids.loc[a["example_id"], "full_correct"].to_numpy()
                    & ~ids.loc[a["example_id"], "correct"].to_numpy()
                ).sum()
            )
            parts.append(f"{signal} {len(a)} escalated, {hit} of them cache-induced failures")
        lines.append(f"- rate {rate:g}: " + "; ".join(parts))
    if checks:
        lines += ["", "Check: the escalated answer built from the recorded prefix + full-cache continuation equals "
                  "`generate(..., escalate=Escalation(...))` run for real:", ""]  # fmt: skip
        for c in checks:
            lines.append(
                f"- {c['example_id']} ({c['signal']} threshold {c['threshold']:.4g}): escalation at token {c['k']} "
                f"(generate: {c['generate_k']}), same tokens: {c['same_tokens']}, same text: {c['same_text']}"
            )
    lines += ["", f"Verdict: {meta['verdict']}", "", "Figure: escalation.png", ""]
    path = out / "escalation.md"
    path.write_text("\n".join(lines))
    return path


def verdict(summary: pd.DataFrame) -> str:
    conf = summary[summary["signal"] == "confidence"].sort_values("rate")
    rnd = summary[summary["signal"] == "random"].sort_values("rate")
    parts = []
    for name, tab in (("confidence", conf), ("random", rnd)):
        wins = [f"{r.rate:g}" for r in tab.itertuples() if r.diff_lo > 0]
        losses = [f"{r.rate:g}" for r in tab.itertuples() if r.diff_hi < 0]
        pts = ", ".join(f"{r.rate:g}: {_pct(r.diff)}" for r in tab.itertuples())
        if wins and not losses:
            s = f"the certificate beats {name} at rates {', '.join(wins)} (interval above 0)"
        elif losses and not wins:
            s = f"the certificate does worse than {name} at rates {', '.join(losses)} (interval below 0)"
        elif wins and losses:
            s = f"mixed against {name}: better at {', '.join(wins)}, worse at {', '.join(losses)}"
        else:
            s = f"the certificate does not beat {name}: no interval excludes 0"
        parts.append(f"{s} (differences in points by rate: {pts})")
    return "; ".join(parts) + "."


def plot(out: Path, summary: pd.DataFrame) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"certificate": "tab:blue", "confidence": "tab:orange", "random": "tab:gray"}
    never = summary[summary["signal"] == "never"].iloc[0]
    full = summary[summary["signal"] == "always_full"].iloc[0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    panels = ((axes[0], "kv_mib", "mean KV memory held (MiB)"), (axes[1], "extra_prefill", "mean extra prefill tokens"))
    for ax, x, label in panels:
        span = float(summary[x].max() - summary[x].min()) or 1.0
        for dodge, (signal, color) in zip((-1, 0, 1), colors.items(), strict=True):
            s = summary[summary["signal"] == signal].sort_values("rate")
            s = s.assign(**{x: s[x] + dodge * 0.008 * span})  # matched rates share an x: dodged apart a little
            xs = [never[x], *s[x], full[x]] if x == "kv_mib" else [never[x], *s[x]]
            ys = (
                [never["accuracy"], *s["accuracy"], full["accuracy"]]
                if x == "kv_mib"
                else [never["accuracy"], *s["accuracy"]]
            )
            ax.plot(xs, ys, "-", color=color, alpha=0.35)
            ax.errorbar(s[x], s["accuracy"], yerr=[s["accuracy"] - s["acc_lo"], s["acc_hi"] - s["accuracy"]], fmt="o",
                        color=color, capsize=3, label=signal)  # fmt: skip
            for r in s.itertuples():
                ax.annotate(f"{r.rate:g}", (getattr(r, x), r.accuracy), textcoords="offset points",
                            xytext=(4, 4 - 7 * dodge),
                            fontsize=7, color=color)  # fmt: skip
        for end, marker, color, name in (
            (never, "s", "black", "never escalate"),
            (full, "D", "tab:green", "always full"),
        ):
            yerr = [[end["accuracy"] - end["acc_lo"]], [end["acc_hi"] - end["accuracy"]]]
            ax.errorbar([end[x]], [end["accuracy"]], yerr=yerr, fmt=marker, color=color, capsize=3, label=name)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(HEADER + " (numbers: target escalation rate)", fontsize=9)
    fig.tight_layout()
    path = out / "escalation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcert.exploratory.escalation", description=__doc__.split("\n")[0])
    p.add_argument("--n-per-task", type=int, default=24)
    p.add_argument("--out", default="results/exploratory/escalation")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--context-tokens", type=int, default=CONTEXT_TOKENS)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    p.add_argument("--budget", type=float, default=BUDGET)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--n-boot", type=int, default=N_BOOT)
    p.add_argument("--verify", type=int, default=2, help="escalated answers checked against generate() for real")
    p.add_argument("--calibration", default="shipped", help="shipped | none | a calibration file")
    args = p.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from kvcert.serve import load_model
    from kvcert.serve.calibration import Calibration
    from kvcert.serve.generate import Escalation, generate
    from kvcert.tasks import make_examples, score

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in args.tasks.split(",") if t]
    rates = [float(r) for r in args.rates.split(",")]
    model, tokenizer = load_model(args.model)
    fmt = prompt_format_for(model)
    cal_path = Path(__file__).resolve().parents[1] / "serve" / "calibrations" / f"{args.model}.json"
    if args.calibration == "shipped" and cal_path.is_file():
        cal = Calibration.load(cal_path)
    elif args.calibration not in ("shipped", "none"):
        cal = Calibration.load(args.calibration)
    else:
        cal = None
    if cal is not None:
        cert_desc = (
            f"calibrated ({cal.model} calibration file, fitted on seeds {cal.data.get('seeds', '?')}: per-layer "
            f"multipliers x the relative radius at level {cal.level}, reduced over layers and heads by "
            f"'{cal.reduction}')"
        )
    else:
        cert_desc = "UNCALIBRATED relative radius (multipliers 1, reduction 'max'): no calibration file was used"

    examples = []
    for ti, task in enumerate(tasks):
        for i, ex in enumerate(make_examples(task, args.n_per_task, args.context_tokens, tokenizer, seed=args.seed)):
            examples.append((ex, args.seed + 1000 * ti + i))
    by_id = {ex.id: ex for ex, _ in examples}

    # 1. every example once without escalation (signals recorded) and once with the full cache
    base_path = out / "base.jsonl"
    done = {r["example_id"]: r for r in _read_jsonl(base_path)}
    for j, (ex, seed) in enumerate(examples):
        if ex.id in done:
            continue
        row = run_base(model, tokenizer, ex, calibration=cal, seed=seed, max_new_tokens=args.max_new_tokens,
                       budget=args.budget)  # fmt: skip
        _append_jsonl(base_path, row)
        done[ex.id] = row
        verdicts = ["right" if row[c] else "wrong" for c in ("correct", "full_correct")]
        print(f"[base {j + 1}/{len(examples)}] {ex.id}: budget {args.budget:g} {verdicts[0]}, full {verdicts[1]}, "
              f"{len(row['tokens'])} tokens "
              f"({row['wall_s']:.1f} s, {time.perf_counter() - started:.0f} s in all)", flush=True)  # fmt: skip
    base = pd.DataFrame([done[ex.id] for ex, _ in examples])

    # 2. the rules' firing indices, then one full-cache continuation per distinct (example, k)
    firings = rule_firings(base, rates)
    cont_path = out / "continuations.jsonl"
    conts = {(r["example_id"], r["k"]): r for r in _read_jsonl(cont_path)}
    needed = sorted({(f.example_id, int(f.k)) for f in firings.itertuples() if not math.isnan(f.k)})
    print(f"{len(needed)} continuations needed, {sum(k in conts for k in needed)} done", flush=True)
    tokens_of = dict(zip(base["example_id"], base["tokens"], strict=True))
    for j, (eid, k) in enumerate(needed):
        if (eid, k) in conts:
            continue
        t0 = time.perf_counter()
        ex = by_id[eid]
        toks, text = escalated_answer(model, tokenizer, context=ex.context, question=ex.question, prompt_format=fmt,
                                      prefix=tokens_of[eid][:k], max_new_tokens=args.max_new_tokens)  # fmt: skip
        sc, ok = score(text, ex)
        row = dict(example_id=eid, k=k, tokens=toks, text=text, score=float(sc), correct=bool(ok),
                   wall_s=time.perf_counter() - t0)  # fmt: skip
        _append_jsonl(cont_path, row)
        conts[(eid, k)] = row
        print(f"[continuation {j + 1}/{len(needed)}] {eid} at {k}: {'right' if ok else 'wrong'} "
              f"({row['wall_s']:.1f} s, {time.perf_counter() - started:.0f} s in all)", flush=True)  # fmt: skip
    cont_df = pd.DataFrame(list(conts.values()))

    # 3. a check against generate() run for real, on the first escalated answers of the certificate and confidence
    checks = []
    per_signal = []
    for signal in ("certificate", "confidence"):
        f = firings[(firings["signal"] == signal) & (firings["rate"] == max(rates)) & firings["k"].notna()]
        per_signal.append([(signal, r) for r in f.itertuples()])
    candidates = [c for pair in zip(*per_signal, strict=False) for c in pair]  # certificate, confidence, ...
    for signal, f in candidates[: max(0, args.verify)]:
        ex, seed = by_id[f.example_id], int(base.set_index("example_id").loc[f.example_id, "seed"])
        with torch.no_grad():
            g = generate(model, tokenizer, context=ex.context, question=ex.question, budget=args.budget,
                         calibration=cal, escalate=Escalation(signal=signal, threshold=f.threshold, budget=1.0),
                         max_new_tokens=args.max_new_tokens, seed=seed)  # fmt: skip
        mine = conts[(f.example_id, int(f.k))]
        checks.append(
            dict(
                example_id=f.example_id,
                signal=signal,
                threshold=f.threshold,
                k=int(f.k),
                generate_k=g.escalations[0].token if g.escalations else None,
                same_tokens=g.tokens == mine["tokens"],
                same_text=g.text == mine["text"],
            )  # fmt: skip
        )
        print(f"[check] {checks[-1]}", flush=True)

    # 4. outcomes, table, figure
    answers = answers_table(base, firings, cont_df)
    answers.to_parquet(out / "answers.parquet", index=False)
    summary = summarize(answers, args.n_boot)
    summary.to_csv(out / "summary.csv", index=False)
    meta = dict(
        model=args.model,
        cpu=cpu_model(),
        threads=torch.get_num_threads(),
        wall_s=time.perf_counter() - started,
        compute_s=float(base["wall_s"].sum() + (cont_df["wall_s"].sum() if len(cont_df) else 0.0)),
        n_examples=len(base),
        n_continuations=len(needed),
        n_per_task=args.n_per_task,
        tasks=tasks,
        context_tokens=args.context_tokens,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget,
        certificate=cert_desc,
        n_boot=args.n_boot,
        boot_seed=BOOT_SEED,
        rates=rates,
        verdict=verdict(summary),
    )
    path = write_report(out, summary, answers, base, meta, checks)
    plot(out, summary)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
