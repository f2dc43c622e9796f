"""EXPLORATORY: certificate coverage of the scorers ported from kvpress under the randomized design.

    python -m kvcert.exploratory.kvpress_scorers [--per-task 1] [--context-tokens 1024] \\
        [--out results/exploratory/kvpress_scorers.md]

A few examples of the five study tasks (1k tokens, seeds 9400+, disjoint from the studies'), the packaged
SmolLM2-135M in float32, verification mode (the oracle: the exact full-cache attention output of every decode step).
Every ported scorer plus window_question (the studies' scorer, for reference) under the randomized design (tail
fraction 0.75, floor 0.2, as the studies') at budgets 0.25 and 0.5, kvcert's default compression time (after the
prompt; snapkv and critical_snapkv read the last context tokens, so after the context). Per scorer and budget: the
share of certified (step, layer, head) cells whose exact error is within the conservative radius 1.96 sqrt(V_hat)
and within the tight radius (chi-square, tr(C^2)), the worst layer's coverage, and the answers' accuracy. Not
pre-registered and not part of any scorecard.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers.utils import logging as hf_logging

from kvcert.core.certificate import tight_radius
from kvcert.hf import DecodeOptions, generate_variants, load_model
from kvcert.policy import FULL, Policy
from kvcert.tasks import TASKS, make_examples, render, score

MODEL = "smollm2-135m-instruct"
SEED = 9400
SCORERS = ("window_question", "snapkv", "tova", "observed_attention", "expected_attention", "critical_snapkv")
BUDGETS = (0.25, 0.5)
Z95 = 1.959963984540054


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def cells(per_task: int, context_tokens: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    model, tok = load_model(MODEL)
    policies = [FULL] + [
        Policy(scorer=s, design="randomized", budget=b, tail_fraction=0.75, floor=0.2) for s in SCORERS for b in BUDGETS
    ]
    rows, answers = [], []
    for t_i, task in enumerate(TASKS):
        for example in make_examples(task, per_task, context_tokens, tok, seed=SEED + t_i):
            r = render(example, tok)
            options = DecodeOptions(max_new_tokens=24, stop_strings=r.stop_strings)
            for res in generate_variants(model, tok, r, policies, options):
                if res.policy.is_full:
                    continue
                answers.append(
                    {"scorer": res.policy.scorer, "budget": res.policy.budget, "score": score(res.answer, example)[0]}
                )
                var = res.stats["variance"].astype(np.float64)
                err = res.stats["error"].astype(np.float64)
                tight = tight_radius(torch.from_numpy(var), torch.from_numpy(res.stats["trace_c2"].astype(np.float64)))
                layer = np.broadcast_to(np.arange(var.shape[1])[None, :, None], var.shape)
                ok = np.isfinite(var) & np.isfinite(err) & (var >= 0)
                rows.append(
                    pd.DataFrame(
                        {
                            "scorer": res.policy.scorer,
                            "budget": res.policy.budget,
                            "layer": layer[ok],
                            "covered": err[ok] <= Z95 * np.sqrt(var[ok]),
                            "covered_tight": err[ok] <= tight.numpy()[ok],
                        }
                    )
                )
    return pd.concat(rows, ignore_index=True), pd.DataFrame(answers)


def table(c: pd.DataFrame, answers: pd.DataFrame) -> pd.DataFrame:
    g = c.groupby(["scorer", "budget"], sort=False)
    out = pd.DataFrame(
        {
            "cells": g.size(),
            "coverage (1.96 sqrt V)": g.covered.mean(),
            "coverage (tight)": g.covered_tight.mean(),
            "worst layer (1.96 sqrt V)": c.groupby(["scorer", "budget", "layer"], sort=False)
            .covered.mean()
            .groupby(level=[0, 1], sort=False)
            .min(),
        }
    )
    out["accuracy"] = answers.groupby(["scorer", "budget"], sort=False).score.mean()
    out["examples"] = answers.groupby(["scorer", "budget"], sort=False).size()
    return out.reset_index()


def markdown(df: pd.DataFrame) -> str:
    from kvcert.analysis.tables import markdown_table

    return markdown_table(df, floatfmt=".3f")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--out", default="results/exploratory/kvpress_scorers.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    c, answers = cells(args.per_task, args.context_tokens)
    text = (
        "# EXPLORATORY: certificate coverage of the scorers ported from kvpress (randomized design)\n\n"
        "Not pre-registered, not part of any scorecard: a small look at whether the ported scorers keep the\n"
        f"certificate's coverage. {MODEL} float32, verification mode (exact full-cache oracle), "
        f"{args.per_task} example(s) per study task x {len(TASKS)} tasks, about {args.context_tokens} context tokens, "
        f"seeds {SEED}+; randomized design, tail fraction 0.75, floor 0.2; cells = certified (decode step, layer, "
        "query head) cells with a finite V_hat.\n\n"
        f"{markdown(table(c, answers))}\n\n"
        f"Produced by `python -m kvcert.exploratory.kvpress_scorers --per-task {args.per_task} "
        f"--context-tokens {args.context_tokens}` (OMP_NUM_THREADS=1) on: {cpu_model()}.\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
