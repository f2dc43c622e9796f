"""EXPLORATORY: the calibrated budget (`kvcert calibrate-budget`) validated on real prompts by repeated splits.

    python -m kvcert.exploratory.budget_validation collect --model smollm2 --tasks single_needle,fact_qa \
        --lengths 512,1024 --n 20 --seed 7000 --out results/exploratory/budget/smollm2_losses.json
    python -m kvcert.exploratory.budget_validation analyse results/exploratory/budget/smollm2_losses.json \
        --out results/exploratory/budget/smollm2 [--alpha 0.2 --delta 0.2] [--splits 200]

Not pre-registered and not part of the scorecard. `collect` runs `kvcert.calibrate_budget` once over all the prompts
(the full cache and the ladder decoded from one read per prompt; every prompt's losses and KV shares are kept in the
file). `analyse` then reuses those losses: over `--splits` random splits, half of each task x length group calibrates
and the other half tests (`kvcert.core.risk_control.repeat_splits`), for LTT and CRC, pooled (one budget) and per
kind (each group its own): the realized test risk against alpha, the share of splits within alpha, and the mean KV
share held. Negative control: calibrate on one task's prompts and serve another task's with that budget; the realized
risk there, and whether the stream monitor (`kvcert.core.risk_monitor`) flags the stream of the other task's
answers (each prompt's loss fed in turn). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from kvcert.analysis.tables import markdown_table
from kvcert.core.risk_control import RiskControlError, loss_at, repeat_splits, select
from kvcert.core.risk_monitor import RiskMonitor
from kvcert.records import cpu_model


def collect(args) -> None:
    import torch

    from kvcert.hf.loading import ALIASES
    from kvcert.serve import load_model
    from kvcert.serve.budget_calibration import calibrate_budget

    torch.set_num_threads(args.threads)
    name = ALIASES.get(args.model, args.model)
    model, tok = load_model(name)
    tasks = [t for t in args.tasks.split(",") if t]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    out = calibrate_budget(model, tok, tasks=tasks, lengths=lengths, n=args.n, seed=args.seed, method="crc",
                           alpha=0.5, max_new_tokens=args.max_new_tokens, model_name=name)  # fmt: skip
    out.data.update(cpu=cpu_model(), threads=args.threads)
    out.save(args.out)
    print(f"wrote {args.out} ({out.n} prompts, {out.data['wall_s']} s on {out.data['cpu']}, {args.threads} thread)")


def _negative_control(prompts, ladder, alpha, delta, method) -> list[dict]:
    """Per task x length group A and every other task B: the budget chosen on all of A's prompts, its risk on A's
    own prompts, the realized risk on B's prompts (every length, in a seeded random order) served at that budget,
    and whether the monitor flags that stream. A group whose budget is the full cache cannot break (its loss is 0)."""
    rng = np.random.default_rng(0)
    rows = []
    for a in sorted({p["group"] for p in prompts}):
        cal = np.array([p["loss"] for p in prompts if p["group"] == a])
        try:
            sel = select(cal, ladder, alpha, delta, method)
        except RiskControlError as err:
            rows.append(dict(calibrated_on=a, served="-", refused=str(err)))
            continue
        for b in sorted({p["group"].split("@")[0] for p in prompts} - {a.split("@")[0]}):
            test = np.array([p["loss"] for p in prompts if p["group"].split("@")[0] == b])
            losses = rng.permutation(loss_at(test, ladder, sel.budget))
            monitor = RiskMonitor(alpha=alpha, delta=0.05, window=10)
            for loss in losses:
                monitor.update(loss)
            rows.append(dict(calibrated_on=a, served=b, budget=sel.budget, risk_on_own=float(loss_at(cal, ladder,
                             sel.budget).mean()), risk_served=float(losses.mean()), n_served=len(losses),
                             flagged_at=monitor.flagged_at, monitor=monitor.line()))  # fmt: skip
    return rows


def analyse(args) -> None:
    raw = json.loads(Path(args.losses).read_text())
    prompts, ladder = raw["prompts"], raw["ladder"]
    losses = np.array([p["loss"] for p in prompts])
    kv = np.array([p["kv"] for p in prompts])
    groups = [p["group"] for p in prompts]
    results = dict(model=raw["model"], n=len(prompts), ladder=ladder, loss=raw["loss"], data=raw["data"],
                   alpha=args.alpha, delta=args.delta, splits=args.splits, methods={})  # fmt: skip
    results["empirical_risk"] = {g: [float(x) for x in losses[np.array(groups) == g].mean(axis=0)]
                                 for g in sorted(set(groups))}  # fmt: skip
    for method in ("ltt", "crc"):
        results["methods"][method] = repeat_splits(losses, groups, ladder, args.alpha, args.delta, method, kv,
                                                   n_splits=args.splits, seed=0)  # fmt: skip
    results["negative_control"] = _negative_control(prompts, ladder, args.alpha, args.delta, "ltt")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=1) + "\n")  # (not with_suffix: "alpha0.2" has a dot)
    Path(f"{out}.md").write_text(_markdown(results) + "\n")
    print(_markdown(results))


def _markdown(r: dict) -> str:
    d = r["data"]
    lines = [f"# Calibrated budget on real prompts: {r['model']} (exploratory)", "",
             f"{r['n']} prompts ({', '.join(d['tasks'])} at {', '.join(map(str, d['lengths']))} tokens, "
             f"{d['n_per_task']} per task and length, make_examples seed {d['seed']}), loss `{r['loss']}` (the answer "
             f"differs from the full cache's), ladder {', '.join(f'{b:g}' for b in r['ladder'])} and the full cache; "
             f"collected in {d['wall_s']:.0f} s on {d.get('cpu', '?')}, {d.get('threads', '?')} thread(s), shared "
             f"with other jobs. alpha {r['alpha']:g}, delta {r['delta']:g} (LTT); {r['splits']} splits, half of "
             "each task x length group calibrating, the other half testing.", "",
             "Empirical risk per budget and group (all prompts):", ""]  # fmt: skip
    risk = [
        {"group": g, **{f"{b:g}": f"{x:.2f}" for b, x in zip(r["ladder"], xs)}} for g, xs in r["empirical_risk"].items()
    ]
    rows = []
    for method, m in r["methods"].items():
        rows.append([method, "pooled", f"{m['pooled_budget']:.3f}", f"{m['pooled_risk']:.3f}",
                     f"{m['pooled_within_alpha']:.2f}", f"{m['pooled_kv']:.3f}"])  # fmt: skip
        rows.append([method, "per kind", "-", f"{m['kind_risk']:.3f}", f"{m['kind_within_alpha']:.2f}",
                     f"{m['kind_kv']:.3f}"])  # fmt: skip
        for g, v in m["groups"].items():
            rows.append([method, g, f"{v['mean_budget']:.3f}", f"{v['risk']:.3f}", f"{v['within_alpha']:.2f}", "-"])
    methods = pd.DataFrame(rows, columns=["method", "scope", "mean budget", "realized test risk",
                                          "splits within alpha", "mean KV share"])  # fmt: skip
    control = []
    for row in r["negative_control"]:
        if "refused" in row:
            control.append([row["calibrated_on"], row["served"], f"refused: {row['refused']}", "", "", ""])
            continue
        flag = f"flagged at answer {row['flagged_at']}" if row["flagged_at"] else "not flagged"
        control.append([row["calibrated_on"], row["served"], f"{row['budget']:g}", f"{row['risk_on_own']:.3f}",
                        f"{row['risk_served']:.3f} ({row['n_served']})", flag])  # fmt: skip
    control_df = pd.DataFrame(control, columns=["calibrated on", "served", "budget", "risk on own prompts",
                                                "risk served", "monitor"])  # fmt: skip
    lines += [markdown_table(pd.DataFrame(risk), parse_numbers=False), "", markdown_table(methods, parse_numbers=False),
              "", "Negative control (LTT; the budget chosen on one task x length group's prompts, served to another "
              "task's prompts at every length; the monitor at delta 0.05, a new wealth process every 10 answers):", "",
              markdown_table(control_df, parse_numbers=False)]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.exploratory.budget_validation")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--model", default="smollm2")
    c.add_argument("--tasks", default="single_needle,fact_qa")
    c.add_argument("--lengths", default="512,1024")
    c.add_argument("--n", type=int, default=20)
    c.add_argument("--seed", type=int, default=7000)
    c.add_argument("--max-new-tokens", type=int, default=24)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--out", required=True)
    a = sub.add_parser("analyse")
    a.add_argument("losses")
    a.add_argument("--alpha", type=float, default=0.2)
    a.add_argument("--delta", type=float, default=0.2)
    a.add_argument("--splits", type=int, default=200)
    a.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    (collect if args.command == "collect" else analyse)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
